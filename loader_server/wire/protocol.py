"""The wire protocol between the loader daemon and its clients: the only code both import.

Transport: ZeroMQ ROUTER (daemon) / DEALER (one per client session). Every message is one
msgpack frame holding a map with ``v`` (protocol version) and ``t`` (type). Tensors never
travel over ZeroMQ: the daemon writes them into a shared-memory ring.

Client -> daemon
    open      job, rank, world_size, spec (partial BatchSpec dict), pos [epoch, step, micro],
              epochs (total epochs to serve, or None); optional expect_spec (the full spec
              the position was saved under) and expect_fingerprint (its corpus); legs
              (optional, [[world_size, grad_accum, steps], ...]): the shapes the position's
              epoch was served under before this one (loader_server.planning.elastic)
    release   s (session): doorbell, "my consumed counter crossed your wake threshold"
    heartbeat s
    stats     (no fields)
    close     s
    ping      (no fields): "is a daemon answering here?"

Daemon -> client
    pending   s: the open was accepted; its plan (or ring) is still being made (every 1 s)
    welcome   s, shm (ring path), ctl (control page path), slots, slot_bytes, layout
              (field -> [dtype, offset, capacity]), steps (per epoch of the start epoch),
              instance, fingerprint, spec (effective), legs (the open's, as planned)
    end       s: the requested epochs are done
    hb        s: answer to a heartbeat (also sent unasked, to see whether a client is alive)
    closed    s: answer to a close; the session and its ring are gone
    error     code, msg (s when tied to a session)
    stats     sessions, ... (see loader_server.service.server)
    pong      instance, pid
    bye       instance, why (optional): the daemon is shutting down or reloading its corpus;
              reconnect later

Batches and their releases do not travel as messages: they are counters in shared memory
(see "ring header" below). A client that waits for a batch sleeps on its ring's bell (a
futex), which the daemon rings for a batch and after every message it sends the session;
a daemon that waits for free slots sleeps on its socket, where a ``release`` wakes it. A batch's
position and the position after it (``next``: the daemon knows where epochs end) are in its
slot's header, so the client never needs the plan to know where it is.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
from typing import Any, NamedTuple

import msgpack

PROTOCOL_VERSION = 2
DEFAULT_ENDPOINT = "ipc:///run/dflash-loader/loader.sock"
# A control message is small; anything bigger is garbage or an attack. ZeroMQ drops the
# peer that exceeds this (ZMQ_MAXMSGSIZE) before the daemon ever sees the bytes.
MAX_MESSAGE_BYTES = 64 * 1024
#: A ``stats`` reply lists every session (~250 bytes each, max_sessions 1024 by default).
MAX_STATS_BYTES = 16 << 20
#: Epochs, steps and micro indices (and epoch counts) travel as ints below 2^31.
MAX_INDEX = 2**31 - 1
#: Shape changes recorded within one epoch (each costs a plan when a daemon starts cold).
MAX_LEGS = 64

# Error codes carried by `error` messages.
E_MALFORMED = "malformed"
E_VERSION = "version"
E_BAD_REQUEST = "bad_request"
E_MISMATCH = "mismatch"
E_UNKNOWN_SESSION = "unknown_session"
E_REPLACED = "replaced"
E_BUSY = "busy"  # another live client reads this (job, rank)
E_INTERNAL = "internal"
E_CORPUS = "corpus"  # the corpus changed while served, or holds a value it cannot serve
E_NO_SPACE = "no_space"  # the ring would exceed a shared-memory cap, or the tmpfs is full


class LoaderError(Exception):
    """Base class of the loader's errors."""


class ProtocolError(LoaderError):
    """A malformed or unexpected message, or a version mismatch."""


class MalformedError(ProtocolError):
    """A frame that is not a message: too big, undecodable, or not a map with a type."""


class VersionError(ProtocolError):
    """A message of another protocol version (the two sides run different releases)."""


class LoaderUnavailableError(LoaderError):
    """The daemon did not answer within the client's timeout."""


class LoaderRequestError(LoaderError):
    """The daemon refused a request (bad spec, job mismatch, ...); the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code


def ipc_problem(endpoint: str) -> tuple[int, str] | None:
    """``(errno, one line)`` when this process cannot connect to an ``ipc://`` endpoint on a
    path, else None (it can, or the endpoint is not a path). ZeroMQ connects in the
    background and retries forever, so without this look a socket the user may not open
    (not in its group), or one nobody listens on, just looks like a daemon that is silent.
    A real connect is tried (and dropped at once): it is what the kernel will decide."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = endpoint[len("ipc://") :]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except PermissionError:
        return errno.EACCES, f"permission denied connecting to {path} as {_whoami()}: " + (
            f"the socket and its folder are for members of group {_group_of(path)} only; "
            f"add the user to it (sudo usermod -aG {_group_of(path)} USER, then log in again)"
        )
    except FileNotFoundError:
        return errno.ENOENT, f"{path} does not exist: no daemon is serving this endpoint"
    except ConnectionRefusedError:
        return errno.ECONNREFUSED, f"{path}: no daemon listens on this socket (a stale file)"
    except OSError as e:
        return e.errno or 0, f"cannot connect to {path}: {e.strerror}"
    finally:
        probe.close()
    return None


def _whoami() -> str:
    try:
        return f"user {pwd.getpwuid(os.geteuid()).pw_name}"
    except KeyError:
        return f"uid {os.geteuid()}"


def _group_of(path: str) -> str:
    """The group owning the socket, or its folder when the folder is what keeps us out."""
    for candidate in (path, os.path.dirname(path) or "."):
        try:
            gid = os.stat(candidate).st_gid
        except OSError:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return "dflash"


def encode(kind: str, **fields: Any) -> bytes:
    """One message frame."""
    fields["v"] = PROTOCOL_VERSION
    fields["t"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def decode(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse one frame, bounding every size; raises MalformedError on anything unexpected,
    VersionError on another protocol version. ``max_bytes`` is raised only for a ``stats``
    reply (one entry per session)."""
    if len(frame) > max_bytes:
        raise MalformedError(f"message of {len(frame)} bytes exceeds {max_bytes}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=max(1024, max_bytes // 64),
            max_map_len=256,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types for garbage input
        raise MalformedError(f"undecodable message ({type(e).__name__}: {e})") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise MalformedError("message is not a map with a string 't' (type) field")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionError(
            f"protocol version {version!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same dflash-loader version on daemon and clients"
        )
    return msg


def position(value: Any, what: str = "pos") -> tuple[int, int, int]:
    """Validate an ``[epoch, step, micro]`` triple of ints in [0, 2^31)."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INDEX for x in value
        )
    ):
        raise ProtocolError(
            f"{what} must be [epoch, step, micro] of non-negative ints below 2^31, got {value!r}"
        )
    return int(value[0]), int(value[1]), int(value[2])


class Leg(NamedTuple):
    """One shape an epoch was served under before the current one: ``steps`` optimizer steps
    of ``world_size`` ranks x ``grad_accum`` micro-batches, from the plan of what the legs
    before it had left (``loader_server.planning.elastic``)."""

    world_size: int
    grad_accum: int
    steps: int


def legs(value: Any, what: str = "legs") -> tuple[Leg, ...]:
    """Validate a list of ``[world_size, grad_accum, steps]`` (each >= 1, below 2^31; at most
    ``MAX_LEGS``)."""
    if value is None:
        return ()
    ok = isinstance(value, (list, tuple)) and len(value) <= MAX_LEGS
    out = []
    for leg in value if ok else ():
        if not (
            isinstance(leg, (list, tuple))
            and len(leg) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_INDEX
                    for x in leg)
        ):  # fmt: skip
            ok = False
            break
        out.append(Leg(*(int(x) for x in leg)))
    if not ok:
        raise ProtocolError(
            f"{what} must be a list of at most {MAX_LEGS} [world_size, grad_accum, steps] of "
            f"positive ints below 2^31, got {value!r}"
        )
    return tuple(out)
