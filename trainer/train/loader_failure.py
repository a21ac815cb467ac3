"""A loader that fails a running job: the one line the run ends with, after the final
checkpoint of the last completed step.

The client already retried (it reconnects with a jittered backoff until its timeout), so
a ``LoaderError`` reaching the loop is final: the daemon stayed away, refused the session,
or spoke nonsense. The job then keeps what it trained: the last completed step is saved
(at the position before the step that failed, so ``--resume`` asks for that step again)
unless a checkpoint already holds it, and the message names the endpoint, what failed,
the checkpoint, and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loader_server.wire.protocol import (
    LoaderError,
    LoaderRequestError,
    LoaderUnavailableError,
    ProtocolError,
)
from trainer.train import checkpoint as ckpt
from trainer.train.guards import LoaderFailedError


def describe(e: LoaderError, endpoint: object | None) -> str:
    """What failed, naming the endpoint."""
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
    fix = "start the daemon again" if isinstance(e, LoaderUnavailableError) else "fix that"
    resume = f"{fix}, then rerun the same command with --resume"
    return LoaderFailedError(f"training stopped after step {step}: {what}; {note}: {resume}")
