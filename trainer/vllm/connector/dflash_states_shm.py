"""A document's states in a trainer rank's shared-memory arena: the region's layout, and
the writer's side. Imports torch only: the connector (in vLLM's interpreter), the tests'
stand-in server and the trainer's ``trainer.engine.shm`` use the same layout.

The trainer rank owns the arena (a file in the run's private folder, mapped and
pre-faulted once, its pages reused for every document) and gives each document a region
(``offset``, ``nbytes``) before asking for it. The writer (this module, in the server's
connector) maps the arena once, takes a POSIX record lock on the region before the server
replies, copies the token ids and the states into it, writes the header last, and lets go
of the lock (``lock_range``: an open-file-description lock, the descriptor's, not the
process's). The reader waits until it can take the region's lock shared, then reads the
header: ``DONE`` and its request's key, or the writer died (asked again). The lock's
system calls order the writes before the reader's reads.

Region: a header (``HEADER``: magic, state, dtype, the request's key, tokens, layers,
width, where the ids, the states and their scales start), the token ids (int64 ``[T]``),
the states (``[T, n, H]``), then, for fp8 states, their scales (float32 ``[T, n]``:
``dflash_states_wire``), each 64-byte aligned.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import threading
from typing import Any

import torch

try:  # beside it on vLLM's path (the connector's folder), or the trainer's package
    from dflash_states_wire import SCALES
except ImportError:
    from trainer.vllm.connector.dflash_states_wire import SCALES

MAGIC = b"DFLSHM02"
#: magic, state, dtype, key, T, n, H, ids_at, states_at, states' bytes, scales_at (0: none)
HEADER = struct.Struct("<8sIIQQIIQQQQ")
ALIGN = 64
DONE = 2
#: The header of a writer that could not write the document: why follows it (UTF-8).
FAILED = 3
#: The bytes of a failure's reason kept (and the region a failure needs: header and them).
REASON_BYTES = 1024
#: dtype codes in the header (an index into this tuple).
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
if hasattr(torch, "float8_e4m3fn"):
    DTYPES = (*DTYPES, torch.float8_e4m3fn)


#: ``struct flock`` (Linux, 64-bit): type, whence, start, length, pid (0 for OFD locks).
_FLOCK = struct.Struct("@hhqqi4x")


def lock_range(fd: int, exclusive: bool, start: int, length: int, wait: bool) -> bool:
    """Lock ``[start, start + length)`` of ``fd``'s file, shared or exclusive; False when
    ``wait`` is off and someone else holds a conflicting lock. Open-file-description locks
    (Linux): they belong to the descriptor, not the process, so a writer's lock taken on
    one thread and let go on another holds, and a reader in the same process (a test's
    stand-in server) sees it."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


def unlock_range(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def key_of(req_id: str) -> int:
    """The header's 64-bit key of a request id (the reader checks it is its request's)."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")


def region_bytes(tokens: int, layers: int, width: int, element_size: int,
                 scaled: bool = False) -> int:  # fmt: skip
    """The bytes a document takes: header, ids, states (and their scales: fp8)."""
    states = tokens * layers * width * element_size
    scales = _aligned(states) - states + 4 * tokens * layers if scaled else 0
    return _aligned(HEADER.size) + _aligned(8 * tokens) + states + scales


def parse_target(target: str) -> tuple[str, int, int, str] | None:
    """``shm:ARENA:OFFSET:NBYTES:KEY`` (how the connector carries a region, and the
    trainer's request id the header is keyed by, as a file name)."""
    if not target.startswith("shm:"):
        return None
    _, arena, offset, nbytes, key = target.split(":", 4)
    return arena, int(offset), int(nbytes), key


#: The prefix of a request whose region the connector could not take (the reason follows).
REFUSED = "refused:"


def target_of(arena: str, offset: int, nbytes: int, key: str) -> str:
    for part in (arena, key):
        if ":" in part or "/" in part:
            raise ValueError(f"{part!r}: not a name an arena region can carry")
    return f"shm:{arena}:{offset}:{nbytes}:{key}"


class Arenas:
    """The writer's side: arenas (files in ``folder``) mapped once, regions locked before
    the reply and written after it."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.realpath(folder)
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def _open(self, arena: str) -> tuple[int, mmap.mmap]:
        if "/" in arena or arena.startswith("."):
            raise ValueError(f"arena {arena!r} is not a name in {self.folder}")
        with self._lock:
            if arena not in self._maps:
                fd = os.open(os.path.join(self.folder, arena), os.O_RDWR | os.O_CLOEXEC)
                self._maps[arena] = (fd, mmap.mmap(fd, 0))
            return self._maps[arena]

    def _region(self, arena: str, offset: int, nbytes: int) -> tuple[int, mmap.mmap]:
        fd, mem = self._open(arena)
        if offset < 0 or nbytes < HEADER.size or offset + nbytes > len(mem):
            raise ValueError(f"region {offset}+{nbytes} is outside {arena} ({len(mem)} bytes)")
        return fd, mem

    def check(self, arena: str, offset: int, nbytes: int) -> None:
        """``ValueError`` or ``OSError`` (said to the trainer, not raised in the server)
        if the region is not one this connector can write: an arena in its folder, the
        region inside it."""
        self._region(arena, offset, nbytes)

    def lock(self, target: str) -> None:
        """Take the region's record lock (before the server replies)."""
        arena, offset, nbytes, _ = parse_target(target)  # type: ignore[misc]
        fd, _ = self._region(arena, offset, nbytes)
        lock_range(fd, True, offset, nbytes, wait=True)

    def unlock(self, target: str) -> None:
        arena, offset, nbytes, _ = parse_target(target)  # type: ignore[misc]
        fd, _ = self._region(arena, offset, nbytes)
        with contextlib.suppress(OSError):
            unlock_range(fd, offset, nbytes)

    def write(self, target: str, req_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """The request's token ids and states into its region, the header last, then the
        lock let go (also when the write failed: the header then says why)."""
        arena, offset, nbytes, _ = parse_target(target)  # type: ignore[misc]
        try:
            _, mem = self._region(arena, offset, nbytes)
            try:
                write_region(mem, offset, nbytes, req_id, tensors)
            except Exception as e:
                write_failure(mem, offset, nbytes, req_id, f"{type(e).__name__}: {e}")
                raise
        finally:
            self.unlock(target)


def write_region(mem: Any, offset: int, nbytes: int, req_id: str,
                 tensors: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """Lay a document's ``tensors`` (``hidden_states``, ``token_ids`` and, fp8, its
    scales) out in ``mem[offset : offset + nbytes]`` (header last)."""
    states, token_ids, scales = tensors["hidden_states"], tensors["token_ids"], tensors.get(SCALES)
    t, n, h = states.shape
    if states.dtype not in DTYPES:
        raise ValueError(f"states of dtype {states.dtype}: not one the arena carries")
    need = region_bytes(t, n, h, states.element_size(), scales is not None)
    if need > nbytes:
        raise ValueError(f"{need} bytes of states for a region of {nbytes}")
    ids_at = offset + _aligned(HEADER.size)
    states_at = ids_at + _aligned(8 * t)
    ids = torch.frombuffer(mem, dtype=torch.int64, count=t, offset=ids_at)
    ids.copy_(token_ids.reshape(-1).to(torch.int64))
    size = states.numel() * states.element_size()
    out = torch.frombuffer(mem, dtype=torch.uint8, count=size, offset=states_at)
    out.copy_(states.contiguous().reshape(-1).view(torch.uint8))
    scales_at = 0
    if scales is not None:
        scales_at = states_at + _aligned(size)
        into = torch.frombuffer(mem, dtype=torch.float32, count=t * n, offset=scales_at)
        into.copy_(scales.reshape(-1))
        scales_at -= offset
    HEADER.pack_into(mem, offset, MAGIC, DONE, DTYPES.index(states.dtype), key_of(req_id), t, n,
                     h, ids_at - offset, states_at - offset, size, scales_at)  # fmt: skip


def read_region(mem: Any, offset: int) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The region's key and its tensors (views of ``mem``), if its header says they were
    written (None: not written)."""
    magic, state, code, key, t, n, h, ids_at, states_at, size, scales_at = HEADER.unpack_from(
        mem, offset)  # fmt: skip
    if magic != MAGIC or state != DONE or code >= len(DTYPES):
        return None
    ids = torch.frombuffer(mem, dtype=torch.int64, count=t, offset=offset + ids_at)
    raw = torch.frombuffer(mem, dtype=torch.uint8, count=size, offset=offset + states_at)
    out = {"token_ids": ids, "hidden_states": raw.view(DTYPES[code]).view(t, n, h)}
    if scales_at:
        out[SCALES] = torch.frombuffer(mem, dtype=torch.float32, count=t * n,
                                       offset=offset + scales_at).view(t, n)  # fmt: skip
    return key, out


def write_failure(mem: Any, offset: int, nbytes: int, req_id: str, reason: str) -> int:
    """Say in the region that ``req_id``'s document could not be written, and why (the
    reader stops at once naming it, where a region left unwritten is asked for again);
    the bytes it took."""
    text = reason.encode()[: max(0, min(REASON_BYTES, nbytes - _aligned(HEADER.size)))]
    at = _aligned(HEADER.size)
    mem[offset + at : offset + at + len(text)] = text
    HEADER.pack_into(mem, offset, MAGIC, FAILED, 0, key_of(req_id), 0, 0, 0, at, 0, len(text), 0)
    return at + len(text)


def failure(mem: Any, offset: int, req_id: str) -> str | None:
    """Why the writer could not write ``req_id``'s document, if the region says so."""
    magic, state, _, key, _, _, _, at, _, size, _ = HEADER.unpack_from(mem, offset)
    if magic != MAGIC or state != FAILED or key != key_of(req_id):
        return None
    return bytes(mem[offset + at : offset + at + size]).decode(errors="replace")


def clear_header(mem: Any, offset: int) -> None:
    mem[offset : offset + HEADER.size] = bytes(HEADER.size)
