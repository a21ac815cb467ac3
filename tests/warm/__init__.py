"""Warm starts for the trainer processes the tests start (docs/TESTING.md, "Warm starts").

A trainer process spends 6 to 9 seconds of its CPU importing torch and transformers before
its first line of work, and the suite starts hundreds of them. Each test process (each
pytest-xdist worker) starts one server (``server.py``) that has imported them once; the
processes the tests start as ``python -m trainer.cli ...`` or ``-m torch.distributed.run``
are forked from it (``hook/sitecustomize.py``) and run the same module in an environment
rebuilt to be the one they were started with. ``DFLASH_TEST_WARM=0`` (``make test WARM=0``)
starts every process cold, as a user's are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Names the server's folder to the processes the tests start (``0``: no server).
ENV = "DFLASH_TEST_WARM"
HERE = Path(__file__).resolve().parent
#: Room in the server's argument area for a forked process's command line (/proc/PID/cmdline).
_ARG_ROOM = 32 * 1024


@contextlib.contextmanager
def serving() -> Iterator[Path | None]:
    """A warm server for this process's tests, named in the environment while they run."""
    if os.environ.get(ENV) == "0" or not sys.platform.startswith("linux"):
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="dflash-warm-"))  # short: a socket path's limit
    saved = {k: os.environ.get(k) for k in (ENV, "PYTHONPATH")}
    os.environ[ENV] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE / "hook"), os.environ.get("PYTHONPATH")) if p
    )
    with open(folder / "server.out", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "server.py"), str(folder), "x" * _ARG_ROOM],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    (folder / "server.pid").write_text(str(proc.pid))  # what starts before it serves waits
    try:
        yield folder
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.environ.get("DFLASH_TEST_WARM_LOG"):
            shutil.copytree(
                folder,
                Path(os.environ["DFLASH_TEST_WARM_LOG"]) / str(os.getpid()),
                dirs_exist_ok=True,
                ignore=lambda d, names: [n for n in names if n == "sock"],
            )
        shutil.rmtree(folder, ignore_errors=True)


def ready(timeout_s: float = 60.0) -> bool:
    """Whether this process's warm server is serving (waiting up to ``timeout_s`` for it)."""
    folder = os.environ.get(ENV)
    if not folder or folder == "0":
        return False
    deadline = time.monotonic() + timeout_s
    while not (Path(folder) / "sock").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def real_pid(pid: int) -> int:
    """The process that does the work of process ``pid``: the one forked for it when ``pid``
    is a warm start's stand-in, else ``pid`` itself."""
    folder = os.environ.get(ENV)
    if not folder or folder == "0":
        return pid
    path = Path(folder) / "clients" / str(pid)
    ready()  # a stand-in started before the server serves waits for it (hook/sitecustomize)
    deadline = time.monotonic() + 5.0
    while True:
        try:
            text = path.read_text()
        except OSError:
            return pid  # not a stand-in (or one that starts cold)
        if text:
            return int(text)
        if not Path(f"/proc/{pid}").exists() or time.monotonic() > deadline:
            return pid
        time.sleep(0.01)  # a stand-in still waiting for its fork
