"""``dflash-torchrun``: torchrun, except that SIGTERM stops the job cleanly and exits 0.

Plain torchrun (``torch.distributed.run``) turns SIGTERM into a ``SignalException`` in its
agent: it signals the workers, gives them ``--shutdown-timeout`` (30 s) before SIGKILL, and
then exits 1 with a traceback, whatever the workers did. Under systemd that makes every
``systemctl stop`` end ``failed (Result: exit-code)``; and since a crashed rank also makes
torchrun exit 1, no ``SuccessExitStatus=`` can tell a stop from a crash.

This launcher takes SIGTERM out of torchrun's hands and forwards it to the worker process
groups (torchrun starts each worker in its own session). The agent keeps monitoring and
sees the workers exit as they choose: each ``dflash-train train`` rank finishes its step,
checkpoints, closes its loader session and exits 0 (``trainer.train.stop``), so the agent
reports success and this process exits 0; a rank that fails instead still makes it exit 1.
The 30-s agent timeout no longer applies to a stop: the unit's ``TimeoutStopSec`` bounds
it. Everything else (arguments, SIGINT/SIGHUP/SIGQUIT, restarts) is torchrun's own.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

log = logging.getLogger("dflash-torchrun")

_signalled: set[int] = set()
_stopping = threading.Event()
# How often, once stopping, to look for workers started after the signal (an elastic
# restart, or a start still in progress when it came) and signal them too.
_FOLLOW_UP_S = 0.5


def children(pid: int | None = None) -> list[int]:
    """Direct children of process ``pid`` (this one by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(x) for x in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _signal_workers() -> int:
    """SIGTERM each child's process group once; returns how many were signalled now."""
    n = 0
    for child in children():
        if child in _signalled:
            continue
        _signalled.add(child)
        try:
            if os.getpgid(child) == child:  # a session leader: reach its own children too
                os.killpg(child, signal.SIGTERM)
            else:
                os.kill(child, signal.SIGTERM)
            n += 1
        except ProcessLookupError:
            continue
    return n


def _follow_up() -> None:
    while True:
        time.sleep(_FOLLOW_UP_S)
        _signal_workers()


def make_handler(
    original: Callable[[int, FrameType | None], None] | None,
) -> Callable[[int, FrameType | None], None]:
    """The signal handler torchrun's agent installs in place of its own: SIGTERM is
    forwarded; other signals go to ``original`` (torchrun's, which aborts the agent)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGTERM:
            if original is not None:
                original(signum, frame)
            return
        first = not _stopping.is_set()
        _stopping.set()
        if not first:
            return  # the workers were told; a second SIGTERM changes nothing
        if _signal_workers() == 0:
            # Before any worker started (rendezvous) there is nothing to stop cleanly.
            log.warning("SIGTERM before the workers started: exiting")
            raise SystemExit(0)
        log.warning("SIGTERM: asked the workers to stop after their current step")
        threading.Thread(target=_follow_up, name="stop-follow-up", daemon=True).start()

    return handler


def main(argv: list[str] | None = None) -> None:
    """Run ``torch.distributed.run`` with this module's SIGTERM handling."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.run import main as torchrun_main

    original = getattr(api, "_terminate_process_handler", None)
    handler = make_handler(original)
    if original is None:  # a torch without the hook: keep torchrun's own behaviour
        log.warning("torch has no _terminate_process_handler; SIGTERM handled by torchrun")
    else:
        # The agent registers this module global for SIGTERM, SIGINT, SIGHUP and SIGQUIT
        # when it starts the workers; replacing it routes SIGTERM here.
        # (mypy refuses assigning to a def, though a module global is what the agent reads.)
        api._terminate_process_handler = handler  # type: ignore[assignment]
        signal.signal(signal.SIGTERM, handler)  # the same during rendezvous, before that
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torchrun_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
