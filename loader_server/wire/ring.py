"""The shared-memory ring both sides map: where a slot's tensors lie, the header's counter
words, the per-slot batch metadata, and how ring files are named.

The daemon writes it (``loader_server.service.rings``), a client reads it (``client.ring``);
the counters are read and written with sequentially consistent atomics by the C extension
``loader_server.wire._ring``. Pure Python: no numpy or torch.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from loader_server.wire.protocol import ProtocolError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

#: Largest slot a welcome may describe (a sanity bound against garbage, not a policy).
MAX_SLOT_BYTES = 1 << 40
#: Most slots a ring may have (the daemon's ring_slots is far below; a bound against garbage).
MAX_SLOTS = 64
#: Tensor offsets inside a slot are aligned to a cache line.
ALIGN = 64
ITEMSIZE = {"int32": 4, "uint8": 1, "int64": 8}

DEFAULT_SHM_DIR = "/dev/shm"
SHM_DIR_ENV = "DFLASH_LOADER_SHM_DIR"
PREFIX = "dflash-"
#: dflash-<daemon pid>-<instance: 8 hex>-<session: 12 hex>[.ctl]: nothing else is a ring.
RING_NAME = re.compile(rf"^{PREFIX}(\d{{1,10}})-([0-9a-f]{{8}})-([0-9a-f]{{12}})(\.ctl)?$")


def default_shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR


def ring_name(pid: int, instance: str, session: str) -> str:
    return f"{PREFIX}{pid}-{instance}-{session}"


# --- shared-memory slot layout -------------------------------------------------------------

# (field, numpy dtype, capacity in elements as a function of (tokens, rows, docs))
_FIELDS = (
    ("input_ids", "int32", "tokens"),
    ("loss_mask", "uint8", "tokens"),
    ("position_ids", "int32", "tokens"),
    ("lengths", "int32", "docs"),
    ("sample_ids", "int64", "docs"),
    ("cu_seqlens", "int32", "docs+1"),
)


@dataclass(frozen=True)
class SlotLayout:
    """Where each tensor lives inside one slot. Offsets are 64-byte aligned.

    ``tokens`` bounds rows*width (padded) or the packed row length; ``docs`` bounds the rows
    (padded) or documents per packed row.
    """

    fields: dict[str, tuple[str, int, int]]  # name -> (dtype, byte offset, capacity elems)
    slot_bytes: int

    @classmethod
    def build(cls, tokens: int, docs: int) -> SlotLayout:
        if tokens <= 0 or docs <= 0:
            raise ValueError(f"slot capacity must be positive, got tokens={tokens} docs={docs}")
        sizes = {"tokens": tokens, "docs": docs, "docs+1": docs + 1}
        fields, offset = {}, 0
        for name, dtype, cap in _FIELDS:
            n = sizes[cap]
            fields[name] = (dtype, offset, n)
            offset += -(-n * ITEMSIZE[dtype] // ALIGN) * ALIGN
        return cls(fields, offset)

    def to_wire(self) -> dict[str, list[Any]]:
        return {k: [d, o, n] for k, (d, o, n) in self.fields.items()}

    @classmethod
    def from_wire(cls, wire: Any, slot_bytes: Any) -> SlotLayout:
        """The layout a ``welcome`` describes, if every field lies inside its slot."""
        if (
            not isinstance(wire, dict)
            or not isinstance(slot_bytes, int)
            or not 0 < slot_bytes <= MAX_SLOT_BYTES
        ):
            raise ProtocolError(f"welcome carries no valid slot layout (slot_bytes {slot_bytes!r})")
        fields = {}
        for name, dtype, _ in _FIELDS:
            entry = wire.get(name)
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or entry[0] != dtype
                or not all(isinstance(x, int) and x >= 0 for x in entry[1:])
            ):
                raise ProtocolError(f"slot layout field {name!r} is invalid: {entry!r}")
            size = ITEMSIZE[dtype]
            if entry[1] % size or entry[1] + entry[2] * size > slot_bytes:
                raise ProtocolError(f"slot layout field {name!r} {entry!r} does not fit the slot")
            fields[name] = (dtype, entry[1], entry[2])
        return cls(fields, slot_bytes)


# --- shared-memory ring: header and control page -------------------------------------------
#
# A ring file is a header (written by the daemon; clients map it read-only) followed by the
# slots. Its control page (``<ring>.ctl``) is written by the client. Counters are uint64
# words read and written with sequentially consistent atomics (``loader_server.wire._ring``).
#
#   header   PRODUCED     batches published; batch n lives in slot n % slots
#            WAKE_DAEMON  the daemon sleeps until CONSUMED >= this (0: it does not)
#            BELL         uint32 futex word: the daemon advances it and wakes the client
#            META + k * META_STRIDE: slot k's batch, a SlotMeta (int64 words)
#   control  CONSUMED     batches the client is done with (it holds at most one more)
#            WAKE_CLIENT  the client sleeps until PRODUCED >= this (0: it does not)
#            WAIT_US      the client's total time spent waiting for data (for stats)
#
# Each side stores its counter, then loads the other's wake threshold; whoever moves a
# counter across it wakes the other side (the bell for a client, a ``release`` message for
# the daemon). So a busy pipeline exchanges no messages and makes no system calls, and a
# sleeping side is always woken.

PRODUCED, WAKE_DAEMON, BELL, META, META_STRIDE = 0, 64, 96, 128, 128
CONSUMED, WAKE_CLIENT, WAIT_US, CONTROL_BYTES = 0, 64, 128, 4096


class SlotMeta(NamedTuple):
    """A slot's batch description: one int64 word per field, in this order, at
    ``META + slot * META_STRIDE`` (native byte order, like the counters). The daemon writes
    it before publishing the batch; the client reads it once ``PRODUCED`` has passed it."""

    n: int  # the batch's index in its session (it lives in slot n % slots)
    epoch: int
    step: int
    micro: int
    next_epoch: int  # the position after this batch: the daemon knows where epochs end
    next_step: int
    next_micro: int
    steps: int  # steps in this batch's epoch
    bucket: int
    rows: int  # samples (padded) or documents in the packed row
    width: int  # padded row width, or the packed row's length
    tokens: int  # real (non-pad) tokens
    maxlen: int  # the longest sample (as cut to max_seq_len)

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.step, self.micro

    @property
    def next_position(self) -> tuple[int, int, int]:
        return self.next_epoch, self.next_step, self.next_micro

    def pack_into(self, header: WriteableBuffer, slot: int) -> None:
        """Write this description into ``slot``'s words of a ring's ``header``."""
        _META_WORDS.pack_into(header, meta_offset(slot), *self)

    @classmethod
    def unpack_from(cls, header: ReadableBuffer, slot: int) -> SlotMeta:
        """The description in ``slot``'s words of a ring's ``header``."""
        return cls._make(_META_WORDS.unpack_from(header, meta_offset(slot)))


META_FIELDS = SlotMeta._fields
# "=": native byte order with no padding, so word k of a slot is field k at 8 * k bytes.
_META_WORDS = struct.Struct(f"={len(META_FIELDS)}q")
_PAGE = 4096


def header_bytes(slots: int) -> int:
    """Size of a ring's header for ``slots`` slots (whole pages, so slots stay aligned)."""
    return -(-(META + slots * META_STRIDE) // _PAGE) * _PAGE


def meta_offset(slot: int) -> int:
    """Byte offset in a ring's header of ``slot``'s ``SlotMeta``."""
    return META + slot * META_STRIDE


def crossed(old: int, new: int, threshold: int) -> bool:
    """Did a counter moving from ``old`` to ``new`` reach a wake threshold (0: none set)?"""
    return threshold > 0 and old < threshold <= new
