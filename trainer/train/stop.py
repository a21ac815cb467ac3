"""Stopping a training run on SIGTERM, at a step boundary every rank agrees on.

``systemctl stop`` (through ``dflash-torchrun``, which forwards the signal to each rank)
and schedulers that preempt jobs send SIGTERM. A rank must not simply die: its loader
session would stay open on the daemon until it times out (blocking a restart with another
spec), and whatever it trained since the last checkpoint would be lost. The handler only
sets a flag; the training loop asks ``agreed()`` before each optimizer step, which
all-reduces the flag (max), so every rank stops after the same step even though the
signals reach them at slightly different times (a rank stopping one step early would leave
the others waiting in a collective). The loop then writes a checkpoint, the run returns,
the loader client is closed (the daemon drops the session and its ring at once) and the
process exits 0.

A second SIGTERM changes nothing (the first already stops the run at the next boundary);
SIGKILL after the unit's ``TimeoutStopSec`` is what ends a rank that cannot get there.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when needed: install() runs before it loads
    from trainer.train.distributed import DistEnv

log = logging.getLogger(__name__)

_requested = threading.Event()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if not _requested.is_set():
        _requested.set()
        # logging is not async-signal-safe in general, but this handler runs in the main
        # thread between bytecodes (Python defers it), where logging is fine.
        log.info("SIGTERM: stopping after the current step (checkpoint, close the session)")


def install() -> None:
    """Handle SIGTERM from now on (main thread only: Python's rule for signal handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def request() -> None:
    """Ask for a stop as SIGTERM would (for callers that learn of it another way)."""
    _requested.set()


def requested() -> bool:
    """Whether this process was asked to stop."""
    return _requested.is_set()


def agreed(env: DistEnv) -> bool:
    """Collective: True on every rank when any rank was asked to stop. One 1-element
    all-reduce per optimizer step (tens of microseconds), far below a step's time."""
    if not env.distributed:
        return _requested.is_set()
    import torch

    from trainer.train.distributed import control_all_reduce

    flag = torch.tensor([1.0 if _requested.is_set() else 0.0])  # host: no device sync
    return bool(control_all_reduce(flag, env, op="max").item() > 0)
