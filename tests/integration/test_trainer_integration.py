"""The trainer against a real daemon: 2-rank torchrun, and kill -9 + --resume equality.

Starts `dflash-loader serve` on ipc://<tmp_path>/loader.sock (rings in a private /dev/shm
folder), waits for its READY line, then runs `torchrun --standalone --nproc-per-node 2 -m
trainer.cli train` against it. All waits are bounded polls.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from procs import children, kill_tree

from loader_server.data.synth import SynthSpec, write_corpus
from trainer.train.metrics import read_metrics

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 240.0


class Daemon:
    def __init__(self, dataset: Path, workdir: Path, shm_dir: Path, *flags: str) -> None:
        self.endpoint = f"ipc://{workdir}/loader.sock"
        self.log_path = workdir / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "loader_server", "serve", "--dataset", str(dataset)]
        cmd += ["--endpoint", self.endpoint, "--shm-dir", str(shm_dir), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
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


def _serve(spec: SynthSpec, tmp_path: Path, monkeypatch):
    corpus = tmp_path / "corpus.arrow"
    write_corpus(corpus, spec)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    shm = base / f"dflash-trainer-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
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


def test_kill_and_resume_matches_uninterrupted(daemon, tmp_path):
    """Two ranks train against the daemon (the uninterrupted run: every step recorded,
    the loss falls, checkpoints every 4 steps of both ranks' state); a run killed -9 and
    resumed records the same losses step for step."""
    steps, extra = 12, ("--ckpt-every", "4", "--grad-accum", "2")
    whole = tmp_path / "whole"
    run(train_cmd(daemon.endpoint, whole, "whole", steps, *extra), tmp_path / "whole.log")
    recs = records(whole)
    assert sorted(recs) == list(range(steps + 1))
    assert 1.0 <= recs[0]["tau"] <= 8.0 and 1.0 <= recs[steps]["tau"] <= 8.0  # B = 8
    losses = [recs[s]["loss"] for s in range(1, steps + 1)]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    assert all(0 <= recs[s]["data_wait_frac"] < 1 for s in range(1, steps + 1))
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == steps
    ckpts = sorted(p.name for p in (whole / "checkpoints").iterdir())
    assert ckpts == ["step-00000004", "step-00000008", "step-00000012"]
    assert {p.name for p in (whole / "checkpoints" / "step-00000012").iterdir()} == {
        "model.pt",
        "rank-00000.pt",
        "rank-00001.pt",
    }

    cut = tmp_path / "cut"
    log = open(tmp_path / "cut.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        train_cmd(daemon.endpoint, cut, "cut", steps, *extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env(),
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((cut / "metrics.jsonl").exists() and max(records(cut), default=0) >= 6):
            assert agent.poll() is None, (tmp_path / "cut.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "trainer made no progress"
            time.sleep(0.05)
        workers = children(agent.pid)
        assert len(workers) == 2
        os.kill(max(workers), signal.SIGKILL)  # kill -9 one trainer rank
        assert agent.wait(60) != 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        log.close()
    done_before = max(records(cut))
    assert done_before < steps

    run(train_cmd(daemon.endpoint, cut, "cut", steps, *extra, "--resume"), tmp_path / "res.log")
    a, b = records(whole), records(cut)
    assert sorted(b) == list(range(steps + 1))
    for s in range(1, steps + 1):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5), s
    assert b[steps]["tau"] == pytest.approx(a[steps]["tau"], rel=1e-6)
    # The daemon never reloaded its dataset: one process, one "opened" line.
    assert daemon.proc.poll() is None
    assert daemon.log().count("opened") == 1


def test_trainer_follows_the_daemons_spec(tmp_path, monkeypatch):
    """A trainer given no spec flags asks only for its anchor rule: the daemon's configured
    spec applies (here a small budget, short samples and 2 micro-batches per step), and the
    trainer logs and records the spec it was actually served, whose anchor-rule fields are
    what it trains (not the daemon's 16/512)."""
    corpus = tmp_path / "corpus.arrow"
    write_corpus(corpus, SynthSpec(num_samples=300, seed=5, median_len=150, max_len=400,
                                   vocab_size=512, content="learnable"))  # fmt: skip
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    shm = base / f"dflash-trainer-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.setenv("DFLASH_LOADER_SHM_DIR", str(shm))
    flags = ("--token-budget", "512", "--max-seq-len", "128", "--grad-accum", "2")
    d = Daemon(corpus, tmp_path, shm, *flags)
    run_dir = tmp_path / "run"
    try:
        cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", d.endpoint,
               "--run-dir", str(run_dir), "--steps", "3", "--block-size", "8",
               "--anchors-per-doc", "4", "--num-eval-prompts", "0", "--no-progress"]  # fmt: skip
        run(cmd, tmp_path / "t.log")
    finally:
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)
    served = json.loads((run_dir / "loader_spec.json").read_text())
    assert (served["token_budget"], served["max_seq_len"], served["grad_accum"]) == (512, 128, 2)
    rule = {"block_size": 8, "anchors_per_doc": 4, "max_anchors": 2048}
    assert {k: served[k] for k in rule} == rule
    assert json.loads((run_dir / "config.json").read_text())["requested_loader_spec"] == rule
    assert '"token_budget": 512' in (tmp_path / "t.log").read_text()  # logged as served
    recs = records(run_dir)
    assert sorted(recs) == [0, 1, 2, 3]
    # Two micro-batches of at most 512 padded tokens, rows cut at 128, per step.
    assert all(0 < recs[s]["tokens"] <= 2 * 512 for s in (1, 2, 3))


def _train_until(cmd: list[str], run_dir: Path, log: Path, step: int) -> None:
    """Run ``cmd`` (a torchrun job) until its metrics reach ``step``, then kill -9 the
    launcher and every rank (a node lost at once)."""
    with open(log, "wb") as f:
        agent = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env())
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while max(records(run_dir), default=0) < step:
                assert agent.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "trainer made no progress"
                time.sleep(0.05)
        finally:
            kill_tree(agent)  # a node lost at once


def test_a_job_resumes_on_fewer_then_more_ranks_with_a_continuous_schedule(daemon, tmp_path):
    """2 ranks, kill -9, --resume on 1 rank (the rest of the epoch planned for it), kill -9,
    --resume on 2 again: the steps continue, the LR follows the data consumed (no jump), and
    the run ends when the data of 16 two-rank steps is consumed."""
    run_dir, steps = tmp_path / "run", 16
    extra = ("--ckpt-every", "1", "--num-eval-prompts", "0")
    two = train_cmd(daemon.endpoint, run_dir, "el", steps, *extra)
    one = [*two[:4], "--nproc-per-node", "1", *two[6:], "--resume"]
    assert two[4:6] == ["--nproc-per-node", "2"]
    _train_until(two, run_dir, tmp_path / "a.log", 3)
    _train_until(one, run_dir, tmp_path / "b.log", max(records(run_dir)) + 3)
    run([*two, "--resume"], tmp_path / "c.log")

    def resumed_at(log: str) -> int:
        return int(log.split("resumed from ")[1].split(" at step ")[1].split()[0])

    b_log, c_log = (tmp_path / "b.log").read_text(), (tmp_path / "c.log").read_text()
    k1, k2 = resumed_at(b_log), resumed_at(c_log)
    assert f"world_size 2 x grad_accum 1 -> 1 x 1 at epoch 0 step {k1}" in b_log
    assert f"world_size 1 x grad_accum 1 -> 2 x 1 at epoch 0 step {k2 - k1}" in c_log
    # Steps under 2 ranks consume 2 micro-batches, under 1 rank one: the run ends when
    # 16 x 2 are consumed, and each step's LR is the schedule's at the data consumed so far.
    micro = [0]
    for s in range(1, 1000):
        micro.append(micro[-1] + (1 if k1 < s <= k2 else 2))
        if micro[-1] >= 2 * steps:
            break
    end = len(micro) - 1
    recs = records(run_dir)
    assert sorted(recs) == list(range(end + 1))
    from trainer.train.clock import warmup_cosine

    factor = warmup_cosine(2, steps)
    for s in range(1, end + 1):
        assert recs[s]["lr"] == pytest.approx(3e-3 * factor(micro[s - 1] / 2), rel=1e-9), s
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    import torch

    state = torch.load(last / "rank-00001.pt", weights_only=True)["loader"]
    assert state["world_size"] == 2 and state["legs"][:2] == [[2, 1, k1], [1, 1, k2 - k1]]


def test_epochs_train_every_step_of_every_epoch(small_daemon, tmp_path):
    """Epoch plans are cut afresh, so their step counts differ by one or so: ``--epochs 3``
    trains exactly the steps of the three plans (not 3 x the first one's), with the final
    evaluation and checkpoint at the last."""
    from loader_server.data.dataset import open_dataset
    from loader_server.planning.planner import plan_epoch
    from loader_server.planning.spec import BatchSpec

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", small_daemon.endpoint,
           "--job", "epochs", "--run-dir", str(run_dir), "--epochs", "3", "--block-size", "8",
           "--anchors-per-doc", "16", "--token-budget", "4096", "--max-seq-len", "256",
           "--num-eval-prompts", "2", "--eval-new-tokens", "8", "--no-progress"]  # fmt: skip
    run(cmd, tmp_path / "t.log")
    spec = BatchSpec.from_dict(json.loads((run_dir / "loader_spec.json").read_text()))
    lengths = open_dataset(tmp_path / "corpus.arrow").lengths
    per_epoch = [plan_epoch(lengths, spec, epoch=e).num_steps for e in range(3)]
    assert len(set(per_epoch)) > 1, per_epoch  # the case this test is about
    recs = records(run_dir)
    assert sorted(recs) == list(range(sum(per_epoch) + 1))
    assert recs[sum(per_epoch)]["epoch"] == 2 and "tau" in recs[sum(per_epoch)]
    assert (run_dir / "checkpoints" / f"step-{sum(per_epoch):08d}").is_dir()


def test_two_ranks_train_a_dflash2_drafter_and_export_it(daemon, tmp_path):
    """DFlash2 under DDP: the selector is used outside the drafter's forward (by the head),
    and its gradients are still all-reduced (both ranks end with the same weights, which
    the export's DFlash2 folder carries)."""
    run_dir = tmp_path / "run"
    flags = ("--drafter", "dflash2", "--selector-rank", "8", "--selector-top-k", "4",
             "--conv-group-size", "32", "--ckpt-every", "4")  # fmt: skip
    run(train_cmd(daemon.endpoint, run_dir, "d2", 4, *flags), tmp_path / "t.log")
    recs = records(run_dir)
    assert sorted(recs) == list(range(5)) and 1.0 <= recs[4]["tau"] <= 8.0
    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "trainer.cli", "export", str(run_dir), str(out), "--dtype", "fp32"]
    run(cmd, tmp_path / "e.log")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in config
    d2 = config["dflash_config"]
    assert (d2["selector_rank"], d2["selector_top_k"], d2["conv_group_size"]) == (8, 4, 32)
    assert (d2["conv_kernel_size"], d2["output_multiplier"]) == (2, 1.0)
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert weights["candidate_selector.predecessor_codebook"].shape == (512, 8)
    assert weights["layers.0.attention_conv.base_kernel"].shape == (2, 2, 128)
    assert weights["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 128)
    # The selector's gradients reached the optimizer through DDP: it left its initialisation
    # (the drafter as built from the run's seed).
    from trainer.model.drafter import DFlashDrafter, DrafterConfig

    ckpt = torch.load(run_dir / "checkpoints" / "step-00000004" / "model.pt", weights_only=False)
    torch.manual_seed(0)  # --seed's default
    fresh = DFlashDrafter(DrafterConfig(**ckpt["drafter_config"])).state_dict()
    for name in ("candidate_selector.successor_codebook", "layers.0.mlp_conv.base_kernel"):
        assert not torch.allclose(fresh[name], weights[name]), name
