"""Running as a service: systemd notifications from the real daemon, config precedence,
endpoint access rules."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import DaemonProcess

from client import LoaderClient, LoaderUnavailableError
from loader_server.service.config import DaemonConfig, load_config
from loader_server.wire.spec import BatchSpec


def _datagrams(sock: socket.socket, until: str, timeout_s: float = 30) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in got[-1]:
            return got
    raise AssertionError(f"never saw {until!r}; got {got}")


def test_daemon_notifies_ready_watchdog_stopping_in_order(
    tmp_path, shm_dir, corpus_path, monkeypatch
):
    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    d = DaemonProcess(corpus_path, tmp_path, shm_dir)
    first = _datagrams(sock, "READY=1")
    watchdogs = _datagrams(sock, "WATCHDOG=1") + _datagrams(sock, "WATCHDOG=1")
    assert d.stop() == 0
    rest = _datagrams(sock, "STOPPING=1")
    msgs = first + watchdogs + rest
    kinds = [m.split("\n")[0].split("=")[0] for m in msgs]
    ready, stopping = kinds.index("READY"), kinds.index("STOPPING")
    assert ready < kinds.index("WATCHDOG") < stopping
    assert "STATUS=serving" in msgs[ready]
    assert any(m.startswith("STATUS=opening") for m in msgs[:ready])
    sock.close()


def test_config_file_then_flags_take_precedence(tmp_path):
    cfg = tmp_path / "loader.toml"
    cfg.write_text(
        '[daemon]\nendpoint = "ipc:///x/file.sock"\nslots = 6\nshm_mode = "0660"\n'
        "[spec]\ntoken_budget = 8192\nmax_seq_len = 2048\nseed = 3\n"
    )
    c = load_config(cfg)
    assert (c.endpoint, c.slots, c.shm_mode) == ("ipc:///x/file.sock", 6, 0o660)
    assert (c.spec.token_budget, c.spec.max_seq_len, c.spec.seed) == (8192, 2048, 3)
    assert c.session_timeout_s == DaemonConfig().session_timeout_s  # untouched default
    flags = c.with_overrides({"slots": 2, "endpoint": None}, {"seed": 9})
    assert (flags.slots, flags.endpoint, flags.spec.seed, flags.spec.token_budget) == (
        2, "ipc:///x/file.sock", 9, 8192,
    )  # fmt: skip
    assert load_config(None).spec == BatchSpec()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[daemon]\nslots = 'four'\n", "slots must be"),
        ("[daemon]\nslot = 4\n", "unknown key 'slot' in [daemon]"),
        ("[spek]\n", "unknown table [spek]"),
        ("[spec]\ntoken_budget = 100\n", "token_budget 100 is below"),
        ("[daemon]\nshm_mode = 'rw'\n", "octal string"),
        ("not toml [", "not a TOML config ([daemon], [spec]) (Expected"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path, text, error):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(cfg)
    assert error in str(e.value)
    assert "bad.toml" in str(e.value)


def test_serve_uses_config_file_and_flags_override(tmp_path, shm_dir, corpus_path):
    cfg = tmp_path / "loader.toml"
    cfg.write_text('[daemon]\nslots = 2\nshm_mode = "0640"\n[spec]\nseed = 5\n')
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, "--config", str(cfg), "--slots", "3")
    c = LoaderClient(d.endpoint, job="cfg", rank=0, world_size=1)
    next(c)
    assert c.effective_spec["seed"] == 5 and c.effective_spec["token_budget"] == 4096
    ring, ctl = sorted(shm_dir.iterdir())
    assert oct(ring.stat().st_mode & 0o777) == "0o640"
    assert oct(ctl.stat().st_mode & 0o777) == "0o660"
    assert c._ring is not None and c._ring.slots == 3  # flag beat the file's 2
    c.close()
    assert d.stop() == 0


def _serve(corpus_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loader_server", "serve", "--dataset", str(corpus_path), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_tcp_without_curve_keys_is_refused(corpus_path):
    p = _serve(corpus_path, "--endpoint", "tcp://127.0.0.1:5999")
    assert p.returncode != 0 and "refusing tcp endpoint" in p.stderr and "Traceback" not in p.stderr
    p = _serve(corpus_path, "--endpoint", "tcp://0.0.0.0:5999", "--insecure-tcp")
    assert p.returncode != 0 and "loopback only" in p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_insecure_tcp_on_loopback_serves(tmp_path, shm_dir, corpus_path):
    ep = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, "--insecure-tcp", endpoint=ep)
    c = LoaderClient(ep, job="tcp", rank=0, world_size=1)
    assert next(c).input_ids.numel() > 0
    c.close()
    assert d.stop() == 0


def test_journald_logs_have_no_timestamp(tmp_path, shm_dir, corpus_path, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    d = DaemonProcess(corpus_path, tmp_path, shm_dir)
    d.stop()
    line = next(x for x in d.log().splitlines() if "READY" in x)
    assert line.startswith("INFO loader_server.service.daemon: READY"), line
    monkeypatch.delenv("JOURNAL_STREAM")
    d = DaemonProcess(corpus_path, tmp_path, shm_dir)
    d.stop()
    line = next(x for x in d.log().splitlines() if "READY" in x)
    assert line[:4].isdigit(), line  # asctime first outside journald
    assert os.environ.get("JOURNAL_STREAM") is None


def test_prometheus_metrics(tmp_path, shm_dir, corpus_path):
    pytest.importorskip("prometheus_client")
    port = _free_port()
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, "--metrics-port", str(port))
    c = LoaderClient(d.endpoint, job="prom", rank=0, world_size=1)
    for _ in range(3):
        next(c)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "dflash_loader_sessions 1.0" in text
    batches = [
        x for x in text.splitlines() if x.startswith('dflash_loader_batches_total{job="prom"')
    ]
    assert batches and float(batches[0].split()[-1]) >= 3
    c.close()
    assert d.stop() == 0


def test_a_busy_metrics_port_is_named_as_the_metrics_endpoint(tmp_path, shm_dir, corpus_path):
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "loader_server", "serve", "--dataset", str(corpus_path),
             "--endpoint", f"ipc://{tmp_path}/m.sock", "--shm-dir", str(shm_dir),
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    errors = [x for x in res.stderr.splitlines() if x.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"metrics endpoint 127.0.0.1:{port}" in errors[0], errors[0]
    assert not list(shm_dir.glob("dflash-*")) and not (tmp_path / "m.sock").exists()


def test_tcp_with_curve_keys_serves_only_clients_with_the_key(tmp_path, shm_dir, corpus_path):
    import zmq.auth

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "server")
    server_public, _ = zmq.auth.load_certificate(public_file)
    ep = f"tcp://127.0.0.1:{_free_port()}"
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, "--curve-secret-key-file", secret_file,
                      endpoint=ep)  # fmt: skip
    good = LoaderClient(ep, job="curve", rank=0, world_size=1, curve_server_key=server_public)
    assert next(good).input_ids.numel() > 0
    good.close()
    plain = LoaderClient(ep, job="plain", rank=0, world_size=1, timeout_s=1, dead_after_s=0.5)
    with pytest.raises(LoaderUnavailableError):
        next(plain)
    assert d.stop() == 0
