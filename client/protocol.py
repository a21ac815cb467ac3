"""The wire protocol between the loader daemon and its clients: the only code both import.

Transport: ZeroMQ ROUTER (daemon) / DEALER (one per client session). Every message is one
msgpack frame holding a map with ``v`` (protocol version) and ``t`` (type). Tensors never
travel over ZeroMQ: the daemon writes them into a shared-memory ring and announces the slot.

Client -> daemon
    open      job, rank, world_size, spec (partial BatchSpec dict), pos [epoch, step, micro],
              epochs (total epochs to serve, or None)
    release   s (session), slot, w (seconds the client waited for data so far)
    heartbeat s, w
    stats     (no fields)
    close     s
    ping      (no fields): "is a daemon answering here?"

Daemon -> client
    welcome   s, shm (path), slots, slot_bytes, layout (field -> [offset, capacity]),
              steps (per epoch of the start epoch), instance, fingerprint, spec (effective)
    batch     s, slot, pos, next, steps, bucket, rows, width, tokens, maxlen
    end       s: the requested epochs are done
    error     code, msg (s when tied to a session)
    stats     sessions, ... (see loader_server.server)
    pong      instance, pid
    bye       instance: the daemon is shutting down; reconnect later

Positions are ``[epoch, step, micro]`` of the next micro-batch. ``next`` in a batch message
is the position after it (the daemon knows where epochs end), so the client never needs the
plan to know where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
DEFAULT_ENDPOINT = "ipc:///run/dflash-loader/loader.sock"
# A control message is small; anything bigger is garbage or an attack. ZeroMQ drops the
# peer that exceeds this (ZMQ_MAXMSGSIZE) before the daemon ever sees the bytes.
MAX_MESSAGE_BYTES = 64 * 1024
_ALIGN = 64

# Error codes carried by `error` messages.
E_MALFORMED = "malformed"
E_VERSION = "version"
E_BAD_REQUEST = "bad_request"
E_MISMATCH = "mismatch"
E_UNKNOWN_SESSION = "unknown_session"
E_REPLACED = "replaced"
E_INTERNAL = "internal"


class LoaderError(Exception):
    """Base class of the loader's errors."""


class ProtocolError(LoaderError):
    """A malformed or unexpected message, or a version mismatch."""


class LoaderUnavailableError(LoaderError):
    """The daemon did not answer within the client's timeout."""


class LoaderRequestError(LoaderError):
    """The daemon refused a request (bad spec, job mismatch, ...); the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code


def encode(kind: str, **fields: Any) -> bytes:
    """One message frame."""
    fields["v"] = PROTOCOL_VERSION
    fields["t"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any]:
    """Parse one frame, bounding every size; raises ProtocolError on anything unexpected."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=1024,
            max_map_len=256,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types for garbage input
        raise ProtocolError(f"undecodable message ({type(e).__name__}: {e})") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("message is not a map with a string 't' (type) field")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same dflash-loader version on daemon and clients"
        )
    return msg


def position(value: Any, what: str = "pos") -> tuple[int, int, int]:
    """Validate an ``[epoch, step, micro]`` triple of non-negative ints."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    ):
        raise ProtocolError(
            f"{what} must be [epoch, step, micro] of non-negative ints, got {value!r}"
        )
    return int(value[0]), int(value[1]), int(value[2])


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
        import numpy as np

        sizes = {"tokens": tokens, "docs": docs, "docs+1": docs + 1}
        fields, offset = {}, 0
        for name, dtype, cap in _FIELDS:
            n = sizes[cap]
            fields[name] = (dtype, offset, n)
            offset += -(-n * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return cls(fields, offset)

    def to_wire(self) -> dict[str, list[Any]]:
        return {k: [d, o, n] for k, (d, o, n) in self.fields.items()}

    @classmethod
    def from_wire(cls, wire: Any, slot_bytes: Any) -> SlotLayout:
        if not isinstance(wire, dict) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ProtocolError("welcome carries no valid slot layout")
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
            fields[name] = (dtype, entry[1], entry[2])
        return cls(fields, slot_bytes)
