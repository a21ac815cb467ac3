"""What an operator sees when access is wrong: the messages systemd/README.md promises.

Permission checks are real: root bypasses file permissions (CAP_DAC_OVERRIDE), so the
commands under test run through ``setpriv`` with every capability dropped, which makes the
kernel judge them by uid, gid and mode bits like any other user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess

from loader_server.data.dataset import _permission_denied

NOBODY = 65534  # nobody / nogroup on Debian and most distributions

needs_root_and_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="dropping capabilities to test permissions needs root and setpriv (util-linux)",
)


def cli_without_caps(*args: str) -> subprocess.CompletedProcess:
    """``dflash-loader ARGS`` as root without any capability: file modes apply to it."""
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
    return subprocess.run(
        [*drop, sys.executable, "-m", "loader_server", *args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode != 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("Error:")]
    return line


@needs_root_and_setpriv
def test_stats_by_a_non_member_says_permission_denied(tmp_path, shm_dir, corpus_path):
    d = DaemonProcess(corpus_path, tmp_path, shm_dir)
    try:
        sock = d.endpoint.removeprefix("ipc://")
        # The unit's socket: mode 0660, owned by the daemon's user and group. Here that
        # pair is nobody:nogroup, so root without capabilities is a non-member.
        os.chown(sock, NOBODY, NOBODY)
        os.chmod(sock, 0o660)
        line = error_line(cli_without_caps("stats", "--endpoint", d.endpoint))
        assert f"permission denied connecting to {sock} as user root" in line
        assert "sudo usermod -aG nogroup" in line
        # Control: with the capability back the same command reaches the daemon.
        ok = stats_of(d.endpoint)
        assert ok.returncode == 0 and "(no sessions)" in ok.stdout, ok.stderr
    finally:
        assert d.stop() == 0


def stats_of(endpoint: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loader_server", "stats", "--endpoint", endpoint],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_stats_without_a_daemon_says_so(tmp_path):
    line = error_line(stats_of(f"ipc://{tmp_path}/none.sock"))
    assert f"{tmp_path}/none.sock does not exist" in line
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # bound, never listening: what a killed daemon leaves
    s.close()
    line = error_line(stats_of(f"ipc://{stale}"))
    assert f"{stale}: no daemon listens on this socket" in line


@needs_root_and_setpriv
def test_an_unreadable_dataset_is_one_line_naming_it(tmp_path, corpus_path):
    hidden = tmp_path / "hidden"
    shutil.copytree(corpus_path, hidden / "corpus")
    hidden.chmod(0o000)  # what ProtectHome=yes does to /home
    try:
        for flag_or_config in ("flag", "config"):
            if flag_or_config == "flag":
                args = ["serve", "--dataset", str(hidden / "corpus")]
            else:
                cfg = tmp_path / "loader.toml"
                cfg.write_text(f'[daemon]\ndataset = "{hidden / "corpus"}"\n')
                args = ["serve", "--config", str(cfg)]
            args += ["--endpoint", f"ipc://{tmp_path}/x.sock"]
            line = error_line(cli_without_caps(*args))
            want = f"{hidden / 'corpus'}: permission denied reading the dataset as user root"
            assert want in line
    finally:
        hidden.chmod(0o755)


def test_a_dataset_under_home_names_protect_home():
    path = Path("/home/alice/corpus")
    text = _permission_denied(path, PermissionError(13, "Permission denied", str(path)))
    assert text.startswith("/home/alice/corpus: permission denied reading the dataset as ")
    assert "ProtectHome=yes" in text and "/data/corpus" in text
    other = _permission_denied(Path("/srv/c"), PermissionError(13, "Permission denied", "/srv/c"))
    assert "ProtectHome" not in other and "chmod -R g+rX" in other


def test_a_failed_start_reports_why_not_draining(tmp_path, shm_dir, monkeypatch):
    """`systemctl status` keeps the last STATUS=: after a failed start it must be the cause."""
    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(10)
    p = subprocess.run(
        [sys.executable, "-m", "loader_server", "serve", "--dataset", str(tmp_path / "nope"),
         "--endpoint", f"ipc://{tmp_path}/x.sock", "--shm-dir", str(shm_dir)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": addr},
    )  # fmt: skip
    assert p.returncode != 0
    got = []
    sock.settimeout(0.5)
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except TimeoutError:
        pass
    sock.close()
    assert got, "the daemon sent no notification"
    assert got[-1] == f"STATUS=failed to start: {tmp_path / 'nope'}: no such file or directory"
    assert not any("draining" in m or "STOPPING=1" in m for m in got), got
