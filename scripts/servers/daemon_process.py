"""A loader daemon in a subprocess: start it, wait (bounded) for its READY line, stop it.

One mechanism for everything that runs a daemon of its own: the tests, the README demo,
``python benchmarks/bench_loader.py`` and ``python -m benchmarks.experiment``. Production
runs the daemon under systemd instead (``systemd/``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

READY_MARK = "READY endpoint="


class DaemonProcess:
    """``dflash-loader serve --dataset DATASET --endpoint ENDPOINT *args``, logging to
    ``log_path``; the constructor returns once the daemon logged READY (``ready_s`` after
    it was started) or raises ``RuntimeError`` with the end of its log."""

    def __init__(
        self,
        dataset: Path,
        endpoint: str,
        *args: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.endpoint = endpoint
        self.log_path = log_path
        cmd = [sys.executable, "-m", "loader_server", "serve", "--dataset", str(dataset),
               "--endpoint", endpoint, *args]  # fmt: skip
        started = time.perf_counter()
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=None if env is None else dict(env)
        )
        self._wait_ready(ready_timeout_s)
        self.ready_s = time.perf_counter() - started

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while READY_MARK not in self.log():
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(
                    f"loader daemon exited with {self.proc.returncode}:\n{self.log()[-2000:]}"
                )
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(
                    f"loader daemon not ready after {timeout_s:.0f} s ({self.log_path})"
                )
            time.sleep(0.02)

    def ready_line(self) -> str:
        return next(x for x in self.log().splitlines() if READY_MARK in x)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Signal the daemon and wait; SIGKILL if it outlives ``timeout_s``. Exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout_s)
            return self.proc.returncode
        finally:
            self._log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
