"""sd_notify: datagrams reach a real NOTIFY_SOCKET in order; no socket means no-op."""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader_server.service.sdnotify import Notifier

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs AF_UNIX sockets")

# AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer on some hosts.
_MAX_UNIX_PATH = 100


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)  # bounded wait: a missing datagram fails the test, never hangs it
    return sock


def _recv_all(sock: socket.socket, count: int) -> list[bytes]:
    return [sock.recv(4096) for _ in range(count)]


def _assert_nothing_queued(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "notify.sock"
    if len(str(path)) <= _MAX_UNIX_PATH:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="sdn", dir="/tmp") as short:
        yield Path(short) / "notify.sock"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _lifecycle(n: Notifier) -> None:
    assert n.ready("serving 902000 samples on ipc:///run/dflash-loader/loader.sock")
    assert n.status("2 jobs, 16 ranks, 31.2K tokens/s")
    assert n.watchdog()
    assert n.stopping()


EXPECTED = [
    b"READY=1\nSTATUS=serving 902000 samples on ipc:///run/dflash-loader/loader.sock",
    b"STATUS=2 jobs, 16 ranks, 31.2K tokens/s",
    b"WATCHDOG=1",
    b"STOPPING=1",
]


def test_path_socket_receives_lifecycle_in_order(sock_path: Path, clean_env) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(sock_path))
    with _receiver(str(sock_path)) as rx:
        n = Notifier.from_env()
        assert n.enabled
        _lifecycle(n)
        assert _recv_all(rx, 4) == EXPECTED
        _assert_nothing_queued(rx)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_abstract_socket_receives_lifecycle_in_order(clean_env) -> None:
    name = f"dflash-sdnotify-test-{os.getpid()}-{uuid.uuid4().hex}"
    clean_env.setenv("NOTIFY_SOCKET", "@" + name)
    with _receiver(b"\0" + name.encode()) as rx:
        n = Notifier.from_env()
        _lifecycle(n)
        assert _recv_all(rx, 4) == EXPECTED


def test_unset_notify_socket_is_a_noop(clean_env) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    n = Notifier.from_env()
    assert not n.enabled
    assert n.ready("x") is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.stopping() is False
    assert n.watchdog_interval_s() is None  # nobody to ping


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("1000", None, 0.0005),
        ("30000000", "other", None),
        (None, None, None),
        ("0", None, None),
        ("not-a-number", None, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(
    sock_path: Path, clean_env, usec: str | None, pid: str | None, expected: float | None
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(sock_path))
    if usec is not None:
        clean_env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        clean_env.setenv("WATCHDOG_PID", str(os.getpid() + (0 if pid == "self" else 1)))
    assert Notifier.from_env().watchdog_interval_s() == expected


@pytest.mark.parametrize("how", ["unlinked", "closed"])
def test_vanished_socket_does_not_raise_and_warns_once(
    sock_path: Path, clean_env, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    rx = _receiver(str(sock_path))
    n = Notifier(str(sock_path))
    assert n.watchdog()
    rx.close()  # the file stays behind: ECONNREFUSED
    if how == "unlinked":
        sock_path.unlink()  # ENOENT
    with caplog.at_level(logging.WARNING, logger="loader_server.service.sdnotify"):
        assert n.watchdog() is False
        assert n.stopping() is False
        assert n.ready("again") is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(sock_path) in warnings[0].getMessage()


def test_status_is_one_line_and_malformed_assignments_are_rejected(sock_path: Path) -> None:
    with _receiver(str(sock_path)) as rx:
        n = Notifier(str(sock_path))
        assert n.status("line one\nline two")
        assert rx.recv(4096) == b"STATUS=line one line two"
        assert n.send("READY=1", "STATUS=ok")
        assert rx.recv(4096) == b"READY=1\nSTATUS=ok"
        assert n.extend_timeout(2.5)
        assert rx.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        n.send("READY")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        n.send("STATUS=a\nWATCHDOG=1")


def test_unset_environment_hides_the_socket_from_children(sock_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}
    n = Notifier.from_env(env, unset_environment=True)
    assert env == {}
    assert n.enabled
    kept = {"NOTIFY_SOCKET": str(sock_path)}
    Notifier.from_env(kept)
    assert kept == {"NOTIFY_SOCKET": str(sock_path)}


def test_non_unix_address_disables_notifications(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="loader_server.service.sdnotify"):
        n = Notifier("vsock:2:1234")
    assert not n.enabled
    assert n.ready() is False
    assert "not a unix socket address" in caplog.text
