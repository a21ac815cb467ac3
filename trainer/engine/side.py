"""A run's engine side: the ``EngineTarget``, the server (started by rank 0, or the user's
at ``--engine-url``) and the client each rank fetches its features with.

With ``--vllm-python`` rank 0 starts the server on its machine and tells the other ranks
its URL and folder (one broadcast; a server that does not start is every rank's error, not
a wait for a collective's timeout). A job over several machines runs its own server and
passes ``--engine-url``, with ``--engine-dir`` where the files appear on each machine.

Which requests are the run's: rank 0 keeps a random id in the run folder (``ENGINE_ID``;
made at the first start, read again by every resume) and draws a new one for each start
of the job; every rank takes both from it (``run_identity``). Request ids, and so the
server's file names, carry them (``trainer.engine.client``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.engine.client import StateClient
from trainer.engine.errors import EngineError
from trainer.engine.feed import EngineFeed
from trainer.engine.server import owned_server
from trainer.engine.target import EngineTarget
from trainer.model.target import run_dtype
from trainer.option_values import parse_int_list
from trainer.sections import RunOptions
from trainer.train.batches import BatchSource
from trainer.train.distributed import DistEnv, control_broadcast

#: The log of a server a run starts, in its run folder.
SERVER_LOG = "vllm-engine.log"


#: The file in the run folder that holds the run's engine id.
ENGINE_ID = "engine-id"


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


@contextlib.contextmanager
def engine_side(
    opts: RunOptions, env: DistEnv
) -> Iterator[tuple[EngineTarget, Callable[[BatchSource], EngineFeed]]]:
    """The run's ``EngineTarget`` and what wraps its loader client into an ``EngineFeed``;
    the server (when started here) stopped and its files removed on leaving."""
    target = EngineTarget(
        Path(opts.target), parse_int_list(opts.layers), env.device, run_dtype(env.device)
    )
    with contextlib.ExitStack() as stack:
        url, folder = opts.engine_url, opts.engine_dir
        alive: Callable[[], str | None] | None = None
        dtype = None  # a user's server: its first document says
        run = run_identity(opts.run_dir, env)
        if url is None:
            assert opts.vllm_python is not None  # RunOptions checks it
            _one_machine(env)
            found: Any = None
            if env.is_main:
                opts.run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    server = stack.enter_context(owned_server(
                        str(opts.vllm_python), Path(opts.target), target.engine_ids,
                        opts.run_dir / SERVER_LOG, states_dir=opts.engine_dir,
                        run_id=run.split("-")[0], max_model_len=_context(opts, target),
                    ))  # fmt: skip
                    found = (server.url, str(server.states_dir), server.proc.pid)
                    alive = server.ended
                except Exception as e:  # every rank says it, none waits in a collective
                    found = str(e)
            found = control_broadcast(found, env)
            if not isinstance(found, tuple):
                raise EngineError(f"the vLLM server could not start (rank 0): {found}")
            url, folder, dtype = found[0], Path(found[1]), torch.float32  # vllm_command's
            if not env.is_main:
                alive = functools.partial(_exited, int(found[2]))
        client = StateClient(
            url, run=run, rank=env.rank, num_states=len(target.engine_ids),
            hidden_size=target.hidden_size, inflight=opts.engine_inflight,
            timeout_s=opts.engine_timeout_s, states_dir=folder, alive=alive, dtype=dtype,
            target=Path(opts.target),
        )  # fmt: skip
        try:
            yield target, lambda source: EngineFeed(source, target, client)
        finally:
            client.close()


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
