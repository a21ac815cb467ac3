"""Processes a test started: their children, all their descendants, and killing a tree
(torchrun starts each rank in a session of its own, so a process group is not enough).
A warm start's stand-in (tests/warm) is looked through: its children are those of the
process forked for it, and that process is the one listed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from warm import real_pid


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    pid = real_pid(pid)
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(real_pid(int(entry)))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 ``proc`` and everything it started, and reap it."""
    for pid in [*descendants(proc.pid), real_pid(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
