"""What the trainer-against-a-daemon tests share: a real `dflash-loader serve` subprocess on
ipc://<tmp_path>/loader.sock (rings in a private /dev/shm folder, READY awaited with a
bounded poll), its fixtures, and the `torchrun ... -m trainer.cli train` command line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from loader_server.data.synth import SynthSpec, write_corpus
from trainer.train.metrics import read_metrics

READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 240.0


class Daemon:
    def __init__(
        self,
        dataset: Path,
        workdir: Path,
        shm_dir: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.endpoint = endpoint or f"ipc://{workdir}/loader.sock"
        self.log_path = workdir / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "loader_server", "serve", "--dataset", str(dataset)]
        cmd += ["--endpoint", self.endpoint, "--shm-dir", str(shm_dir), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "READY endpoint=" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemon did not become ready:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    spec = SynthSpec(
        num_samples=600, seed=3, median_len=96, max_len=256, vocab_size=512, content="learnable"
    )
    yield from _serve(spec, tmp_path, monkeypatch)


@pytest.fixture
def small_daemon(tmp_path, monkeypatch):
    """The daemon on a quarter of the corpus (lengths drawn alike), for a run of several
    epochs: each epoch's plan cut afresh gives 9, 9 and 10 steps of 4096 tokens."""
    spec = SynthSpec(
        num_samples=150, seed=5, median_len=96, max_len=256, vocab_size=512, content="learnable"
    )
    yield from _serve(spec, tmp_path, monkeypatch)


def private_shm(fallback: Path, prefix: str = "dflash-trainer-test") -> Path:
    """A fresh shm folder of the test's own (under /dev/shm, else under ``fallback``), so
    no two tests' daemons share rings; the caller removes it."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else fallback
    shm = base / f"{prefix}-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    return shm


def _serve(spec: SynthSpec, tmp_path: Path, monkeypatch):
    corpus = tmp_path / "corpus.arrow"
    write_corpus(corpus, spec)
    shm = private_shm(tmp_path)
    monkeypatch.setenv("DFLASH_LOADER_SHM_DIR", str(shm))  # the trainers' clients map there
    d = Daemon(corpus, tmp_path, shm)
    yield d
    d.stop()
    shutil.rmtree(shm, ignore_errors=True)


def train_cmd(endpoint: str, run_dir: Path, job: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "trainer.cli", "train",
        "--endpoint", endpoint, "--job", job, "--run-dir", str(run_dir),
        "--steps", str(steps), "--block-size", "8", "--anchors-per-doc", "16",
        "--token-budget", "1024", "--max-seq-len", "256", "--lr", "3e-3", "--warmup", "2",
        "--num-eval-prompts", "4", "--eval-new-tokens", "16", "--no-progress",
        *extra,
    ]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    with open(log, "wb") as f:
        res = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), timeout=RUN_TIMEOUT_S
        )
    assert res.returncode == 0, log.read_text(errors="replace")[-4000:]
    return res


def records(run_dir: Path) -> dict[int, dict]:
    """Step -> record of the run's metrics so far (none while the file is not there yet;
    a line the trainer is writing right now is skipped, as ``read_metrics`` does)."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
