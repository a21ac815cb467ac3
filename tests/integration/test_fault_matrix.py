"""The fault matrix (docs/TRAINER.md, "What survives what"): each process of a job killed
with SIGKILL at each phase of its work, then the documented restart; the job finishes, and
its record is the uninterrupted run's step for step (the same losses from the same batches:
every sample served once, none twice, none lost).

The kills land where they mean to: ``DFLASH_FAULT`` (``loader_server.faults``) makes the
process SIGKILL itself at a named point (a daemon planning epoch E, a rank starting step N,
a rank inside checkpoint N's write). The daemon's restart is what systemd's
``Restart=on-failure`` does (``Supervised`` starts it again on the same endpoint); a
trainer's is the user's (or torchrun's) rerun of the same command with ``--resume``.
Rows with more ranks, nodes or other processes are tests elsewhere, named in the table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import children, kill_tree
from trainer_jobs import RUN_TIMEOUT_S, Daemon, env, private_shm, records

from loader_server.data.synth import SynthSpec, write_corpus
from loader_server.faults import ENV

pytestmark = [pytest.mark.integration, pytest.mark.heavy(40)]

CKPT_EVERY = 3


class Supervised:
    """A daemon that is started again whenever it dies, as systemd's ``Restart=`` does;
    ``faults[k]``: the ``DFLASH_FAULT`` of its k-th start (None, or past the list: none)."""

    def __init__(self, corpus: Path, workdir: Path, shm: Path, *faults: str | None):
        self.corpus, self.workdir, self.shm = corpus, workdir, shm
        self.faults, self.starts = list(faults), 0
        self._stop = threading.Event()
        self.daemon = self._start()
        self.endpoint = self.daemon.endpoint
        self._watch = threading.Thread(target=self._supervise, daemon=True)
        self._watch.start()

    def _start(self) -> Daemon:
        fault = self.faults[self.starts] if self.starts < len(self.faults) else None
        self.starts += 1
        extra = {ENV: fault} if fault else {}
        log_dir = self.workdir / f"daemon-{self.starts}"
        log_dir.mkdir()
        return Daemon(self.corpus, log_dir, self.shm, env={**os.environ, **extra},
                      endpoint=f"ipc://{self.workdir}/loader.sock")  # fmt: skip

    def _supervise(self) -> None:
        while not self._stop.wait(0.05):
            if self.daemon.proc.poll() is not None:
                self.daemon.stop()
                self.daemon = self._start()

    def kill(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)

    def logs(self) -> str:
        return "".join(
            (self.workdir / f"daemon-{k}" / "daemon.log").read_text(errors="replace")
            for k in range(1, self.starts + 1)
        )

    def stop(self) -> None:
        self._stop.set()
        self._watch.join()
        self.daemon.stop()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Iterator[dict]:
    """The corpus, a private shm folder, and the uninterrupted run's records."""
    root = tmp_path_factory.mktemp("matrix")
    corpus = root / "corpus.arrow"
    write_corpus(corpus, SynthSpec(num_samples=120, seed=5, median_len=96, max_len=256,
                                   vocab_size=512, content="learnable"))  # fmt: skip
    shm = private_shm(root, "dflash-matrix")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_LOADER_SHM_DIR", str(shm))
        (root / "ref").mkdir()
        d = Supervised(corpus, root / "ref", shm)
        try:
            train(d.endpoint, root / "ref" / "run", root / "ref" / "t.log")
        finally:
            d.stop()
        ref = records(root / "ref" / "run")
        epoch1 = min(s for s, r in ref.items() if r.get("epoch") == 1 and s > 0)
        yield {"corpus": corpus, "shm": shm, "ref": ref, "epoch1": epoch1}
    shutil.rmtree(shm, ignore_errors=True)


def command(endpoint: str, run_dir: Path, *extra: str) -> list[str]:
    """One rank (no torchrun), two epochs, a checkpoint every 3 steps."""
    return [sys.executable, "-m", "trainer.cli", "train", "--endpoint", endpoint,
            "--job", "matrix", "--run-dir", str(run_dir), "--epochs", "2",
            "--ckpt-every", str(CKPT_EVERY), "--block-size", "8", "--anchors-per-doc", "16",
            "--token-budget", "1024", "--max-seq-len", "256", "--layout", "padded", "--lr", "3e-3",
            "--warmup", "2", "--num-eval-prompts", "0", "--timeout-s", "60",
            "--no-progress", *extra]  # fmt: skip


def train(endpoint: str, run_dir: Path, log: Path, *extra: str, fault: str | None = None) -> int:
    """Run the trainer to its end; its exit code (SIGKILL: -9)."""
    e = {**env(), **({ENV: fault} if fault else {})}
    with open(log, "ab") as f:
        res = subprocess.run(command(endpoint, run_dir, *extra), stdout=f,
                             stderr=subprocess.STDOUT, env=e, timeout=RUN_TIMEOUT_S)  # fmt: skip
    return res.returncode


def same_as_uninterrupted(job: dict, run_dir: Path) -> None:
    ref, got = job["ref"], records(run_dir)
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for s in sorted(ref):
        if "loss" in ref[s]:
            assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), s
            assert got[s]["epoch"] == ref[s]["epoch"] and got[s]["blocks"] == ref[s]["blocks"]
    assert (run_dir / "summary.json").exists()


@contextlib.contextmanager
def daemon(job: dict, tmp_path: Path, *faults: str | None) -> Iterator[Supervised]:
    d = Supervised(job["corpus"], tmp_path, job["shm"], *faults)
    try:
        yield d
    finally:
        d.stop()


# ----------------------------------------------------------------- a rank (the trainer)

#: (phase, fault) in the order one job meets them: each kill is followed by the resume.
RANK_FAULTS = [
    ("start (its session open, step 1 not trained)", "step=1"),
    ("mid-epoch", "step=5"),
    ("checkpoint write", f"checkpoint.write={3 * CKPT_EVERY}"),
    ("checkpoint publish", f"checkpoint.publish={4 * CKPT_EVERY}"),
    ("epoch boundary", "step=EPOCH1"),
]


def test_a_rank_killed_at_each_phase_resumes_to_the_uninterrupted_run(job, tmp_path):
    """One job killed five times, each time rerun with ``--resume``: at its start (session
    open, first batch in, step 1 not trained); mid-epoch; inside a checkpoint's write (its
    rank file written, the shared record not); with the manifest written and the folder not
    yet renamed; as it starts the first step of epoch 1. Each resume starts from the newest
    complete checkpoint (a torn one is skipped; none yet: a fresh start), and the whole is
    the uninterrupted run step for step."""
    run_dir, log = tmp_path / "run", tmp_path / "t.log"
    faults = [(p, f.replace("EPOCH1", str(job["epoch1"]))) for p, f in RANK_FAULTS]
    assert job["epoch1"] > 4 * CKPT_EVERY + 1  # the phases come in this order
    with daemon(job, tmp_path) as d:
        for k, (phase, fault) in enumerate(faults):
            resume = ("--resume",) if k else ()
            assert train(d.endpoint, run_dir, log, *resume, fault=fault) == -signal.SIGKILL, phase
            point, value = fault.split("=")
            assert f"kill -9 at {point}={value}" in log.read_text(), phase
            torn = run_dir / "checkpoints" / f"step-{int(value):08d}.tmp"
            assert torn.is_dir() == point.startswith("checkpoint"), phase  # left as killed
        assert train(d.endpoint, run_dir, log, "--resume") == 0, log.read_text()[-3000:]
        assert d.starts == 1  # the daemon was never restarted: nothing reloaded
    text = log.read_text().split("resumed from ")[1:]
    resumed = [int(x.split(" at step ")[1].split()[0]) for x in text]
    assert log.read_text().count("starting fresh") == 1  # the rerun after step=1
    killed_at = [int(f.split("=")[1]) for _, f in faults[1:]]
    newest = [(v - 1) // CKPT_EVERY * CKPT_EVERY for v in killed_at]  # the step's own: torn
    assert resumed == newest, (resumed, newest)
    same_as_uninterrupted(job, run_dir)


# ----------------------------------------------------------------- the daemon


def test_the_daemon_killed_at_each_phase_is_restarted_and_the_run_goes_on(job, tmp_path):
    """One run while its daemon is killed three times: as it plans the first epoch (the
    trainer's session just opened), mid-epoch (step 5), and as it plans epoch 1 ahead, at
    epoch 0's end; each time started again, as systemd does. The trainer waits for it
    (``--timeout-s``), resumes its session at the exact next batch, and never restarts."""
    run_dir, log = tmp_path / "run", tmp_path / "t.log"
    with daemon(job, tmp_path, "plan=0", None, "plan=1") as d:
        with open(log, "ab") as f:
            proc = subprocess.Popen(command(d.endpoint, run_dir), stdout=f,
                                    stderr=subprocess.STDOUT, env=env())  # fmt: skip
        try:
            wait_for_step(run_dir, 5, proc, log)
            assert d.starts == 2
            d.kill()
            assert proc.wait(RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
        finally:
            kill_tree(proc)
        assert d.starts == 4, d.logs()[-2000:]
        assert "kill -9 at plan=0" in d.logs() and "kill -9 at plan=1" in d.logs()
    same_as_uninterrupted(job, run_dir)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (run_dir / "metrics.jsonl").exists() or max(records(run_dir), default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def test_torchrun_s_agent_killed_takes_its_ranks_with_it(job, tmp_path):
    """kill -9 of the agent: its ranks die at once (they are tied to it), as when their
    node is lost; they do not train on as orphans beside the restarted job. The rerun with
    ``--resume`` then finishes as the uninterrupted run."""
    run_dir, log = tmp_path / "run", tmp_path / "t.log"
    agent_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "1", *command("ENDPOINT", run_dir)[1:]]  # fmt: skip
    with daemon(job, tmp_path) as d:
        agent_cmd[agent_cmd.index("ENDPOINT")] = d.endpoint
        with open(log, "ab") as f:
            agent = subprocess.Popen(agent_cmd, stdout=f, stderr=subprocess.STDOUT, env=env())
        try:
            wait_for_step(run_dir, 4, agent, log)
            (rank,) = children(agent.pid)
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
            deadline = time.monotonic() + 5
            while Path(f"/proc/{rank}").exists() and _state(rank) != "Z":
                assert time.monotonic() < deadline, "the rank outlived its agent"
                time.sleep(0.02)
        finally:
            kill_tree(agent)
        before = max(records(run_dir))
        assert before < max(job["ref"]), "the rank trained to the end as an orphan"
        assert train(d.endpoint, run_dir, log, "--resume") == 0, log.read_text()[-3000:]
    same_as_uninterrupted(job, run_dir)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
