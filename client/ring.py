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

import contextlib
import mmap
import os
import re
import stat
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from client import _ring
from client import protocol as P

DEFAULT_SHM_DIR = "/dev/shm"
SHM_DIR_ENV = "DFLASH_LOADER_SHM_DIR"
_NAME = re.compile(r"^dflash-(\d{1,10})-([0-9a-f]{8})-([0-9a-f]{12})$")
_SIZES = {"int32": 4, "uint8": 1, "int64": 8}
_ALIGN = 64
MAX_SLOTS = 64


def default_shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR


def ring_files(shm_dir: str, msg: Mapping[str, Any]) -> tuple[str, str]:
    """The ring and control page a ``welcome`` names, if they are files this client may map
    (see the module docstring); raises ProtocolError otherwise."""
    sid, instance, shm, ctl = (msg.get(k) for k in ("s", "instance", "shm", "ctl"))
    if not all(isinstance(x, str) for x in (sid, instance, shm, ctl)):
        raise P.ProtocolError("welcome lacks the session, instance or ring names")
    folder, name = os.path.split(str(shm))
    m = _NAME.match(name)
    if m is None or m.group(2) != instance or m.group(3) != sid:
        raise P.ProtocolError(
            f"the daemon named ring {shm!r}, not dflash-<pid>-{instance}-{sid}; refusing to map it"
        )
    if os.path.realpath(folder) != os.path.realpath(shm_dir):
        raise P.ProtocolError(
            f"the daemon's ring {shm} is not in this client's shm dir {shm_dir}: give the "
            f"client the daemon's --shm-dir (shm_dir=, or ${SHM_DIR_ENV})"
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
        if not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise P.ProtocolError(f"welcome: slots {slots!r} not in [1, {MAX_SLOTS}]")
        layout = P.SlotLayout.from_wire(msg.get("layout"), msg.get("slot_bytes"))
        path, control = ring_files(shm_dir, msg)
        header = P.header_bytes(slots)
        self._mm, owner = _map(path, header + slots * layout.slot_bytes, mmap.PROT_READ)
        try:
            self._ctl, ctl_owner = _map(control, P.CONTROL_BYTES, mmap.PROT_READ | mmap.PROT_WRITE)
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
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        meta = self.buf[P.META : P.META + slots * P.META_STRIDE].view(np.int64)
        self._meta = meta.reshape(slots, P.META_STRIDE // 8)[:, : len(P.META_FIELDS)]
        self._starts = [header + k * layout.slot_bytes for k in range(slots)]
        self.layout = layout
        self.slots = slots
        self._pool = BufferPool(layout.slot_bytes, keep=slots + 2)

    # --- counters -------------------------------------------------------------------------

    def produced(self) -> int:
        return int(_ring.load(self._mm, P.PRODUCED))

    def bell(self) -> int:
        return int(_ring.bell(self._mm, P.BELL))

    def wait(self, bell: int, timeout_s: float) -> bool:
        """Sleep until the daemon rings the bell past ``bell`` (True) or the timeout."""
        return bool(_ring.wait(self._mm, P.BELL, bell, timeout_s))

    def daemon_wake(self) -> int:
        return int(_ring.load(self._mm, P.WAKE_DAEMON))

    def _store(self, offset: int, value: int) -> None:
        try:
            _ring.store(self._ctl, offset, value)
        except OSError as e:  # EFAULT: someone truncated the file under this mapping
            raise P.ProtocolError(
                f"this session's control page was truncated under the client ({e.strerror})"
            ) from None

    def set_consumed(self, n: int) -> None:
        self._store(P.CONSUMED, n)

    def wake_client_at(self, n: int) -> None:
        self._store(P.WAKE_CLIENT, n)

    def set_wait(self, seconds: float) -> None:
        self._store(P.WAIT_US, int(seconds * 1e6))

    # --- batches ----------------------------------------------------------------------------

    def meta(self, slot: int) -> list[int]:
        """Slot ``slot``'s batch description (``P.META_FIELDS``); read after ``produced``."""
        values = self._meta[slot].tolist()
        if min(values[1:]) < 0:
            raise P.ProtocolError(f"slot {slot} describes its batch with negative numbers")
        return values

    def take(
        self, slot: int, shapes: dict[str, tuple[int, ...]], pin: bool
    ) -> dict[str, torch.Tensor]:
        """Copy the fields of ``slot`` (``name -> shape``, C order) into one private buffer
        (pinned if ``pin``) and return them as tensors viewing it."""
        plan, total = [], 0
        for name, shape in shapes.items():
            dtype, offset, capacity = self.layout.fields[name]
            count = shape[0] * shape[1] if len(shape) == 2 else shape[0]
            if count > capacity:
                raise P.ProtocolError(f"field {name}: {count} elements > capacity {capacity}")
            size = _SIZES[dtype]
            plan.append((name, shape, dtype, self._starts[slot] + offset, total, count * size))
            total += -(-count * size // _ALIGN) * _ALIGN
        if pin:  # PyTorch's pinned-memory cache recycles blocks (and waits for their DMAs)
            buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
            out = buf.numpy()
        else:
            out = self._pool.get(max(total, _ALIGN))
            buf = torch.from_numpy(out)  # the batch's tensors keep ``out`` (and its buffer)
        typed = {"uint8": buf, "int32": buf.view(torch.int32), "int64": buf.view(torch.int64)}
        tensors = {}
        for name, shape, dtype, src, dst, nbytes in plan:
            out[dst : dst + nbytes] = self.buf[src : src + nbytes]
            strides = (shape[1], 1) if len(shape) == 2 else (1,)
            tensors[name] = typed[dtype].as_strided(shape, strides, dst // _SIZES[dtype])
        return tensors

    def close(self) -> None:
        self.buf = np.zeros(0, np.uint8)
        self._meta = np.zeros((0, 0), np.int64)
        for mm in (self._mm, self._ctl):
            with contextlib.suppress(BufferError):  # a view still alive: GC unmaps it later
                mm.close()


class BufferPool:
    """Private buffers for batches, recycled once no tensor uses them any more.

    A fresh buffer costs a page fault per page on first touch (on some VMs far more than
    the copy itself), so buffers are reused: each batch gets a view of a pooled buffer, the
    batch's tensors keep that view alive, and a weak reference's callback returns the
    buffer when the last of them is gone (a batch held forever keeps its buffer forever).
    Buffers are the size of a whole slot; at most ``keep`` idle ones are kept.
    """

    def __init__(self, nbytes: int, keep: int) -> None:
        self._nbytes = nbytes
        self._keep = keep
        self._idle: list[np.ndarray] = []
        self._lent: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}

    def get(self, nbytes: int) -> np.ndarray:
        if nbytes > self._nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self._nbytes}-byte buffer")
        base = self._idle.pop() if self._idle else np.empty(self._nbytes, np.uint8)
        view = base[: max(nbytes, 1)]
        ref = weakref.ref(view, self._returned)
        self._lent[id(ref)] = (ref, base)
        return view

    def _returned(self, ref: weakref.ref[np.ndarray]) -> None:
        lent = self._lent.pop(id(ref), None)
        if lent is not None and len(self._idle) < self._keep:
            self._idle.append(lent[1])


def _map(path: str, size: int, prot: int) -> tuple[mmap.mmap, int]:
    """Map ``path`` (a regular file, no symlink, not writable by group or others when it is
    the read-only ring) and return the mapping and the file's owner."""
    writable = bool(prot & mmap.PROT_WRITE)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
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
