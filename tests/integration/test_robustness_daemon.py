"""Mistakes and accidents of real machines, against a real daemon subprocess.

Nothing a user or a bad corpus does may kill the daemon, corrupt a batch or delete a file:
endpoints that name other files, a full or read-only shared-memory folder, a corpus
truncated or rewritten while it is served, clients that ask for too much, signals.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import grp
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq
from conftest import ROOT, TEST_SPEC, DaemonProcess, check_batch_tokens, expected_plan

from client import LoaderClient, LoaderError, LoaderRequestError
from loader_server.data.dataset import open_dataset
from loader_server.data.synth import SynthSpec, write_corpus
from loader_server.wire import protocol as P

pytestmark = [pytest.mark.integration, pytest.mark.heavy(26)]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """``dflash-loader ARGS`` in a subprocess (this checkout's code)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "loader_server", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
    )  # fmt: skip


def one_line_error(p: subprocess.CompletedProcess) -> str:
    """A CLI failure: non-zero exit, no traceback, and one ``Error:`` line; returns it."""
    assert p.returncode != 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    errors = [x for x in p.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1, p.stderr
    return errors[0]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str):
    """A small tmpfs at ``path`` (needs root and mount(8)); skips the test otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}", *options))
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("mount(8) is not available")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def plan_positions(ds, epochs: int = 1, **spec) -> list[tuple[tuple[int, int, int], list]]:
    """Rank 0 of a one-rank job: (position, sample ids) in plan order."""
    out = []
    for e in range(epochs):
        plan = expected_plan(ds, e, **spec)
        for s in range(plan.num_steps):
            for m in range(plan.spec.grad_accum):
                out.append(((e, s, m), plan.micro(s, 0, m).tolist()))
    return out


def serve_args(corpus: Path, endpoint: str, shm_dir: Path) -> list[str]:
    return ["serve", "--dataset", str(corpus), "--endpoint", endpoint, "--shm-dir", str(shm_dir)]


@pytest.fixture(scope="module")
def slow_to_open(tmp_path_factory) -> Path:
    """A corpus of 1M tiny samples in 400 shards: opening it takes over a second here."""
    out = tmp_path_factory.mktemp("slow") / "c"
    p = run_cli("synth", str(out), "--samples", "1000000", "--median-len", "8", "--min-len",
                "4", "--max-len", "16", "--shards", "400", "--vocab-size", "1000",
                "--chunk-samples", "256", timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_stops_the_start(tmp_path, shm_dir, slow_to_open, sig):
    log_path = tmp_path / "serve.log"
    args = [*serve_args(slow_to_open, f"ipc://{tmp_path}/s.sock", shm_dir), "--vocab-size", "1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "loader_server", *args],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "shm dir" not in log_path.read_text():  # the corpus is being opened now
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
        t = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t
    finally:
        proc.kill()
        proc.wait()
    log = log_path.read_text()
    assert "READY endpoint" not in log and "opened" not in log, log  # stopped inside the scan
    assert took < 1.0, took
    if sig == signal.SIGINT:
        assert rc == 130 and "Error: interrupted" in log and "Traceback" not in log, log
    else:
        assert rc == 0 and "stopped before READY" in log, log
    assert not list(shm_dir.glob("dflash-*")) and not (tmp_path / "s.sock").exists()


# --- 1. the daemon never removes a path it did not create -----------------------------------


def test_endpoint_on_a_regular_file_is_refused_and_the_file_kept(tmp_path, shm_dir, corpus_path):
    victim = tmp_path / "precious.arrow"
    victim.write_bytes(b"ARROW1 not a socket")
    p = run_cli(*serve_args(corpus_path, f"ipc://{victim}", shm_dir))
    line = one_line_error(p)
    assert str(victim) in line and "not a socket" in line and "regular file" in line
    assert victim.read_bytes() == b"ARROW1 not a socket"
    assert "removing stale socket" not in p.stderr


def test_abstract_endpoint_touches_no_file(tmp_path, shm_dir, corpus_path, monkeypatch):
    name = f"dflash-test-{uuid.uuid4().hex[:8]}"
    decoy = tmp_path / f"@{name}"
    decoy.write_text("keep me")
    monkeypatch.chdir(tmp_path)
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, endpoint=f"ipc://@{name}")
    try:
        with LoaderClient(d.endpoint, job="abs", rank=0, world_size=1) as c:
            next(c)
        assert decoy.read_text() == "keep me"
    finally:
        assert d.stop() == 0
    assert decoy.read_text() == "keep me"


def test_stale_socket_is_replaced_but_a_listening_one_is_not(tmp_path, shm_dir, corpus_path):
    path = tmp_path / "loader.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listened, closed: a socket file nobody serves
    stale.close()
    d = DaemonProcess(corpus_path, tmp_path, shm_dir, endpoint=f"ipc://{path}")
    assert "removed stale socket" in d.log()
    assert d.stop() == 0
    assert not path.exists()  # the daemon removes the socket it created, at shutdown

    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.listen(1)  # another program serving there
    try:
        line = one_line_error(run_cli(*serve_args(corpus_path, f"ipc://{path}", shm_dir)))
        assert "something listens on" in line
        assert path.exists()
    finally:
        other.close()


def test_shm_dir_and_endpoint_folder_are_checked_before_ready(tmp_path, shm_dir, corpus_path):
    ep = f"ipc://{tmp_path}/a.sock"
    missing = tmp_path / "no-such-dir"
    line = one_line_error(run_cli(*serve_args(corpus_path, ep, missing)))
    assert str(missing) in line and "does not exist" in line
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = one_line_error(run_cli(*serve_args(corpus_path, f"ipc://{a_file}/x.sock", shm_dir)))
    assert str(a_file) in line
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        line = one_line_error(run_cli(*serve_args(corpus_path, ep, ro)))
        assert str(ro) in line and "cannot hold rings" in line and "Read-only" in line
        line = one_line_error(run_cli(*serve_args(corpus_path, f"ipc://{ro}/x.sock", shm_dir)))
        assert str(ro) in line and "not writable" in line


def test_sweep_removes_only_dead_daemons_rings(tmp_path, shm_dir, corpus_path):
    dead_pid = 2**22 + 12345  # above pid_max's default: never a live process
    dead = shm_dir / f"dflash-{dead_pid}-0123abcd-0123456789ab"
    dead_ctl = shm_dir / (dead.name + ".ctl")
    keep = [
        shm_dir / f"dflash-{dead_pid}-notes.txt",  # not our name pattern
        shm_dir / f"dflash-{dead_pid}-0123abcd-0123456789ab.bak",
        shm_dir / "unrelated",
    ]
    for p in (dead, dead_ctl, *keep):
        p.write_bytes(b"x")
    linked = shm_dir / f"dflash-{dead_pid}-0123abcd-ba9876543210"
    linked.symlink_to(corpus_path)  # a symlink with our name: never followed or removed
    # pid 1 is alive, but a daemon that ran as pid 1 (a container's) left this: nobody
    # holds it, and it is old
    reused = shm_dir / "dflash-1-0123abcd-0123456789ab"
    # a live daemon's rings: held (flock), whatever their pid says
    held = [shm_dir / "dflash-1-4567cdef-0123456789ab", shm_dir / f"dflash-{dead_pid}-4567cdef-0"]
    young = shm_dir / "dflash-1-89abcdef-0123456789ab"  # pid alive, just made: maybe locking
    for p in (reused, *held, young):
        p.write_bytes(b"x")
    old = time.time() - 3600
    for p in (reused, *held):
        os.utime(p, (old, old))
    fds = [os.open(p, os.O_RDONLY) for p in held]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_SH)
        d = DaemonProcess(corpus_path, tmp_path, shm_dir)
        d.stop()
    finally:
        for fd in fds:
            os.close(fd)
    assert not dead.exists() and not dead_ctl.exists() and not reused.exists()
    assert all(p.exists() for p in (*keep, *held, young)) and linked.is_symlink()


def test_a_live_daemons_old_rings_survive_another_daemons_sweep(tmp_path, shm_dir, corpus_path):
    a = DaemonProcess(corpus_path, tmp_path, shm_dir, name="a")
    try:
        client = LoaderClient(a.endpoint, job="j", rank=0, world_size=1, shm_dir=shm_dir)
        first = next(client)
        rings = sorted(shm_dir.glob("dflash-*"))
        assert len(rings) == 2  # the session's ring and its control page
        old = time.time() - 3600  # past the grace: only the lock says a is alive
        for p in rings:
            os.utime(p, (old, old))
        b = DaemonProcess(corpus_path, tmp_path, shm_dir, name="b")
        assert b.stop() == 0
        assert all(p.exists() for p in rings)
        second = next(client)  # a's session goes on in its ring
        assert second.input_ids.numel() >= 1 and first is not second
        client.close()
        # the plan's log line says what max_seq_len did to the corpus's longest samples
        over = int((open_dataset(corpus_path).lengths > TEST_SPEC["max_seq_len"]).sum())
        assert over > 0 and f"samples over max_seq_len 1,024: {over:,} truncated" in a.log()
    finally:
        assert a.stop() == 0
    assert not list(shm_dir.glob("dflash-*"))  # a unlinked its own at stop


# --- 2. shared memory is reserved up front; running short is one session's error ------------


def _fill_up(folder: Path) -> None:
    """Take every free byte of the filesystem under ``folder``."""
    with open(folder / "filler", "wb") as f, contextlib.suppress(OSError):  # ENOSPC: full
        while True:
            f.write(b"\xff" * (1 << 16))
            f.flush()


def test_full_tmpfs_is_one_sessions_error_not_a_sigbus(tmp_path, corpus_path):
    with tmpfs(tmp_path / "shm", "8m") as shm:
        caps = ("--max-ring-bytes", "1G", "--shm-budget-bytes", "1G")  # above the tmpfs
        d = DaemonProcess(corpus_path, tmp_path, shm, *caps)
        try:
            small = LoaderClient(d.endpoint, job="small", rank=0, world_size=1, shm_dir=shm)
            next(small)
            _fill_up(shm)  # the ring's pages were reserved when it was made
            for _ in range(150):  # every slot rewritten many times, with rows of all sizes
                next(small)
            big = LoaderClient(d.endpoint, job="big", rank=0, world_size=1, shm_dir=shm,
                               spec={"layout": "packed", "token_budget": 1 << 20})  # fmt: skip
            with pytest.raises(LoaderRequestError, match=r"no room for [\d,]+ bytes") as e:
                next(big)
            assert e.value.code == P.E_NO_SPACE and "No space left" in str(e.value)
            assert d.proc.poll() is None
            next(small)
            small.close()
        finally:
            assert d.stop() == 0


def test_ring_caps_default_from_the_free_space(tmp_path, corpus_path):
    with tmpfs(tmp_path / "shm", "8m") as shm:
        d = DaemonProcess(corpus_path, tmp_path, shm)
        try:
            assert "shared memory caps: 786,432 bytes per session, 6,291,456 bytes" in d.log()
            big = LoaderClient(d.endpoint, job="big", rank=0, world_size=1, shm_dir=shm,
                               spec={"token_budget": 1 << 20})  # fmt: skip
            with pytest.raises(LoaderRequestError, match="over the per-session cap of 786,432"):
                next(big)
        finally:
            d.stop()


def test_daemon_budget_refuses_then_admits_when_space_frees(daemons):
    """ENOSPC emulated by the daemon's own budget (runs without root): two rings fit."""
    d = daemons("--shm-budget-bytes", "400K", "--max-ring-bytes", "200K")
    a = LoaderClient(d.endpoint, job="a", rank=0, world_size=1)
    b = LoaderClient(d.endpoint, job="b", rank=0, world_size=1)
    next(a), next(b)
    c = LoaderClient(d.endpoint, job="c", rank=0, world_size=1, timeout_s=2)
    with pytest.raises(LoaderRequestError, match=r"409,600 bytes .* in use by 2 session") as e:
        next(c)
    assert e.value.code == P.E_NO_SPACE
    a.close()
    assert next(LoaderClient(d.endpoint, job="c", rank=0, world_size=1)).position == (0, 0, 0)
    next(b)


def test_group_mode_rings_are_not_group_writable(daemons):
    d = daemons("--shm-mode", "0660", "--group", grp.getgrgid(os.getgid()).gr_name)
    with LoaderClient(d.endpoint, job="m", rank=0, world_size=1) as c:
        next(c)
        ring, ctl = sorted(d.shm_dir.iterdir())
        assert stat.S_IMODE(ring.stat().st_mode) == 0o640  # the daemon alone writes batches
        assert stat.S_IMODE(ctl.stat().st_mode) == 0o660  # the client's counters


@pytest.fixture
def no_faulthandler():
    """The client below faults on purpose (its guard turns that into an error); pytest's
    faulthandler, enabled after our modules were imported, would print a traceback first."""
    was = faulthandler.is_enabled()
    faulthandler.disable()
    yield
    if was:
        faulthandler.enable()


def test_truncated_control_page_ends_only_that_session(daemons, corpus, no_faulthandler):
    d = daemons()
    victim = LoaderClient(d.endpoint, job="t", rank=0, world_size=2)
    other = LoaderClient(d.endpoint, job="t", rank=1, world_size=2, epochs=1)
    next(victim), next(other)
    ctl = next(p for p in d.shm_dir.iterdir() if p.suffix == ".ctl" and victim._sid in p.name)
    os.truncate(ctl, 0)  # what any writer of a control page could do
    with pytest.raises(LoaderError, match="truncated"):
        for _ in range(20):
            next(victim)
    assert sum(1 for _ in other) > 0
    assert d.proc.poll() is None
    assert "was truncated" in d.log()


# --- 3, 4. the corpus is immutable while served -----------------------------------------------


@pytest.fixture
def corpus_copy(tmp_path, corpus_path) -> Path:
    dst = tmp_path / "corpus-copy"
    shutil.copytree(corpus_path, dst)
    return dst


def _first_shard(folder: Path) -> Path:
    return sorted(folder.glob("*.arrow"))[0]


def _error_within(client: LoaderClient, seconds: float = 15) -> LoaderRequestError:
    deadline = time.monotonic() + seconds
    with pytest.raises(LoaderRequestError) as e:
        while time.monotonic() < deadline:
            next(client)
    return e.value


def _wait_log(d: DaemonProcess, text: str, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while text not in d.log():
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{d.log()[-2000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("check_s", ["0.2", "3600"], ids=["timer", "faulting-read"])
def test_truncated_corpus_stops_serving_it_without_dying(daemons, corpus_copy, check_s):
    d = daemons("--corpus-check-s", check_s, dataset=corpus_copy)
    client = LoaderClient(d.endpoint, job="t", rank=0, world_size=1)
    for _ in range(5):
        next(client)
    shard = _first_shard(corpus_copy)
    os.truncate(shard, 4096)
    err = _error_within(client)
    assert err.code == P.E_CORPUS and str(shard) in str(err) and "was truncated" in str(err)
    if check_s == "3600":  # the timer never ran again: the fill's read of a lost page
        assert "(SIGBUS)" in d.log()
    assert d.proc.poll() is None
    with pytest.raises(LoaderRequestError, match="stopped serving this corpus") as again:
        next(LoaderClient(d.endpoint, job="new", rank=0, world_size=1, timeout_s=2))
    assert again.value.code == P.E_CORPUS
    assert d.stop() == 0


def test_corpus_rewritten_in_place_is_noticed(daemons, corpus_copy):
    """Same size, mtime restored (``rsync --inplace -a`` style): the ctime moved and the
    content digest differs."""
    d = daemons("--corpus-check-s", "0.2", dataset=corpus_copy)
    client = LoaderClient(d.endpoint, job="w", rank=0, world_size=1)
    next(client)
    shard = _first_shard(corpus_copy)
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(bytes(4096))  # valid values (ids 0, mask 0): only the watcher can tell
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    err = _error_within(client)
    assert "was rewritten in place" in str(err) and str(shard) in str(err)
    assert d.proc.poll() is None


def test_chmod_of_the_corpus_is_not_a_change(daemons, corpus_copy, corpus):
    d = daemons("--corpus-check-s", "0.1", dataset=corpus_copy)
    client = LoaderClient(d.endpoint, job="c", rank=0, world_size=1, epochs=1)
    next(client)
    os.chmod(_first_shard(corpus_copy), 0o600)
    _wait_log(d, "metadata changed, content unchanged")
    assert len([check_batch_tokens(corpus, b) for b in client]) > 10


def test_atomic_replacement_serves_the_old_file_until_sighup(
    daemons, corpus_copy, corpus, tmp_path
):
    d = daemons("--corpus-check-s", "0.1", dataset=corpus_copy)
    old = LoaderClient(d.endpoint, job="r", rank=0, world_size=1, epochs=1, dead_after_s=1)
    check_batch_tokens(corpus, next(old))
    other = tmp_path / "other"
    write_corpus(other, SynthSpec(num_samples=2000, seed=99, median_len=200, max_len=1500),
                 shards=2)  # fmt: skip
    os.replace(_first_shard(other), _first_shard(corpus_copy))  # a new inode at the path
    _wait_log(d, "now names another file")
    for _ in range(20):  # still exactly the file the daemon opened
        check_batch_tokens(corpus, next(old))
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "reload: serving")
    with pytest.raises(LoaderRequestError, match=r"position \[0, \d+, 0\] belongs to corpus") as e:
        for _ in range(10):  # bye, reconnect: the old position is not for the new corpus
            next(old)
    assert e.value.code == P.E_MISMATCH
    new = LoaderClient(d.endpoint, job="r2", rank=0, world_size=1)
    next(new)
    assert new.fingerprint not in (None, corpus.fingerprint)
    assert d.proc.poll() is None


def test_sighup_with_an_unchanged_corpus_changes_nothing(daemons, corpus):
    d = daemons()
    client = LoaderClient(d.endpoint, job="h", rank=0, world_size=1, epochs=1)
    got = [next(client).position]
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "reload: ")
    assert "unchanged" in d.log()
    got += [b.position for b in client]
    assert got == [pos for pos, _ in plan_positions(corpus)]
    assert d.stop() == 0 and "stopped" in d.log()


# --- identity and resume ------------------------------------------------------------------------


def test_second_live_client_on_a_rank_is_refused(daemons, corpus):
    d = daemons()
    first = LoaderClient(d.endpoint, job="id", rank=0, world_size=1, epochs=1)
    got = [next(first).position]
    second = LoaderClient(d.endpoint, job="id", rank=0, world_size=1, timeout_s=2)
    with pytest.raises(LoaderRequestError, match=r"rank 0 of job 'id' is already being read") as e:
        next(second)
    assert e.value.code == P.E_BUSY
    got += [b.position for b in first]  # the first reader did not lose a single batch
    assert got == [pos for pos, _ in plan_positions(corpus)]
    assert next(second).position == (0, 0, 0)  # the rank is free again


def test_a_dead_clients_session_is_replaced_at_once(daemons):
    d = daemons()
    dead = LoaderClient(d.endpoint, job="dead", rank=0, world_size=1)
    next(dead)
    dead._sock.close(linger=0)  # what the kernel does for a killed trainer
    dead._sock = None
    # Connecting in the same millisecond races the daemon's I/O thread, which may not have
    # seen the old connection go (its heartbeat to the old peer still succeeds: "busy");
    # the client asks again for a moment, so the replacement is admitted anyway.
    state = dead.state_dict()
    again = LoaderClient(d.endpoint, job="dead", rank=0, world_size=1, timeout_s=5)
    again.load_state_dict(state)
    assert next(again).position == tuple(state["position"])
    assert "replaced by a new session of the same rank" in d.log()


def test_state_dict_records_the_spec_and_another_spec_is_refused(daemons):
    d = daemons()
    c = LoaderClient(d.endpoint, job="s", rank=0, world_size=1, spec={"seed": 1})
    for _ in range(5):
        next(c)
    state = c.state_dict()
    c.close()
    assert state["version"] == 3 and state["legs"] == [] and state["spec"]["seed"] == 1
    other = LoaderClient(d.endpoint, job="s", rank=0, world_size=1, spec={"seed": 2})
    other.load_state_dict(state)
    with pytest.raises(LoaderRequestError, match=r"saved under another spec.*'seed': \(1, 2\)"):
        next(other)
    assert not list(d.shm_dir.iterdir())  # refused before any ring was made
    same = LoaderClient(d.endpoint, job="s", rank=0, world_size=1, spec={"seed": 1})
    same.load_state_dict(state)
    assert next(same).position == tuple(state["position"])


@pytest.mark.parametrize(
    ("position", "text"),
    [
        ([0, 10**6, 0], r"position \[0, 1000000, 0\] is past the end of epoch 0, whose steps"),
        ([2**40, 0, 0], "below 2\\^31"),
        ([0, 0, 5], "pos micro 5 >= grad_accum 1"),
    ],
)
def test_out_of_range_positions_are_refused_with_their_value(daemons, position, text):
    d = daemons()
    c = LoaderClient(d.endpoint, job="p", rank=0, world_size=1, timeout_s=30)
    # An answer, not a timeout: running out of time would raise LoaderUnavailableError.
    with pytest.raises((LoaderRequestError, P.ProtocolError), match=text):
        c.load_state_dict({**c.state_dict(), "position": position})
        next(c)
    assert d.proc.poll() is None


# --- isolation between jobs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"grad_accum": 10**6}, "grad_accum 1000000 exceeds this daemon's limit of 4096"),
        ({"max_batch_size": 2**30}, "max_batch_size 1073741824 exceeds this daemon's limit"),
        ({"token_budget": 2**30}, "token_budget 1073741824 exceeds this daemon's limit"),
        ({"grad_accum": 3000}, "3000 micro-batches per step, but the corpus has 2000 samples"),
        # the corpus's own reason, not "too few samples"
        (
            {"max_seq_len": 8, "overlong": "drop"},
            "epoch 0 has no steps under this spec: all 2,000 non-empty samples are longer than "
            "max_seq_len 8 and overlong = drop",
        ),
    ],
)
def test_extreme_specs_are_refused_at_open(daemons, spec, text):
    d = daemons()
    c = LoaderClient(d.endpoint, job="x", rank=0, world_size=1, spec=spec, timeout_s=5)
    with pytest.raises(LoaderRequestError, match=text):  # an answer, not a timeout
        next(c)
    assert d.proc.poll() is None


def test_a_spec_outside_any_spec_s_bounds_is_the_client_s_own_error(daemons):
    """What no daemon could take is refused where it is asked for (``check_fields``), and
    the same sent raw is still the daemon's one-line refusal."""
    d = daemons()
    with pytest.raises(ValueError, match=r"token_budget must be an integer in \[1, 2147483647\]"):
        LoaderClient(d.endpoint, job="x", rank=0, world_size=1, spec={"token_budget": 2**31})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        sock.send(P.encode("open", job="x", rank=0, world_size=1, spec={"token_budget": 2**31},
                           pos=[0, 0, 0]))  # fmt: skip
        assert sock.poll(5000), "no answer"
        reply = P.decode(sock.recv())
    finally:
        sock.close()
    assert reply["code"] == P.E_BAD_REQUEST and "token_budget must be an integer" in reply["msg"]
    assert d.proc.poll() is None


def test_sessions_per_connection_are_capped(daemons):
    d = daemons("--max-sessions-per-peer", "3")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    replies = []
    for k in range(4):
        sock.send(P.encode("open", job=f"j{k}", rank=0, world_size=1, spec={}, pos=[0, 0, 0]))
        while True:  # "pending" while the plan is made
            assert sock.poll(5000)
            reply = msgpack.unpackb(sock.recv())
            if reply["t"] != "pending":
                break
        replies.append(reply)
    assert [r["t"] for r in replies] == ["welcome"] * 3 + ["error"]
    assert "already has 3 sessions (max_sessions_per_peer=3)" in replies[-1]["msg"]
    sock.close()


def test_planning_never_blocks_the_serving_thread(corpus, tmp_path, shm_dir, monkeypatch):
    """One job's epoch plan is held back (until the test lets it finish); another job keeps
    getting batches meanwhile, and the held job gets its welcome once its plan is ready.
    Events, not timings, decide: a serving thread blocked by planning would deliver the
    other job's batches only after the plan finished. The server runs in this process so
    that planning can be held."""
    import loader_server.service.plans as plans
    from loader_server.service.config import DaemonConfig
    from loader_server.service.server import LoaderServer
    from loader_server.wire.spec import BatchSpec

    real_plan = plans.plan_rest
    planning, finish, planned = threading.Event(), threading.Event(), threading.Event()

    def slow_plan(lengths, spec, *, epoch, **rest):
        if spec.seed == 7:
            planning.set()
            finish.wait(60)
            plan = real_plan(lengths, spec, epoch=epoch, **rest)
            planned.set()
            return plan
        return real_plan(lengths, spec, epoch=epoch, **rest)

    monkeypatch.setattr(plans, "plan_rest", slow_plan)
    endpoint = f"ipc://{tmp_path}/inproc.sock"
    server = LoaderServer(corpus, DaemonConfig(endpoint=endpoint, shm_dir=shm_dir,
                                               spec=BatchSpec(**TEST_SPEC)))  # fmt: skip
    server.bind()
    stop = threading.Event()
    loop = threading.Thread(target=server.serve_forever, args=(stop.is_set,))
    loop.start()
    try:
        fast = LoaderClient(endpoint, job="fast", rank=0, world_size=1)
        next(fast)
        slow_result: dict[str, bool] = {}

        def open_slow() -> None:
            slow = LoaderClient(endpoint, job="slow", rank=0, world_size=1, spec={"seed": 7},
                                dead_after_s=1.0)  # fmt: skip
            next(slow)
            slow_result["after_plan"] = planned.is_set()
            slow.close()

        opener = threading.Thread(target=open_slow)
        opener.start()
        assert planning.wait(30), "the held job's plan never started"
        for _ in range(20):
            next(fast)
        assert not planned.is_set(), "the other job's batches waited for the held plan"
        finish.set()
        opener.join(60)
        assert slow_result == {"after_plan": True}  # it waited for its plan (hearing "pending")
        fast.close()
    finally:
        finish.set()
        stop.set()
        loop.join(10)
        server.shutdown()


def test_stats_of_hundreds_of_sessions_reach_the_cli(daemons):
    """A reply that grows with the session count is not cut at the 64 KiB message limit."""
    d = daemons("--max-sessions-per-peer", "400", "--session-timeout-s", "60")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    for k in range(300):
        sock.send(P.encode("open", job=f"job-{k:04d}", rank=0, world_size=1, spec={},
                           pos=[0, 0, 0]))  # fmt: skip
    welcomed = 0
    while welcomed < 300:
        assert sock.poll(10_000)
        welcomed += msgpack.unpackb(sock.recv())["t"] == "welcome"
    p = run_cli("stats", "--endpoint", d.endpoint, "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["sessions"]) == 300
    sock.close()
