"""The daemon's endpoint and shared-memory folder: checked before READY, never clobbered.

Rule: the daemon removes or replaces no path it did not create. ZeroMQ's own ``bind`` on an
``ipc://`` path unlinks whatever is there (a regular file, another daemon's socket), so the
daemon binds the Unix socket itself (``bind(2)`` fails on an existing path instead of
removing it) and hands the listening descriptor to ZeroMQ (``ZMQ_USE_FD``). An existing
path is removed only when it is a socket that nobody listens on: no dflash-loader answers a
ping there and a plain ``connect`` is refused. ``ipc://@name`` is Linux's abstract
namespace: no file at all (and no file permissions: any local user may connect).

The shared-memory folder must exist and take a real ring before READY: a probe file is
created, its space reserved with ``posix_fallocate``, mapped, written and unlinked, so a
read-only, full or missing folder fails the start with one line instead of every session.
"""

from __future__ import annotations

import errno
import grp
import ipaddress
import logging
import mmap
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

from loader_server.wire import protocol as P

log = logging.getLogger(__name__)
IPC_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL
# A daemon answers a ping in microseconds; a second covers a loaded machine.
PING_TIMEOUT_S = 1.0
# Start-up probes of an existing socket (connect, then ping): a live daemon answers far
# sooner, and a start must not hang long on a listener that never answers.
PROBE_TIMEOUT_S = 0.5
# Pending connections the kernel queues for the daemon: a whole cluster's ranks connecting
# at once.
LISTEN_BACKLOG = 256


class EndpointBusyError(RuntimeError):
    """Another live daemon (or another program) listens on the endpoint."""


def ping(endpoint: str, timeout_s: float = PING_TIMEOUT_S) -> int | None:
    """The pid of the daemon answering on ``endpoint``, or None if nobody answers in time."""
    ctx: zmq.Context = zmq.Context.instance()
    sock: zmq.Socket = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encode("ping"))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        msg = P.decode(sock.recv())
        return int(msg.get("pid", -1)) if msg["t"] == "pong" else None
    except (zmq.ZMQError, P.ProtocolError, ValueError, TypeError):
        return None
    finally:
        sock.close()


@dataclass(frozen=True)
class IpcAddress:
    """An ``ipc://`` endpoint: a filesystem path, or an abstract name (``@name``)."""

    endpoint: str
    path: Path | None  # None: abstract
    abstract: str | None

    @classmethod
    def parse(cls, endpoint: str) -> IpcAddress:
        addr = endpoint[len("ipc://") :]
        if not addr:
            raise ValueError(f"endpoint {endpoint!r} names no socket path")
        if "\0" in addr:
            raise ValueError(f"endpoint {endpoint!r} contains a NUL byte")
        if len(addr.encode()) > IPC_PATH_MAX:
            raise ValueError(
                f"ipc path {addr} is {len(addr.encode())} bytes, longer than the "
                f"{IPC_PATH_MAX} a Unix socket allows"
            )
        if addr.startswith("@"):
            return cls(endpoint, None, addr[1:])
        return cls(endpoint, Path(addr), None)

    @property
    def sockaddr(self) -> str:
        return "\0" + self.abstract if self.abstract is not None else str(self.path)


def check_endpoint(endpoint: str, *, curve: bool, insecure_tcp: bool) -> None:
    """Refuse endpoints we must not take: a live daemon's, a path that is not a stale
    socket, an unusable folder, or tcp without CURVE (or off loopback with --insecure-tcp).
    A stale socket (nobody listens) is removed here, after that was proven."""
    if endpoint.startswith("ipc://"):
        _check_ipc(IpcAddress.parse(endpoint))
    elif endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if not curve:
            if not insecure_tcp:
                raise ValueError(
                    f"refusing tcp endpoint {endpoint} without CURVE keys: anyone who can "
                    f"connect could read the corpus. Set curve_secret_key_file, or "
                    f"--insecure-tcp on loopback for testing"
                )
            if not _is_loopback(host):
                raise ValueError(f"--insecure-tcp is allowed on loopback only, not {host!r}")
    else:
        raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")


def _check_ipc(addr: IpcAddress) -> None:
    path = addr.path
    if path is not None:
        _check_folder(path.parent, "endpoint")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ValueError(
                f"endpoint path {path} exists and is not a socket ({_kind(st.st_mode)}); "
                f"refusing to replace it: choose another --endpoint"
            )
    if not _listening(addr):
        if path is not None:
            os.unlink(path)
            log.info("removed stale socket %s (a socket nobody listens on)", path)
        return
    pid = ping(addr.endpoint, timeout_s=PROBE_TIMEOUT_S)
    if pid is not None:
        raise EndpointBusyError(
            f"another dflash-loader daemon (pid {pid}) is serving on {addr.endpoint}; stop it "
            f"first or choose another --endpoint"
        )
    raise EndpointBusyError(
        f"something listens on {addr.endpoint} (no dflash-loader daemon answered a ping "
        f"there within {PROBE_TIMEOUT_S} s); choose another --endpoint"
    )


def _listening(addr: IpcAddress) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(addr.sockaddr)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as e:
        raise ValueError(f"cannot check endpoint {addr.endpoint}: {e.strerror}") from None
    finally:
        probe.close()


def _check_folder(folder: Path, what: str) -> None:
    """``folder`` exists (created if missing) and this process may create files in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{what} folder {folder} exists and is not a directory") from None
    except OSError as e:
        raise ValueError(f"cannot create {what} folder {folder}: {e.strerror}") from None
    if not folder.is_dir():
        raise ValueError(f"{what} folder {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} folder {folder} is not writable by this user (uid {os.getuid()})")


def listen_ipc(addr: IpcAddress, mode: int, group: str | None) -> int:
    """A listening Unix socket bound at ``addr``, its file given ``mode`` and ``group``;
    returns the descriptor, which ZeroMQ takes over (``ZMQ_USE_FD``) and closes.

    ``bind(2)`` never replaces an existing path: a path that appeared since the check
    makes this fail (EADDRINUSE) rather than disappear."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # no window in which others could connect
        try:
            sock.bind(addr.sockaddr)
        finally:
            os.umask(old)
        if addr.path is not None:
            os.chmod(addr.path, mode)
            if group is not None:
                os.chown(addr.path, -1, grp.getgrnam(group).gr_gid)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EndpointBusyError(
                f"{addr.endpoint} was taken by someone else while the daemon started"
            ) from None
        raise ValueError(f"cannot listen on {addr.endpoint}: {e.strerror}") from None
    return sock.detach()


def socket_identity(addr: IpcAddress) -> tuple[int, int] | None:
    """(device, inode) of the socket file just bound, so shutdown unlinks only that one."""
    if addr.path is None:
        return None
    st = os.lstat(addr.path)
    return st.st_dev, st.st_ino


def remove_socket(addr: IpcAddress, identity: tuple[int, int] | None) -> None:
    """Unlink the socket file at shutdown if it is still the one this daemon bound."""
    if addr.path is None or identity is None:
        return
    try:
        st = os.lstat(addr.path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity and stat.S_ISSOCK(st.st_mode):
        addr.path.unlink(missing_ok=True)


def check_shm_dir(shm_dir: Path) -> int:
    """Prove rings can be made in ``shm_dir``: create, reserve, map, write, unlink a probe.
    Returns the bytes available to this user there (for the default ring budget)."""
    if not shm_dir.is_dir():
        raise ValueError(f"shm dir {shm_dir} does not exist or is not a directory")
    probe = shm_dir / f".dflash-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ValueError(f"shm dir {shm_dir} cannot hold rings: {e.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, mmap.PAGESIZE)
        with mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED) as mm:
            mm[:8] = b"dflash\0\0"
    except OSError as e:
        raise ValueError(f"shm dir {shm_dir} cannot hold rings: {e.strerror}") from None
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    vfs = os.statvfs(shm_dir)
    return vfs.f_bavail * vfs.f_frsize


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a socket"
