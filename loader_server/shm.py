"""Shared-memory rings: plain files under /dev/shm, created and unlinked only by the daemon.

Why files and not ``multiprocessing.shared_memory``: before Python 3.13 its resource
tracker unlinks a segment when *any* attached process exits, so a crashing trainer would
delete the daemon's ring. A file in /dev/shm mapped with ``mmap`` has exactly one owner: the
daemon creates it (O_EXCL, mode 0600 or 0660 with a group), maps it read-write, and unlinks
it when the session ends or the daemon stops. Clients map it read-only and never unlink.
Next to each ring lies its control page (``.ctl``), the one file a client writes: its
``consumed`` counter and wake threshold (writable wherever the ring is readable).

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
import stat
from pathlib import Path

import numpy as np

from client import _ring
from client import protocol as P
from client.protocol import SlotLayout

log = logging.getLogger(__name__)

PREFIX = "dflash-"
# dflash-<daemon pid>-<instance: 8 hex>-<session: 12 hex>[.ctl]: nothing else is swept.
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]{{8}})-([0-9a-f]{{12}})(\.ctl)?$")


class ShmRing:
    """A header and ``num_slots`` slots in one file the daemon owns, plus the client's
    control page (``<path>.ctl``); see ``client.protocol`` for the header's words."""

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
        self.control_path = path.with_name(path.name + ".ctl")
        self.layout = layout
        self.num_slots = num_slots
        self.header_bytes = P.header_bytes(num_slots)
        self._mm = _create(path, self.header_bytes + layout.slot_bytes * num_slots, mode, group)
        try:
            # The client writes its counters here: grant write wherever read is granted.
            self._ctl = _create(
                self.control_path, P.CONTROL_BYTES, mode | (mode & 0o444) >> 1, group
            )
        except BaseException:
            self._mm.close()
            path.unlink(missing_ok=True)
            raise
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._meta = self._buf[P.META : P.META + num_slots * P.META_STRIDE].view(np.int64)
        self._meta = self._meta.reshape(num_slots, P.META_STRIDE // 8)
        # Typed full-capacity views of every field of every slot, made once.
        self._fields = [
            {
                name: self._buf[start : start + capacity * np.dtype(dtype).itemsize].view(dtype)
                for name, (dtype, offset, capacity) in layout.fields.items()
                for start in [self.header_bytes + k * layout.slot_bytes + offset]
            }
            for k in range(num_slots)
        ]

    def slot(self, slot: int) -> dict[str, np.ndarray]:
        """Writable full-capacity views of every field of ``slot``."""
        return self._fields[slot]

    def publish(self, n: int, meta: tuple[int, ...]) -> None:
        """Describe batch ``n`` (already written into slot ``n % num_slots``), then publish
        it: the counter store orders every write before it."""
        row = self._meta[n % self.num_slots]
        row[0] = n
        row[1 : len(meta) + 1] = meta
        _ring.store(self._mm, P.PRODUCED, n + 1)

    def ring_bell(self) -> None:
        """Wake the client if it sleeps on this ring (a batch or a message is there)."""
        if self._mm is not None:
            _ring.ring(self._mm, P.BELL)

    def consumed(self) -> int:
        return int(_ring.load(self._ctl, P.CONSUMED))

    def client_wake(self) -> int:
        """The ``produced`` count the client sleeps until (0: it is not sleeping)."""
        return int(_ring.load(self._ctl, P.WAKE_CLIENT))

    def client_wait_s(self) -> float:
        try:
            return _ring.load(self._ctl, P.WAIT_US) / 1e6
        except ValueError:  # closed meanwhile (stats run on another thread)
            return 0.0

    def wake_daemon_at(self, consumed: int) -> None:
        """Ask the client for a ``release`` doorbell when it has consumed this many (0: none)."""
        _ring.store(self._mm, P.WAKE_DAEMON, consumed)

    def close(self) -> None:
        """Unmap and unlink. Idempotent; clients holding a mapping keep it until they unmap."""
        if self._mm is None:
            return
        self._buf = np.zeros(0, np.uint8)
        self._meta = np.zeros((0, 0), np.int64)
        self._fields = []
        for mm in (self._mm, self._ctl):
            try:
                mm.close()
            except BufferError:  # a view is still exported somewhere; the unlink still frees it
                log.debug("ring %s still has exported views at close", self.path)
        self._mm = None  # type: ignore[assignment]
        self.path.unlink(missing_ok=True)
        self.control_path.unlink(missing_ok=True)


def _create(path: Path, size: int, mode: int, group: str | None) -> mmap.mmap:
    """A new file of ``size`` zero bytes with exactly ``mode`` (and ``group``), mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow what was configured
        if group is not None:
            os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def segment_name(instance: str, session: str) -> str:
    return f"{PREFIX}{os.getpid()}-{instance}-{session}"


def sweep_dead_segments(directory: Path) -> list[Path]:
    """Unlink rings whose owning daemon process no longer exists. Returns what was removed.

    Only regular files named exactly as this daemon names rings (``segment_name``), owned
    by this user, whose daemon pid is dead: nothing else in the folder is touched."""
    removed = []
    for p in directory.glob(f"{PREFIX}*"):
        m = _NAME.match(p.name)
        if m is None:
            continue
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
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
