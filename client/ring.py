"""The client's side of a session's shared memory: map the ring, read batches out of it.

Paths and sizes come from the daemon's ``welcome`` message, so they are checked before
anything is mapped: the ring must be a regular file named ``dflash-<pid>-<instance>-<session>``
(instance and session as the welcome states them) directly inside the shared-memory folder
this client is configured with (``shm_dir``, default ``$DFLASH_LOADER_SHM_DIR`` or
``/dev/shm``), opened without following a symlink, writable by its owner only, owned by
the same user as its control page (and as the daemon's socket file, for a filesystem ipc
endpoint); the slot layout must fit the slots and the file must be as large as it says.

The ring is mapped read-only and never exposed: ``take`` copies one slot's batch (its real
rows x width, not the slot's capacity) into a private buffer, pinned when asked, and the
slot is released right after. The control page (``.ctl``) is the one file a client writes.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from loader_server.wire import _ring
from loader_server.wire import protocol as P
from loader_server.wire import ring as R


class RingGone(P.ProtocolError):
    """The ring named by a welcome no longer exists: its session already ended."""


def ring_files(shm_dir: str, msg: Mapping[str, Any]) -> tuple[str, str]:
    """The ring and control page a ``welcome`` names, if they are files this client may map
    (see the module docstring); raises ProtocolError otherwise."""
    sid, instance, shm, ctl = (msg.get(k) for k in ("s", "instance", "shm", "ctl"))
    if not all(isinstance(x, str) for x in (sid, instance, shm, ctl)):
        raise P.ProtocolError("welcome lacks the session, instance or ring names")
    folder, name = os.path.split(str(shm))
    m = R.RING_NAME.match(name)
    if m is None or m.group(4) or m.group(2) != instance or m.group(3) != sid:
        raise P.ProtocolError(
            f"the daemon named ring {shm!r}, not dflash-<pid>-{instance}-{sid}; refusing to map it"
        )
    if os.path.realpath(folder) != os.path.realpath(shm_dir):
        raise P.ProtocolError(
            f"the daemon's ring {shm} is not in this client's shm dir {shm_dir}: give the "
            f"client the daemon's --shm-dir (shm_dir=, or ${R.SHM_DIR_ENV})"
        )
    if ctl != f"{shm}.ctl":
        raise P.ProtocolError(f"the daemon named control page {ctl!r} for ring {shm!r}")
    path = os.path.join(shm_dir, name)
    return path, path + ".ctl"


class Ring:
    """A session's ring mapped read-only, and its control page mapped read-write."""

    def __init__(
        self, shm_dir: str, msg: Mapping[str, Any], socket_owner: int | None = None
    ) -> None:
        slots = msg.get("slots")
        if not isinstance(slots, int) or not 1 <= slots <= R.MAX_SLOTS:
            raise P.ProtocolError(f"welcome: slots {slots!r} not in [1, {R.MAX_SLOTS}]")
        layout = R.SlotLayout.from_wire(msg.get("layout"), msg.get("slot_bytes"))
        path, control = ring_files(shm_dir, msg)
        header = R.header_bytes(slots)
        self._mm, owner = _map(path, header + slots * layout.slot_bytes, mmap.PROT_READ)
        try:
            self._ctl, ctl_owner = _map(control, R.CONTROL_BYTES, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._mm.close()
            raise
        if ctl_owner != owner or (socket_owner is not None and socket_owner != owner):
            self._mm.close()
            self._ctl.close()
            raise P.ProtocolError(
                f"ring {path} (uid {owner}), its control page (uid {ctl_owner}) and the "
                f"daemon's socket (uid {socket_owner}) belong to different users"
            )
        self._starts = [header + k * layout.slot_bytes for k in range(slots)]
        self.layout = layout
        self.slots = slots
        self._pool = BufferPool(layout.slot_bytes, keep=slots + 2)

    # --- counters -------------------------------------------------------------------------

    def produced(self) -> int:
        return int(_ring.load(self._mm, R.PRODUCED))

    def bell(self) -> int:
        return int(_ring.bell(self._mm, R.BELL))

    def wait(self, bell: int, timeout_s: float) -> bool:
        """Sleep until the daemon rings the bell past ``bell`` (True) or the timeout."""
        return bool(_ring.wait(self._mm, R.BELL, bell, timeout_s))

    def daemon_wake(self) -> int:
        return int(_ring.load(self._mm, R.WAKE_DAEMON))

    def _store(self, offset: int, value: int) -> None:
        try:
            _ring.store(self._ctl, offset, value)
        except OSError as e:  # EFAULT: someone truncated the file under this mapping
            raise P.ProtocolError(
                f"this session's control page was truncated under the client ({e.strerror})"
            ) from None

    def set_consumed(self, n: int) -> None:
        self._store(R.CONSUMED, n)

    def wake_client_at(self, n: int) -> None:
        self._store(R.WAKE_CLIENT, n)

    def set_wait(self, seconds: float) -> None:
        self._store(R.WAIT_US, int(seconds * 1e6))

    # --- batches ----------------------------------------------------------------------------

    def meta(self, slot: int) -> R.SlotMeta:
        """Slot ``slot``'s batch description; read after ``produced``."""
        meta = R.SlotMeta.unpack_from(self._mm, slot)
        if min(meta[1:]) < 0:
            raise P.ProtocolError(f"slot {slot} describes its batch with negative numbers")
        return meta

    def take(
        self, slot: int, shapes: tuple[tuple[str, tuple[int, ...]], ...], pin: bool
    ) -> dict[str, torch.Tensor]:
        """Copy the fields of ``slot`` (``(name, shape)`` pairs, C order) into one private
        buffer (pinned if ``pin``) and return them as tensors viewing it. One native call
        copies them all, with the GIL released."""
        fields, start = self.layout.fields, self._starts[slot]
        ranges: list[int] = []
        views = []
        total = 0
        for name, shape in shapes:
            dtype, offset, capacity = fields[name]
            count = shape[0] * shape[1] if len(shape) == 2 else shape[0]
            if count > capacity:
                raise P.ProtocolError(f"field {name}: {count} elements > capacity {capacity}")
            size = R.ITEMSIZE[dtype]
            ranges += (total, start + offset, count * size)
            views.append((name, shape, dtype, total // size))
            total += -(-count * size // R.ALIGN) * R.ALIGN
        total = max(total, R.ALIGN)
        if pin:  # PyTorch's pinned-memory cache recycles blocks (and waits for their DMAs)
            u8 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            out = u8.numpy()
            typed = {"uint8": u8, "int32": u8.view(torch.int32), "int64": u8.view(torch.int64)}
        else:
            buf = self._pool.get(total)
            out, typed = buf.bytes, buf.typed
        _ring.gather(out, self._mm, np.array(ranges, np.int64))
        return {
            name: typed[dtype].as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), at)
            for name, shape, dtype, at in views
        }

    def close(self) -> None:
        for mm in (self._mm, self._ctl):
            with contextlib.suppress(BufferError):  # a view still alive: GC unmaps it later
                mm.close()


class BufferPool:
    """Private buffers for batches, recycled once no tensor uses them any more.

    A fresh buffer costs a page fault per page on first touch (on some VMs far more than
    the copy itself), so buffers are reused: a batch's tensors are views of a pooled
    buffer, and the buffer is free again when its storage has no users but the pool's own
    views (a batch held forever keeps its buffer forever; the pool then makes new ones).
    Each ``get`` looks at a few lent buffers, oldest first. Buffers are a whole slot's size;
    at most ``keep`` idle ones are kept.
    """

    def __init__(self, nbytes: int, keep: int) -> None:
        self._nbytes = nbytes
        self._keep = keep
        self._idle: list[_Buffer] = []
        self._lent: collections.deque[_Buffer] = collections.deque()

    def get(self, nbytes: int) -> _Buffer:
        if nbytes > self._nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self._nbytes}-byte buffer")
        for _ in range(min(4, len(self._lent))):
            buf = self._lent.popleft()
            if not buf.in_use():
                if len(self._idle) < self._keep:
                    self._idle.append(buf)
            else:
                self._lent.append(buf)
        buf = self._idle.pop() if self._idle else _Buffer(self._nbytes)
        self._lent.append(buf)
        return buf


class _Buffer:
    """One pooled buffer: a uint8 tensor, its typed views and its storage's use count."""

    def __init__(self, nbytes: int) -> None:
        u8 = torch.empty(nbytes, dtype=torch.uint8)
        self.bytes = u8.numpy()
        self.typed = {"uint8": u8, "int32": u8.view(torch.int32), "int64": u8.view(torch.int64)}
        self._storage = u8.untyped_storage()._cdata
        self._idle_users = _use_count(self._storage)

    def in_use(self) -> bool:
        return _use_count(self._storage) != self._idle_users


def _use_count(storage: int) -> int:
    return int(torch._C._storage_Use_Count(storage))


def _map(path: str, size: int, prot: int) -> tuple[mmap.mmap, int]:
    """Map ``path`` (a regular file, no symlink, not writable by group or others when it is
    the read-only ring) and return the mapping and the file's owner."""
    writable = bool(prot & mmap.PROT_WRITE)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise RingGone(f"{path} no longer exists") from None
    except OSError as e:
        raise P.ProtocolError(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise P.ProtocolError(f"{path} is not a regular file")
        if not writable and st.st_mode & 0o022:
            raise P.ProtocolError(f"{path} is writable by others than its owner; not a ring")
        if st.st_size < size:
            raise P.ProtocolError(f"{path} is {st.st_size} bytes, expected {size}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot), st.st_uid
    finally:
        os.close(fd)
