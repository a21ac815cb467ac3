"""The vLLM server that computes the target's hidden states: its flags (the same for a
server the trainer starts and one a user runs: ``server_flags``), and the one the trainer
starts and owns (``owned_server``).

The flags: the ``extract_hidden_states`` speculative method, which runs the target's
prefill and caches the chosen layers' outputs (``num_speculative_tokens`` 1, the layer ids
in ``draft_model_config.hf_config``: vLLM reads nothing else there), the connector that
writes them to files (``DFlashHiddenStatesConnector``, from ``PLUGIN_DIR`` on the server's
``PYTHONPATH``), and prefix caching off (a cached prefix is not computed, so its states
would be missing).

A server the trainer starts runs on rank 0's machine, with the CPU settings of
``trainer.eval.engine.vllm_command`` (fp32, eager; what this project can test), and writes
its files to the run's private folder under ``/dev/shm`` (memory, not disk), removed when
it stops;
it is SIGTERMed if the trainer dies (``trainer.eval.engine``), and a run resumed after a
kill finds that folder again and removes what the killed run left in it.
A GPU server with tensor parallelism is one the user runs with these flags
(docs/TRAINER.md).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.engine.folders import own_folder, shared_folder
from trainer.eval.engine import KV_CACHE_MEMORY_BYTES, MAX_MODEL_LEN, died, vllm_process

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"
CONNECTOR = "DFlashHiddenStatesConnector"
CONNECTOR_MODULE = "dflash_hidden_states"


def speculative_config(engine_ids: list[int]) -> dict[str, Any]:
    """``--speculative-config`` of a server extracting vLLM layer ids ``engine_ids``."""
    hf = {"eagle_aux_hidden_state_layer_ids": list(engine_ids)}
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": hf}}  # fmt: skip


def kv_transfer_config(states_dir: Path) -> dict[str, Any]:
    """``--kv-transfer-config``: the connector, writing its files into ``states_dir``."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_connector_extra_config": {"shared_storage_path": str(states_dir)}}  # fmt: skip


def server_flags(engine_ids: list[int], states_dir: Path) -> list[str]:
    """The flags a vLLM server needs beside its model's (the server's ``PYTHONPATH`` must
    hold ``PLUGIN_DIR``)."""
    return ["--speculative-config", json.dumps(speculative_config(engine_ids)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(states_dir)),
            "--no-enable-prefix-caching"]  # fmt: skip


def serve_command(
    target: Path, engine_ids: list[int], states_dir: Path, *, port: int = 8000,
    tensor_parallel_size: int = 1, max_model_len: int | None = None,
) -> str:  # fmt: skip
    """The shell command of a vLLM server a run can use (``--engine-url``): ``vllm serve``
    of ``target`` with ``server_flags`` and this project's connector on its
    ``PYTHONPATH`` (copy ``PLUGIN_DIR`` next to a server on another machine)."""
    import shlex

    cmd = ["vllm", "serve", str(target), "--port", str(port),
           "--tensor-parallel-size", str(tensor_parallel_size)]  # fmt: skip
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    cmd += server_flags(engine_ids, states_dir)
    return f"PYTHONPATH={shlex.quote(str(PLUGIN_DIR))} " + " ".join(map(shlex.quote, cmd))


def states_folder(run_id: str | None = None) -> Path:
    """Where a started server's files go, in ``/dev/shm`` where there is one:
    ``dflash-engine-RUN`` (a run's, by its random id: the run resumed after a kill finds it
    again, and removes what the killed one left there), or a fresh one. Not made here:
    ``own_folder`` makes it private, or refuses one someone else made."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    if run_id is None:
        return Path(tempfile.mkdtemp(prefix="dflash-engine-", dir=base))
    return base / f"dflash-engine-{run_id}"


class OwnedServer:
    """What the trainer knows of the server it started: its URL, folder and process."""

    def __init__(self, url: str, states_dir: Path, proc: subprocess.Popen[bytes],
                 log: Path) -> None:  # fmt: skip
        self.url, self.states_dir, self.proc, self.log = url, states_dir, proc, log

    def ended(self) -> str | None:
        """None while the server runs; else its exit and the end of its log."""
        if self.proc.poll() is None:
            return None
        return (
            f"the vLLM server this run started exited with {self.proc.returncode}: {died(self.log)}"
        )


@contextlib.contextmanager
def owned_server(
    vllm_python: str, target: Path, engine_ids: list[int], log: Path, *,
    states_dir: Path | None = None, run_id: str | None = None,
    max_model_len: int = MAX_MODEL_LEN, kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
) -> Iterator[OwnedServer]:  # fmt: skip
    """vLLM serving ``target``'s hidden states, started here and stopped (its process group)
    when the block ends, or when this process dies; its files go to ``states_dir`` (a
    folder others cannot write to), else to ``states_folder(run_id)``, made private (0700)
    and removed when the block ends."""
    made = states_dir is None
    if made:
        folder = own_folder(states_folder(run_id))
    else:
        folder = shared_folder(Path(states_dir))  # type: ignore[arg-type]
    try:
        with vllm_process(
            vllm_python, target, log, max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            extra=server_flags(engine_ids, folder), echo=_log, PYTHONPATH=str(PLUGIN_DIR),
        ) as (url, proc):  # fmt: skip
            yield OwnedServer(url, folder, proc, log)
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)


def _log(line: str) -> None:
    import logging

    logging.getLogger(__name__).info(line.strip())
