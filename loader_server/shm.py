"""Shared-memory rings: plain files under /dev/shm, created and unlinked only by the daemon.

Why files and not ``multiprocessing.shared_memory``: before Python 3.13 its resource
tracker unlinks a segment when *any* attached process exits, so a crashing trainer would
delete the daemon's ring. A file in /dev/shm mapped with ``mmap`` has exactly one owner: the
daemon creates it (O_EXCL, mode 0600 or 0660 with a group), maps it read-write, and unlinks
it when the session ends or the daemon stops. Clients map it read-only and never unlink.

Names embed the daemon's pid and instance token (``dflash-<pid>-<token>-<session>``), so a
starting daemon can sweep segments left by dead instances (``kill -9``) without touching a
live daemon's.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import mmap
import os
import re
from pathlib import Path

import numpy as np

from client.protocol import SlotLayout

log = logging.getLogger(__name__)

PREFIX = "dflash-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-.+$")


class ShmRing:
    """``num_slots`` slots of ``layout.slot_bytes`` each, in one file the daemon owns."""

    def __init__(
        self,
        path: Path,
        layout: SlotLayout,
        num_slots: int,
        *,
        mode: int = 0o600,
        group: str | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.path = path
        self.layout = layout
        self.num_slots = num_slots
        size = layout.slot_bytes * num_slots
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # the umask must not narrow what was configured
            if group is not None:
                os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    def field(self, slot: int, name: str, count: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """A writable view of ``count`` elements of ``name`` in ``slot`` (optionally reshaped)."""
        dtype, offset, capacity = self.layout.fields[name]
        if not 0 <= slot < self.num_slots or count > capacity:
            raise ValueError(f"slot {slot} field {name}: {count} elements > capacity {capacity}")
        start = slot * self.layout.slot_bytes + offset
        nbytes = count * np.dtype(dtype).itemsize
        view = self._buf[start : start + nbytes].view(dtype)
        return view.reshape(shape) if shape else view

    def close(self) -> None:
        """Unmap and unlink. Idempotent; clients holding a mapping keep it until they unmap."""
        if self._mm is None:
            return
        self._buf = np.zeros(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view is still exported somewhere; the unlink still frees it
            log.debug("ring %s still has exported views at close", self.path)
        self._mm = None  # type: ignore[assignment]
        self.path.unlink(missing_ok=True)


def segment_name(instance: str, session: str) -> str:
    return f"{PREFIX}{os.getpid()}-{instance}-{session}"


def sweep_dead_segments(directory: Path) -> list[Path]:
    """Unlink rings whose owning daemon process no longer exists. Returns what was removed."""
    removed = []
    for p in directory.glob(f"{PREFIX}*"):
        m = _NAME.match(p.name)
        if m is None or p.stat().st_uid != os.getuid():
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead daemons", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
