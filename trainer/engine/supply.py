"""A run's states supply: the ``EngineTarget``, the server (one rank 0 starts and owns, or
the user's at ``--engine-url``), the transport each rank's states travel by, and the client
each rank fetches them with. It picks the engine and the transport by name
(``trainer.engine.seam``) and never branches on them after that.

With ``--vllm-python`` rank 0 starts the server on its machine, its files and arenas in the
run's private folder in ``/dev/shm`` (``states_folder``), and tells the other ranks its URL
and folder (one broadcast; a server that does not start is every rank's error, not a wait
for a collective's timeout); the folder is removed with the server. A job over several
machines runs its own server and passes ``--engine-url`` (with ``--engine-dir`` where its
folder appears on this machine, or a Mooncake master).

Which requests are the run's: rank 0 keeps a random id in the run folder (``ENGINE_ID``;
made at the first start, read again by every resume) and draws a new one for each start
of the job; every rank takes both from it (``run_identity``). Request ids, and so what the
server writes, carry them (``trainer.engine.client``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.engine import seam
from trainer.engine.client import StateClient
from trainer.engine.errors import EngineError
from trainer.engine.feed import EngineFeed
from trainer.engine.folders import own_folder
from trainer.engine.http import loopback
from trainer.engine.target import EngineTarget
from trainer.model.target import run_dtype
from trainer.option_values import parse_int_list
from trainer.sections import RunOptions
from trainer.train.batches import BatchSource
from trainer.train.distributed import DistEnv, control_broadcast

#: The logs of a server a run starts, and of the Mooncake master it starts, in its run folder.
SERVER_LOG = "vllm-engine.log"
MASTER_LOG = "mooncake-master.log"
#: The file in the run folder that holds the run's engine id.
ENGINE_ID = "engine-id"
#: ``--states-dtype``'s values, as a request names them to the connector
#: (``trainer.vllm.connector.dflash_states_wire.WIRE``; ``""``: the engine's own).
WIRE_NAMES = {"engine": "", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def run_id(run_dir: Path) -> str:
    """The run's engine id (``ENGINE_ID`` in ``run_dir``, made on first use): random, so
    two runs never share one (not even two of the same folder path on two machines)."""
    path = Path(run_dir) / ENGINE_ID
    with contextlib.suppress(FileNotFoundError):
        found = path.read_text().strip()
        if found.isalnum() and 8 <= len(found) <= 32:
            return found
    made = secrets.token_hex(6)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{ENGINE_ID}.{made}")
    part.write_text(made + "\n")
    os.replace(part, path)
    return made


def run_identity(run_dir: Path, env: DistEnv) -> str:
    """``RUN-INC``: the run's id and this start's, rank 0's on every rank (one broadcast)."""
    mine = f"{run_id(run_dir)}-{secrets.token_hex(3)}" if env.is_main else None
    return str(control_broadcast(mine, env))


def states_folder(run: str | None = None) -> Path:
    """Where a started server's files and the ranks' arenas go, in ``/dev/shm`` where
    there is one: ``dflash-engine-RUN`` (by the run's id: the run resumed after a kill
    finds it again and removes what the killed one left there), or a fresh one. Not made
    here: ``own_folder`` makes it private, or refuses one someone else made."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    if run is None:
        return Path(tempfile.mkdtemp(prefix="dflash-engine-", dir=base))
    return base / f"dflash-engine-{run}"


def transport_name(opts: RunOptions) -> str:
    """``--states-transport``, with auto resolved: shm for a server on this machine (one
    the run starts, or a loopback URL), files otherwise."""
    if opts.states_transport != "auto":
        return opts.states_transport
    if opts.engine_url is None or loopback(opts.engine_url):
        return "shm"
    return "mooncake" if opts.mooncake_master else "files"


def connector_config(folder: Path | None, **mooncake: str) -> dict[str, Any]:
    """The connector's settings (``kv_connector_extra_config``): the folder (its files, or
    the ranks' arenas: for trainers on its machine), and, given a master, the Mooncake
    store's addresses (``master``, ``metadata``, ``protocol``, ``device``: for trainers on
    other machines). Each request says which way its states go."""
    out: dict[str, Any] = {"shared_storage_path": str(folder)}
    if mooncake.get("master"):
        from trainer.engine.mooncake import connector_config as store

        out.update(store(**mooncake))
    return out


def mooncake_settings(opts: RunOptions) -> dict[str, str]:
    """The run's Mooncake addresses (``MooncakeTransport``'s and the connector's)."""
    from trainer.engine.mooncake import metadata_url

    master = opts.mooncake_master or ""
    return {
        "master": master,
        "protocol": opts.mooncake_protocol,
        "device": opts.mooncake_device,
        "metadata": opts.mooncake_metadata or (metadata_url(master, 8080) if master else ""),
    }


@contextlib.contextmanager
def engine_side(
    opts: RunOptions, env: DistEnv
) -> Iterator[tuple[EngineTarget, Callable[[BatchSource], EngineFeed]]]:
    """The run's ``EngineTarget`` and what wraps its loader client into an ``EngineFeed``;
    the server (when started here) stopped, and what the run wrote removed, on leaving."""
    engine = seam.engine(opts.target_engine)
    target = EngineTarget(Path(opts.target), parse_int_list(opts.layers), env.device,
                          run_dtype(env.device), engine)  # fmt: skip
    name = transport_name(opts)
    with contextlib.ExitStack() as stack:
        url, folder = opts.engine_url, opts.engine_dir
        alive: Callable[[], str | None] | None = None
        dtype = None  # a user's server: its first document says
        run = run_identity(opts.run_dir, env)
        store = mooncake_settings(opts) if name == "mooncake" else {}
        if url is None:
            url, folder, alive, store = _owned(stack, engine, target, opts, env, run, name, store)
            dtype = torch.float32  # vllm_command's
        transport = seam.transport_class(name)(
            folder, run=run, rank=env.rank, size_mb=opts.states_buffer_mb, **store
        )  # fmt: skip
        client = StateClient(
            url, run=run, rank=env.rank, num_states=len(target.engine_ids),
            hidden_size=target.hidden_size, inflight=opts.engine_inflight,
            timeout_s=opts.engine_timeout_s, alive=alive, dtype=dtype,
            target=Path(opts.target), engine=engine, transport=transport,
            wire=WIRE_NAMES[opts.states_dtype],
        )  # fmt: skip
        try:
            yield target, lambda source: EngineFeed(source, target, client)
        finally:
            client.close()


@contextlib.contextmanager
def serving(
    python: str, target: Path, engine_ids: list[int], log: Path, *,
    folder: Path | None = None, engine: str = "vllm", max_model_len: int = 1024,
    mooncake: dict[str, str] | None = None, **start: Any,
) -> Iterator[tuple[seam.OwnedServer, Path]]:  # fmt: skip
    """A states server started here (serve-check, the benchmarks), its connector writing
    into ``folder`` (else a fresh private one, removed afterwards) and, given ``mooncake``
    (a master's ``master`` and ``metadata``), putting into that store."""
    with contextlib.ExitStack() as stack:
        where = _folder(stack, folder, secrets.token_hex(6))
        server = stack.enter_context(seam.engine(engine).start(
            python, Path(target), engine_ids, log,
            connector=connector_config(where, **(mooncake or {})),
            max_model_len=max_model_len, **start,
        ))  # fmt: skip
        yield server, where


def client_for(
    server: seam.OwnedServer, folder: Path, *, transport: str = "shm", num_states: int,
    hidden_size: int, inflight: int = 32, shm_mb: int = 512, dtype: torch.dtype | None = None,
    run: str | None = None, mooncake: dict[str, str] | None = None, wire: str = "",
) -> StateClient:  # fmt: skip
    """A client of ``server`` through ``transport`` (serve-check, the benchmarks), the
    states in ``wire`` (``WIRE_NAMES``' values)."""
    run = run or f"{secrets.token_hex(6)}-{secrets.token_hex(3)}"
    carrier = seam.transport_class(transport)(folder, run=run, rank=0, size_mb=shm_mb,
                                              **(mooncake or {}))  # fmt: skip
    return StateClient(server.url, run=run, rank=0, num_states=num_states,
                       hidden_size=hidden_size, inflight=inflight, alive=server.ended,
                       dtype=dtype, transport=carrier, wire=wire)  # fmt: skip


def _owned(
    stack: contextlib.ExitStack, engine: seam.Engine, target: EngineTarget, opts: RunOptions,
    env: DistEnv, run: str, transport: str, store: dict[str, str],
) -> tuple[str, Path, Callable[[], str | None], dict[str, str]]:  # fmt: skip
    """The server rank 0 starts (its URL, folder and Mooncake addresses, broadcast; with
    the Mooncake transport and no --mooncake-master, a master of its own beside it), and
    how each rank learns that the server ended."""
    assert opts.vllm_python is not None  # RunOptions checks it
    _one_machine(env)
    found: Any = None
    alive: Callable[[], str | None] | None = None
    if env.is_main:
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            folder = _folder(stack, opts.engine_dir, run.split("-")[0])
            if transport == "mooncake" and not store["master"]:
                from trainer.engine.mooncake import master

                address, url, _ = stack.enter_context(master(opts.run_dir / MASTER_LOG))
                store = {**store, "master": address, "metadata": url}
            server = stack.enter_context(engine.start(
                str(opts.vllm_python), Path(opts.target), target.engine_ids,
                opts.run_dir / SERVER_LOG, connector=connector_config(folder, **store),
                max_model_len=_context(opts, target),
            ))  # fmt: skip
            found = (server.url, str(folder), server.pid, store)
            alive = server.ended
        except Exception as e:  # every rank says it, none waits in a collective
            found = str(e)
    found = control_broadcast(found, env)
    if not isinstance(found, tuple):
        raise EngineError(f"the vLLM server could not start (rank 0): {found}")
    if not env.is_main:
        alive = functools.partial(_exited, int(found[2]))
    assert alive is not None
    return found[0], Path(found[1]), alive, found[3]


def _folder(stack: contextlib.ExitStack, given: Path | None, run_id: str) -> Path:
    """The folder of a server the run starts: ``given`` (the user's), else the run's
    private one, removed when the run leaves."""
    if given is not None:
        return Path(given)
    folder = own_folder(states_folder(run_id))
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _one_machine(env: DistEnv) -> None:
    """A server the run starts serves rank 0's machine only (its address is 127.0.0.1, its
    folder that machine's memory): a job over several machines runs its own server."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if local != env.world_size:
        raise EngineError(
            f"--vllm-python starts a server on rank 0's machine, which the job's other "
            f"machines cannot reach ({env.world_size} ranks, {local} here): run a server "
            "(`dflash-train engine-command`) and give every rank --engine-url and --engine-dir"
        )


def _exited(pid: int) -> str | None:
    """For the ranks beside rank 0: whether the server rank 0 started has exited."""
    return None if Path(f"/proc/{pid}").exists() else (
        f"the vLLM server rank 0 started (pid {pid}) exited (rank 0's log says why)"
    )  # fmt: skip


def _context(opts: RunOptions, target: EngineTarget) -> int:
    """The started server's ``--max-model-len``: the loader's longest sample and the one
    token it generates, within the target's positions."""
    longest = opts.max_seq_len or 4096
    return min(longest + 1, int(target.config.max_position_embeddings))
