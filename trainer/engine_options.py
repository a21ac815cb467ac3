"""The options of a target served by an engine (``--target-engine``, how its states travel:
``trainer.engine``): a section of ``dflash-train train``'s options (``trainer.sections``),
listed under the target's in ``--help`` and in a config file's ``[target]`` table. Part of
the trainer's foundation: it imports nothing of the trainer but ``trainer.options``, and no
torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.options import TARGET, Options, opt

#: ``--target-engine``: the target in each rank, or served by vLLM (``trainer.engine``).
ENGINES = ("none", "vllm")
#: ``--states-transport``: how the states travel (``trainer.engine.seam.TRANSPORTS``); auto:
#: shm when the server is on this machine, else mooncake with a master, else files.
TRANSPORTS = ("auto", "shm", "files", "mooncake")
#: ``--states-dtype``: the states as the engine computed them, or cast for the wire
#: (``trainer.engine.supply.WIRE_NAMES``).
STATES_DTYPES = ("engine", "bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class EngineSection(Options):
    """Where the target's features come from, and how they travel (the checks that tie
    them to other sections' options are ``RunOptions``')."""

    target_engine: str = opt(
        "none",
        "Where the target's features come from: none (the target runs in each rank) or vllm "
        "(a vLLM server computes them; the trainer reads only the target folder's embedding, "
        "final norm and LM head, and measures no tau while training).",
        choices=ENGINES, section=TARGET,
        before="none",
    )  # fmt: skip
    engine_url: str | None = opt(
        None,
        "--target-engine vllm: a vLLM server you run, serving --target as `dflash-train "
        "engine-command` prints; unset: rank 0 starts one with --vllm-python.",
        section=TARGET,
        before=None,
    )
    vllm_python: Path | None = opt(
        None,
        "--target-engine vllm without --engine-url: the python of vLLM's virtualenv, which "
        "rank 0 runs the server with.",
        path={"exists": True, "dir_okay": False}, section=TARGET,
        before=None,
    )  # fmt: skip
    engine_dir: Path | None = opt(
        None,
        "Where this machine finds the hidden-state files the server writes (its "
        "shared_storage_path as mounted here) [the path the server names; a started "
        "server: the run's folder in /dev/shm].",
        path={"exists": True, "file_okay": False}, show_default=False, section=TARGET,
        before=None,
    )  # fmt: skip
    engine_inflight: int = opt(
        32, "Documents each rank keeps in flight to the engine, read ahead of the plan.",
        section=TARGET,
        at_least=1, before=32,
    )  # fmt: skip
    engine_timeout_s: float = opt(
        300.0,
        "How long a server that stopped answering is waited for before the run stops (after "
        "a final checkpoint; --resume continues).",
        section=TARGET,
        above=0,
        before=300.0,
    )
    states_transport: str = opt(
        "auto",
        "How the states travel from the server: shm (an arena of each rank's in shared "
        "memory, the server on this machine), files (one file per document, in a folder "
        "both see), mooncake (a Mooncake store, across machines); auto: shm for a server "
        "on this machine, else mooncake with --mooncake-master, else files.",
        choices=TRANSPORTS, section=TARGET,
        before="files",
    )  # fmt: skip
    states_dtype: str = opt(
        "engine", "The dtype the states travel in: engine (as computed), bf16, or fp8 (e4m3, "
        "a scale per token and layer; docs/TRAINER.md, 'Precision on the wire').",
        choices=STATES_DTYPES, section=TARGET,
        before="engine",
    )  # fmt: skip
    states_buffer_mb: int = opt(
        2048,
        "Each rank's memory for the states read ahead, in MiB: the shm arena (its pages "
        "made as the first documents are written, then reused), or Mooncake's segment and "
        "receive buffer.",
        section=TARGET,
        at_least=1,
        before=2048,
        was=("states_shm_mb",),
    )
    mooncake_master: str | None = opt(
        None,
        "--states-transport mooncake: the store's master, HOST:PORT (`dflash-train "
        "engine-command --states-transport mooncake` prints how to start one) [a server the "
        "run starts: rank 0 starts one beside it].",
        section=TARGET,
        before=None,
    )
    mooncake_metadata: str | None = opt(
        None,
        "The Mooncake metadata server's URL [http://MASTER_HOST:8080/metadata: the "
        "master's own HTTP metadata server].",
        section=TARGET,
        before=None,
    )
    mooncake_protocol: str = opt(
        "tcp", "How Mooncake moves the bytes: tcp, or rdma (with --mooncake-device).",
        choices=("tcp", "rdma"), section=TARGET,
        before="tcp",
    )  # fmt: skip
    mooncake_device: str = opt(
        "",
        "--mooncake-protocol rdma: the RDMA devices (e.g. mlx5_0,mlx5_1).",
        section=TARGET,
        before="",
    )

    @property
    def engine(self) -> bool:
        """The target's features come from an engine, not from a target in this process."""
        return self.target_engine != "none"
