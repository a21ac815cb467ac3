"""Shared-memory rings: plain files under /dev/shm, created and unlinked only by the daemon.

Why files and not ``multiprocessing.shared_memory``: before Python 3.13 its resource
tracker unlinks a segment when *any* attached process exits, so a crashing trainer would
delete the daemon's ring. A file in /dev/shm mapped with ``mmap`` has exactly one owner: the
daemon creates it (O_EXCL, mode 0600 or 0660 with a group), maps it read-write, and unlinks
it when the session ends or the daemon stops. Clients map it read-only and never unlink.
Next to each ring lies its control page (``.ctl``), the one file a client writes: its
``consumed`` counter and wake threshold (writable wherever the ring is readable). The ring
itself is writable by the daemon's user only, whatever ``--shm-mode`` grants (0660 gives
rings 0640 and control pages 0660), so no group member can rewrite another job's batches.

Space is reserved when a ring is created (``posix_fallocate``): a tmpfs that runs short
fails that one session's open with ENOSPC and the sizes, instead of killing the daemon with
SIGBUS at the first write to a page it cannot back. Rings are also capped per session and
per daemon (``shm_caps``). The daemon reads a control page only through guarded loads
(``loader_server.wire._ring``), so a truncated control page ends that session, not the daemon.

Names embed the daemon's pid and instance token (``dflash-<pid>-<token>-<session>``), and
the daemon holds a shared ``flock`` on each file it made for as long as it has it open, so
a starting daemon can sweep segments left by dead instances (``kill -9``) without touching
a live daemon's: a file nobody holds locked is a dead daemon's (the kernel drops the lock
with the process, in whatever pid namespace it ran). The pid in the name cannot say so on
its own: a container's daemon is pid 1 in every life, and a dead daemon's pid may belong
to another process by now.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import mmap
import os
import stat
import time
from pathlib import Path

import numpy as np

from loader_server.wire import _ring
from loader_server.wire import ring as R
from loader_server.wire.ring import SlotLayout

log = logging.getLogger(__name__)

#: Default per-session ring cap: at most this, and at most an eighth of the daemon's budget.
MAX_RING_BYTES = 1 << 30
#: Default daemon budget: this share of the shm folder's free space when the daemon starts.
BUDGET_SHARE = 0.75
#: Default per-session cap: the budget divided by this, so this many ranks (a node's GPUs)
#: at the cap always fit.
RINGS_AT_CAP = 8
#: A segment not yet this old whose pid is alive is not swept even when unlocked: its
#: daemon may be between creating the file and locking it.
SWEEP_GRACE_S = 10.0


class ShmSpaceError(ValueError):
    """No room for a ring: over a cap, or the shm filesystem is full (ENOSPC)."""


class ControlPageError(ValueError):
    """A session's control page cannot be read (its file was truncated)."""


def ring_modes(shm_mode: int) -> tuple[int, int]:
    """(ring mode, control page mode) for ``shm_mode``: only the owner writes rings; the
    control page is writable wherever the ring is readable (the client writes it)."""
    ring = (shm_mode & 0o444) | 0o600
    return ring, ring | (ring & 0o444) >> 1


def ring_bytes(layout: SlotLayout, num_slots: int) -> int:
    """Shared memory one session takes: ring header, slots and control page."""
    return R.header_bytes(num_slots) + layout.slot_bytes * num_slots + R.CONTROL_BYTES


def shm_caps(
    shm_dir: Path, max_ring_bytes: int | None, budget_bytes: int | None
) -> tuple[int, int]:
    """(per-session cap, daemon budget) in bytes; a None is derived from the free space of
    ``shm_dir`` now: the budget is 3/4 of it, a session at most 1 GiB and an eighth of the
    budget (so 8 ranks at the cap always fit)."""
    if budget_bytes is None:
        vfs = os.statvfs(shm_dir)
        budget_bytes = int(vfs.f_bavail * vfs.f_frsize * BUDGET_SHARE)
    if max_ring_bytes is None:
        max_ring_bytes = min(MAX_RING_BYTES, budget_bytes // RINGS_AT_CAP)
    return max_ring_bytes, budget_bytes


class ShmRing:
    """A header and ``num_slots`` slots in one file the daemon owns, plus the client's
    control page (``<path>.ctl``); see ``loader_server.wire.ring`` for the header's words."""

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
        self.header_bytes = R.header_bytes(num_slots)
        self.nbytes = ring_bytes(layout, num_slots)
        ring_mode, ctl_mode = ring_modes(mode)
        self._mm, self._fd = _create(
            path, self.header_bytes + layout.slot_bytes * num_slots, ring_mode, group
        )
        try:
            self._ctl, self._ctl_fd = _create(self.control_path, R.CONTROL_BYTES, ctl_mode, group)
        except BaseException:
            self._mm.close()
            path.unlink(missing_ok=True)
            os.close(self._fd)
            raise
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
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

    def publish(self, meta: R.SlotMeta) -> None:
        """Describe batch ``meta.n`` (already written into slot ``n % num_slots``), then
        publish it: the counter store orders every write before it."""
        meta.pack_into(self._mm, meta.n % self.num_slots)
        _ring.store(self._mm, R.PRODUCED, meta.n + 1)

    def ring_bell(self) -> None:
        """Wake the client if it sleeps on this ring (a batch or a message is there)."""
        if self._mm is not None:
            _ring.ring(self._mm, R.BELL)

    def _control(self, offset: int) -> int:
        try:
            return int(_ring.load(self._ctl, offset))
        except OSError as e:  # EFAULT: whoever may write it truncated the file
            raise ControlPageError(
                f"control page {self.control_path} was truncated ({e.strerror})"
            ) from None

    def consumed(self) -> int:
        return self._control(R.CONSUMED)

    def client_wake(self) -> int:
        """The ``produced`` count the client sleeps until (0: it is not sleeping)."""
        return self._control(R.WAKE_CLIENT)

    def client_wait_s(self) -> float:
        try:
            return self._control(R.WAIT_US) / 1e6
        except ValueError:  # closed meanwhile (stats run on another thread), or truncated
            return 0.0

    def wake_daemon_at(self, consumed: int) -> None:
        """Ask the client for a ``release`` doorbell when it has consumed this many (0: none)."""
        _ring.store(self._mm, R.WAKE_DAEMON, consumed)

    def close(self) -> None:
        """Unmap and unlink. Idempotent; clients holding a mapping keep it until they unmap."""
        if self._mm is None:
            return
        self._buf = np.zeros(0, np.uint8)
        self._fields = []
        for mm in (self._mm, self._ctl):
            try:
                mm.close()
            except BufferError:  # a view is still exported somewhere; the unlink still frees it
                log.debug("ring %s still has exported views at close", self.path)
        self._mm = None  # type: ignore[assignment]
        self.path.unlink(missing_ok=True)
        self.control_path.unlink(missing_ok=True)
        os.close(self._fd)  # the locks go with them (after the unlink: never swept live)
        os.close(self._ctl_fd)


def _create(path: Path, size: int, mode: int, group: str | None) -> tuple[mmap.mmap, int]:
    """A new file of ``size`` zero bytes with exactly ``mode`` (and ``group``), its space
    reserved, mapped, and its descriptor, which holds the file's liveness lock (close it
    after unlinking). Raises ShmSpaceError when the filesystem cannot hold it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # alive while this fd is open (a sweep probes for it)
        os.fchmod(fd, mode)  # the umask must not narrow what was configured
        if group is not None:
            os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)  # every page backed now, or an error now
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            vfs = os.statvfs(path.parent)
            raise ShmSpaceError(
                f"no room for {size:,} bytes of shared memory in {path.parent} "
                f"({vfs.f_bavail * vfs.f_frsize:,} bytes free): {e.strerror}"
            ) from None
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), fd
    except BaseException:
        path.unlink(missing_ok=True)
        os.close(fd)
        raise


def segment_name(instance: str, session: str) -> str:
    return R.ring_name(os.getpid(), instance, session)


def sweep_dead_segments(directory: Path) -> list[Path]:
    """Unlink rings (and control pages) no live daemon holds. Returns what was removed.
    Called once, when the daemon starts, before it makes a ring of its own.

    Only regular files named exactly as this daemon names rings (``segment_name``), owned
    by this user, that no process holds locked (module docstring), and whose pid is dead,
    is this process's own (a previous life of a container's pid 1) or that are at least
    ``SWEEP_GRACE_S`` old: nothing else in the folder is touched."""
    removed = []
    now = time.time()
    for p in directory.glob(f"{R.PREFIX}*"):
        m = R.RING_NAME.match(p.name)
        if m is None:
            continue
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or _held(p):
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or now - st.st_mtime >= SWEEP_GRACE_S or not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead daemons", len(removed))
    return removed


def _held(path: Path) -> bool:
    """Whether a live daemon holds ``path``'s lock (a file that cannot be opened is left
    alone, as held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
