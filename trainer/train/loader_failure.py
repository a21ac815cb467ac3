"""A loader that fails a running job: the one line the run ends with, after the final
checkpoint of the last completed step.

The client already retried (it reconnects with a jittered backoff until its timeout), so
a ``LoaderError`` reaching the loop is final: the daemon stayed away, refused the session,
or spoke nonsense. The job then keeps what it trained: the last completed step is saved
(at the position before the step that failed, so ``--resume`` asks for that step again)
unless a checkpoint already holds it, and the message names the endpoint, what failed,
the checkpoint, and what to do.

Under several ranks every rank must stop at the same point, or one rank waiting for its
loader leaves the others in the gradient all-reduce until the process group's timeout.
So each micro-batch's fetch is agreed on (``agree``: one 3-element max all-reduce of a host
tensor right after ``next()``, before any collective of the step; under NCCL on a gloo
group of its own, so it never waits for the GPU): a rank whose loader failed says so,
and every other rank raises ``PeerLoaderFailure`` at once; they then save the final
checkpoint together (a collective) and end with one line each.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

import torch

from loader_server.wire.protocol import (
    LoaderError,
    LoaderRequestError,
    LoaderUnavailableError,
    ProtocolError,
)
from trainer.train import checkpoint as ckpt
from trainer.train.distributed import DistEnv, control_all_reduce
from trainer.train.guards import LoaderFailedError, ServedSpecError


class Fetch(IntEnum):
    """How one rank's ``next()`` ended, ordered so the max over ranks is what all do."""

    GOT = 0
    EXHAUSTED = 1  # StopIteration: the loader serves no more epochs
    FAILED = 2  # a LoaderError


class PeerLoaderFailure(LoaderError):
    """Another rank's loader failed: this rank stops at the same point."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank}'s loader failed (that rank's error names its endpoint)")
        self.rank = rank


def agree(fetch: Fetch, env: DistEnv, error: LoaderError | None = None) -> Fetch:
    """What every rank does after this fetch: the worst outcome over ranks. A rank whose
    loader failed re-raises its error, the others ``PeerLoaderFailure`` naming it; ranks
    whose loaders ended at different points are a ``ServedSpecError``."""
    if not env.distributed:
        if error is not None:
            raise error
        return fetch
    failed = env.rank + 1 if fetch is Fetch.FAILED else 0
    t = torch.tensor([float(fetch), float(failed), -float(fetch)])  # on the host
    worst, failed_rank, neg_best = control_all_reduce(t, env, op="max").tolist()
    if worst == Fetch.FAILED:
        if error is not None:
            raise error
        raise PeerLoaderFailure(int(failed_rank) - 1)
    if worst != -neg_best:
        raise ServedSpecError(
            "the ranks' loaders ended at different steps (some served a batch, some had no "
            "more): they serve different plans; give every node's daemon the same corpus "
            "and [spec]"
        )
    return Fetch(int(worst))


def describe(e: LoaderError, endpoint: object | None) -> str:
    """What failed, naming the endpoint."""
    if isinstance(e, PeerLoaderFailure) or getattr(e, "fix", None):
        return str(e)  # it names what failed (an engine's error: its URL)
    if isinstance(e, LoaderUnavailableError):
        what = str(e)
    elif isinstance(e, LoaderRequestError):
        what = f"the loader refused: {e}"
    elif isinstance(e, ProtocolError):
        what = f"the loader's answer is not understood: {e}"
    else:
        what = f"loader error: {e}"
    if endpoint is not None and str(endpoint) not in what:
        what = f"{endpoint}: {what}"
    return what


def stop_error(
    e: LoaderError, *, step: int, endpoint: object | None, run_dir: Path,
    unsaved: bool | None, save_final: Callable[[], Path],
) -> LoaderFailedError:  # fmt: skip
    """The run's last error; first ``save_final()`` when the last completed step is
    ``unsaved`` (None: the run failed before its first step)."""
    what = describe(e, endpoint)
    if unsaved is None:
        return LoaderFailedError(f"training could not start: {what}")
    latest = ckpt.latest_checkpoint(run_dir)
    if unsaved:
        try:
            latest = save_final()
        except ckpt.CheckpointError as err:
            return LoaderFailedError(
                f"training stopped after step {step}: {what}; and the final "
                f"checkpoint failed: {err}"
            )
        note = f"saved checkpoint {latest.name} (the last completed step)"
    elif latest is not None:
        note = f"checkpoint {latest.name} holds the last completed step"
    else:
        note = "no step was completed"
    if isinstance(e, PeerLoaderFailure):
        fix = f"bring rank {e.rank}'s loader back (its error says what failed)"
    elif isinstance(e, LoaderUnavailableError):
        fix = "start the daemon again"
    elif said := getattr(e, "fix", None):  # a source that says how to go on (trainer.engine)
        fix = str(said)
    else:
        fix = "fix that"
    resume = f"{fix}, then rerun the same command with --resume"
    return LoaderFailedError(f"training stopped after step {step}: {what}; {note}: {resume}")
