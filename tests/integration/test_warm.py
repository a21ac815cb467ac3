"""Warm starts (tests/warm) give a process what a cold start gives it: the same command
line, folder, environment, limits, signal state, streams and open files, the same exit
status, signals forwarded, and the forked process gone when its stand-in is killed. The
probe runs both ways and what it saw is compared whole."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm


@pytest.fixture(autouse=True)
def _served() -> None:
    """The session's warm server (started after collection, so asked for here)."""
    if os.environ.get(warm.ENV, "0") == "0":
        pytest.skip("warm starts are off (make test WARM=0)")
    assert warm.ready(), "the warm server did not start (its log: server.out in its folder)"


PROBE = [sys.executable, "-m", "probe"]


def _env(cold: bool, **extra: str) -> dict[str, str]:
    env = {**os.environ, "DFLASH_TEST_WARM_MODULES": "probe", "OMP_NUM_THREADS": "1",
           "DFLASH_TEST_WARM_SCRIPTS": str(warm.HERE / "probe.py"), **extra}  # fmt: skip
    if cold:
        env.pop(warm.ENV)
    return env


def _until_warm(proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 30
    while (pid := warm.real_pid(proc.pid)) == proc.pid:
        assert proc.poll() is None and time.monotonic() < deadline, "not started warm"
        time.sleep(0.05)
    return pid


def _restricted() -> None:
    """A start a test might give: its own umask, a file-size limit, SIGHUP ignored,
    SIGUSR1 blocked, and a session of its own."""
    os.umask(0o027)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    os.setsid()


@pytest.mark.parametrize(
    "flags",
    [["-m", "probe"], ["-u", "-m", "probe"], ["-u", "probe.py"]],
    ids=["buffered", "unbuffered", "script"],
)
def test_a_warm_start_sees_what_a_cold_one_sees(tmp_path, flags):
    """A module (``-m``, buffered or not) or a script: its folder first on the path, its
    ``__file__`` and ``sys.argv`` as given."""
    r, w = os.pipe()
    seen = {}
    try:
        for cold in (True, False):
            cmd = [sys.executable, *flags, "--wait", str(w)]
            proc = subprocess.Popen(
                cmd, cwd=warm.HERE, env=_env(cold, PROBE_SEEN="yes"), stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, preexec_fn=_restricted, pass_fds=(w,),
            )  # fmt: skip
            if not cold:
                assert _until_warm(proc) != proc.pid
            seen[cold] = json.loads(proc.stdout.readline())
            proc.terminate()
            assert proc.stdout.read() == b"stopping\n"
            assert proc.wait(30) == 143
    finally:
        os.close(r)
        os.close(w)
    assert seen[False] == seen[True]
    assert seen[True]["env"] == {"PROBE_SEEN": "yes", "OMP_NUM_THREADS": "1"}
    assert w in seen[True]["fds"] and seen[True]["umask"] == 0o027  # the check can see them
    if "probe.py" in flags:
        assert seen[True]["argv"][0] == "probe.py" and seen[True]["path0"] == str(warm.HERE)


@pytest.mark.parametrize("args, code", [(["--exit", "3"], 3), (["--die", "10"], -10)])
def test_a_warm_start_ends_as_a_cold_one(tmp_path, args, code):
    for cold in (True, False):
        res = subprocess.run([*PROBE, *args], cwd=warm.HERE, env=_env(cold),
                             capture_output=True, timeout=60)  # fmt: skip
        assert res.returncode == code, (cold, res.stderr[-2000:])
        assert (b"warm" in res.stderr) != cold  # the probe says how it started
        assert json.loads(res.stdout)["main"] == "__main__"


def test_killing_the_stand_in_kills_its_process(tmp_path):
    proc = subprocess.Popen([*PROBE, "--wait"], cwd=warm.HERE, env=_env(False),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    real = _until_warm(proc)
    assert b"probe" in Path(f"/proc/{real}/cmdline").read_bytes()  # it shows its command
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{real}").exists():
        state = Path(f"/proc/{real}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        assert time.monotonic() < deadline, "the forked process outlived its stand-in"
        time.sleep(0.05)
