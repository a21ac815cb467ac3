"""Process-group setup for ``torchrun`` (one process per GPU, or per CPU slot).

``torchrun`` exports ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the rendezvous address);
a plain ``python``/``dflash-train`` start has none of them and runs as a world of one
without a process group. The backend is NCCL when the process has a GPU, gloo otherwise.
Small decisions every rank takes together (how a batch fetch ended) go through
``control_all_reduce`` on host tensors: under NCCL a gloo group of their own, so taking
them never waits for the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(device: str | None, local_rank: int, cuda: bool) -> torch.device:
    """The rank's device: ``device`` as given, where ``cuda`` with no index (and no device
    at all, on a machine with CUDA) means the local rank's GPU, ``cuda:LOCAL_RANK``."""
    if device is None:
        return torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", local_rank)
    return dev


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> DistEnv:
    """Read the torchrun environment, pick the device and start the process group.
    ``timeout_s``: how long a collective waits for a rank before it fails (None: torch's
    default, 10 min for NCCL and 30 for gloo); an elastic job notices a frozen node only
    then."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local, torch.cuda.is_available())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if timeout is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        if backend == "nccl":
            global _CONTROL
            _CONTROL = dist.new_group(backend="gloo", timeout=timeout)
    return DistEnv(rank=rank, world_size=world, local_rank=local, device=dev)


def die_with_parent() -> None:
    """Under torchrun: this rank is SIGKILLed when its agent dies (Linux ``PR_SET_PDEATHSIG``).
    Without it a ``kill -9`` of the agent left its ranks training on as orphans, and the
    agent torchrun restarts (or the survivors' restart) then ran a second set of ranks on
    the same run folder; now an agent's death is its node's loss, which the elastic job
    already survives (docs/TRAINER.md, "What survives what")."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as e:  # a libc without prctl: run on, as before
        log.warning("cannot tie this rank to its torchrun agent: %s", e)
        return
    if os.getppid() != parent:  # the agent died while the tie was being made
        os.kill(os.getpid(), signal.SIGKILL)


def local_env(device: str = "cpu") -> DistEnv:
    """A world of one (tests, single-process runs) without reading the environment."""
    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device(device))


def all_reduce(t: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (a no-op in a world of one). ``op``: ``"sum"`` or ``"max"``."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


#: The host-side group of ``control_all_reduce`` (None: the default group is gloo already).
_CONTROL: dist.ProcessGroup | None = None


def control_all_reduce(t: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    """``all_reduce`` of a small host tensor, without a device synchronisation."""
    if env.distributed:
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(t, op=reduce_op, group=_CONTROL)
    return t


def control_broadcast(obj: Any, env: DistEnv) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable value), over the host-side group."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
