"""Restarts: kill -9 of a client or of the daemon, SIGTERM, a second daemon on one endpoint;
the job continues at the exact next batch."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    WORKER,
    audited,
    batch_crc,
    check_batch_tokens,
    consume,
    plan_sequence,
    python_path,
    read_runs,
    seq_of,
)

from client import LoaderClient, LoaderUnavailableError

pytestmark = pytest.mark.integration


def _run_worker(d, job, rank, world, tmp_path, epochs=1, spec=None):
    state, log = tmp_path / f"state{rank}.json", tmp_path / f"log{rank}.txt"
    args = [sys.executable, str(WORKER), d.endpoint, job, str(rank), str(world), str(state),
            str(log), str(epochs)]  # fmt: skip
    if spec:
        args.append(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": python_path(Path(__file__).parent.parent)}
    return subprocess.Popen(args, env=env)


def _wait_lines(path: Path, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.005)
    raise TimeoutError(f"{path} did not reach {n} lines")


def test_kill9_client_then_restart_continues_exactly(daemons, corpus, tmp_path):
    d = daemons()
    log = tmp_path / "log0.txt"
    p = _run_worker(d, "k", 0, 1, tmp_path)
    _wait_lines(log, 40)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    p = _run_worker(d, "k", 0, 1, tmp_path)
    assert p.wait(60) == 0
    runs = read_runs(log)
    assert len(runs) == 2 and runs[1][0] > (0, 0, 0)
    got = audited(log)
    assert [(pos, ids) for pos, _, ids in got] == plan_sequence(corpus, 0, range(1))
    for _, crc, ids in got:
        assert crc == batch_crc(corpus, ids)


def test_kill9_daemon_then_new_daemon_client_continues(daemons, corpus):
    d = daemons()
    client = LoaderClient(d.endpoint, job="dk", rank=0, world_size=1, epochs=1, dead_after_s=0.5)
    got = consume(client, limit=50)
    d.kill()
    stale = list(d.shm_dir.iterdir())
    assert stale, "the killed daemon's ring should still be there before the sweep"
    d2 = daemons()  # same endpoint and shm dir: sweeps the dead instance's rings
    got += consume(client)
    assert seq_of(got) == plan_sequence(corpus, 0, range(1))
    for b in got[45:55]:
        check_batch_tokens(corpus, b)
    assert not any(p.exists() for p in stale)
    d2.stop()


# --- lifecycle ------------------------------------------------------------------------------


def test_sigterm_tells_clients_unlinks_rings_exits_zero(daemons):
    d = daemons()
    client = LoaderClient(d.endpoint, job="t", rank=0, world_size=1, timeout_s=1.0,
                          dead_after_s=0.3)  # fmt: skip
    next(client)
    ring, ctl = sorted(d.shm_dir.iterdir())
    assert ctl.name == ring.name + ".ctl"
    assert stat.S_IMODE(ring.stat().st_mode) == 0o600 == stat.S_IMODE(ctl.stat().st_mode)
    assert d.stop() == 0
    assert not list(d.shm_dir.iterdir())
    # Batches already announced stay readable (the mapping outlives the unlink); then `bye`,
    # then no daemon: the client gives up after its timeout.
    with pytest.raises(LoaderUnavailableError, match="no loader daemon answered"):
        for _ in range(10):  # up to a full ring (4 slots, none held by the client) first
            next(client)
    assert "stopped" in d.log()


def test_second_daemon_on_same_endpoint_refuses(daemons, tmp_path, shm_dir, corpus_path):
    d = daemons()
    p = subprocess.run(
        [sys.executable, "-m", "loader_server", "serve", "--dataset", str(corpus_path),
         "--endpoint", d.endpoint, "--shm-dir", str(shm_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode != 0
    assert f"another dflash-loader daemon (pid {d.proc.pid}) is serving" in p.stderr
    assert d.proc.poll() is None
