"""Stopping and changing a job cleanly (the trainer unit's `systemctl stop` / spec change).

Real components throughout: a `dflash-loader serve` subprocess on an ipc:// socket under
tmp, `dflash-torchrun` (the unit's launcher) running 2 gloo ranks of `dflash-train train`
on CPU, SIGTERM sent to the launcher exactly as systemd's KillMode=mixed does, and the
daemon's own `stats` answer as the judge of which sessions are open.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from procs import children
from trainer_jobs import RUN_TIMEOUT_S, daemon, env, records

from client import LoaderClient, LoaderRequestError
from loader_server.wire import protocol as P

pytestmark = [pytest.mark.integration, pytest.mark.heavy(11)]
__all__ = ["daemon"]  # the fixture, re-used from the 2-rank integration tests

TRAIN_FLAGS = (
    "--block-size", "8", "--anchors-per-doc", "16", "--max-seq-len", "256", "--lr", "3e-3",
    "--warmup", "2", "--num-eval-prompts", "0", "--no-progress",
)  # fmt: skip


def sessions(endpoint: str) -> list[dict]:
    """The daemon's open sessions, asked over its socket (what `dflash-loader stats` does)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encode("stats"))
        assert sock.poll(5000), "the daemon did not answer stats"
        return P.decode(sock.recv(), max_bytes=P.MAX_STATS_BYTES)["sessions"]
    finally:
        sock.close()


def launch(endpoint: str, run_dir: Path, job: str, log: Path, *extra: str) -> subprocess.Popen:
    """The unit's command line: dflash-torchrun ... dflash-train train --resume --job JOB."""
    cmd = [
        sys.executable, "-m", "trainer.train.launch", "--standalone", "--nproc-per-node", "2",
        "-m", "trainer.cli", "train", "--resume", "--job", job, "--endpoint", endpoint,
        "--run-dir", str(run_dir), *TRAIN_FLAGS, *extra,
    ]  # fmt: skip
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env())


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while max(records(run_dir), default=-1) < step:  # the file may exist, still empty
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the trainer made no progress"
        time.sleep(0.05)


def stop(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.returncode is not None, log.read_text(errors="replace")[-3000:]


def test_sigterm_closes_the_sessions_checkpoints_and_exits_0(daemon, tmp_path):
    """SIGTERM to the launcher: both sessions closed at once, one checkpoint, exit 0. Then
    the job's batch spec changes as a unit's would (one launch serves both checks): the
    stopped job started again (new run dir) with another spec is accepted at once, and the
    stopped run resumes from its checkpoint under its own spec."""
    run_dir, log = tmp_path / "run", tmp_path / "t.log"
    proc = launch(daemon.endpoint, run_dir, "stop", log, "--steps", "100000", "--token-budget",
                  "1024")  # fmt: skip
    wait_for_step(proc, run_dir, 3, log)
    assert len(children(proc.pid)) == 2
    assert {s["rank"] for s in sessions(daemon.endpoint) if s["job"] == "stop"} == {0, 1}

    proc.send_signal(signal.SIGTERM)  # systemctl stop, KillMode=mixed: the launcher only
    t0 = time.monotonic()
    closed_after = None
    while proc.poll() is None and time.monotonic() - t0 < 60:
        if closed_after is None and not sessions(daemon.endpoint):
            closed_after = time.monotonic() - t0
        time.sleep(0.02)
    rc = stop(proc, log)
    output = log.read_text(errors="replace")
    assert rc == 0, output[-3000:]
    # By the time the launcher has exited, the daemon has dropped both sessions and their
    # rings: nothing waits for the 120 s session timeout.
    assert sessions(daemon.endpoint) == []
    assert daemon.log().count("(job stop rank 0) closed: closed by client") == 1
    assert daemon.log().count("(job stop rank 1) closed: closed by client") == 1
    shm = Path(os.environ["DFLASH_LOADER_SHM_DIR"])  # the fixture's private ring folder
    assert not any(shm.iterdir()), list(shm.iterdir())
    print(f"sessions gone {closed_after or time.monotonic() - t0:.2f} s after SIGTERM")
    assert (closed_after or 0) < 10
    # Each rank stopped at the same step and the checkpoint holds exactly that step.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] is True
    last = max(records(run_dir))
    assert summary["steps"] == last >= 3
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step-{last:08d}"]
    assert "Traceback" not in output and "SignalException" not in output
    _restart_with_another_spec(daemon, tmp_path, "stop", run_dir, last)


def _restart_with_another_spec(daemon, tmp_path: Path, job: str, first: Path,
                               stopped_at: int) -> None:  # fmt: skip
    """Change a job's batch spec after job ``job``'s run ``first`` was stopped cleanly at
    ``stopped_at``: start it again (new run dir) with another spec. The old run's sessions
    are gone at once, so the daemon accepts the new spec, and a stopped run resumes from
    its checkpoint under its own spec."""
    second, log2 = tmp_path / "b", tmp_path / "b.log"
    proc = launch(daemon.endpoint, second, job, log2, "--steps", "3",
                  "--token-budget", "2048")  # fmt: skip
    assert stop(proc, log2) == 0, log2.read_text(errors="replace")[-3000:]
    served = json.loads((second / "loader_spec.json").read_text())
    assert served["token_budget"] == 2048
    assert sorted(records(second)) == [0, 1, 2, 3]
    assert "[mismatch]" not in log2.read_text(errors="replace")

    # Back to the first spec: the stopped run resumes from the checkpoint it wrote.
    log3 = tmp_path / "a2.log"
    proc = launch(daemon.endpoint, first, job, log3, "--steps", str(stopped_at + 2),
                  "--token-budget", "1024")  # fmt: skip
    assert stop(proc, log3) == 0, log3.read_text(errors="replace")[-3000:]
    assert f"resumed from {first / 'checkpoints' / f'step-{stopped_at:08d}'}" in log3.read_text()
    assert max(records(first)) == stopped_at + 2


def test_an_open_session_blocks_a_spec_change_and_the_refusal_names_it(daemons):
    d = daemons()
    held = LoaderClient(d.endpoint, job="held", rank=1, world_size=2, spec={"seed": 1})
    next(held)  # rank 1 of job "held" is open (and silent: nobody iterates it)
    (sid,) = [s["session"] for s in sessions(d.endpoint) if s["job"] == "held"]
    other = LoaderClient(d.endpoint, job="held", rank=0, world_size=2, spec={"seed": 2})
    with pytest.raises(LoaderRequestError) as e:
        next(other)
    text = str(e.value)
    assert e.value.code == P.E_MISMATCH
    assert "job 'held' runs with another spec" in text and "'seed': (1, 2)" in text
    # Which session, since when, and when it expires if its client stays silent.
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d:\d\d"
    m = re.search(rf"rank 1 \(session (\w+), opened ({stamp}), last message \d+ s ago, "
                  rf"expires ({stamp}) if its client stays silent\)", text)  # fmt: skip
    assert m is not None, text
    assert m.group(1) == sid
    opened = time.mktime(time.strptime(m.group(2)[:19], "%Y-%m-%d %H:%M:%S"))
    expires = time.mktime(time.strptime(m.group(3)[:19], "%Y-%m-%d %H:%M:%S"))
    assert abs(opened - time.time()) < 30
    assert 110 <= expires - opened <= 121  # the daemon's 120 s session timeout
    held.close()
    assert next(other).position == (0, 0, 0)  # closed: the job takes the new spec at once
    other.close()


def test_a_dead_clients_session_does_not_block_a_spec_change(daemons):
    """A trainer killed with -9 cannot close its session, but its connection is gone: the
    daemon notices when the job's new spec would conflict, instead of waiting 120 s (the
    session timeout). ZeroMQ learns of the closed connection asynchronously, so an open
    racing the close may still be refused once; the new spec must be served well before
    the timeout."""
    d = daemons()
    dead = LoaderClient(d.endpoint, job="gone", rank=1, world_size=2, spec={"seed": 1})
    next(dead)
    dead._sock.close(linger=0)  # what the kernel does for a killed process
    dead._sock = None
    deadline = time.monotonic() + 10  # far below the 120 s after which it would expire
    while True:
        new = LoaderClient(d.endpoint, job="gone", rank=0, world_size=2, spec={"seed": 2})
        try:
            assert next(new).position == (0, 0, 0)
            break
        except LoaderRequestError as e:
            assert e.code == P.E_MISMATCH and time.monotonic() < deadline, e
            new.close()
            time.sleep(0.05)
    assert "(job gone rank 1) closed: its client is gone" in d.log()
    new.close()


def test_close_returns_once_the_daemon_has_dropped_the_session(daemons):
    d = daemons()
    for _ in range(20):  # a race lost now and then would show up here
        c = LoaderClient(d.endpoint, job="c", rank=0, world_size=1)
        next(c)
        c.close()
        assert sessions(d.endpoint) == []
    assert not any(d.shm_dir.iterdir())
