"""The trainer against a real daemon across shape changes and epochs: a 2-rank job resumed
on 1 rank and then on 2 again, with a continuous LR schedule; ``--epochs`` runs that train
every step of every (freshly cut) epoch plan. Helpers: ``trainer_jobs``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import kill_tree
from trainer_jobs import RUN_TIMEOUT_S, daemon, env, records, run, small_daemon, train_cmd

pytestmark = [pytest.mark.integration, pytest.mark.heavy(18)]
__all__ = ["daemon", "small_daemon"]  # the fixtures (trainer_jobs)


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
    from trainer.train.clock import lr_factor

    factor = lr_factor("cosine", 2, steps)
    for s in range(1, end + 1):
        assert recs[s]["lr"] == pytest.approx(3e-3 * factor(micro[s - 1] / 2), rel=1e-9), s
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    import torch

    state = torch.load(last / "rank-00001.pt", weights_only=True)["loader"]
    assert state["world_size"] == 2 and state["legs"][:2] == [[2, 1, k1], [1, 1, k2 - k1]]


def test_a_lost_node_made_up_by_accumulation_trains_the_same_steps(daemon, tmp_path):
    """2 ranks x grad_accum 2, kill -9 after step 3, --resume on 1 rank x grad_accum 4 (the
    global batch kept, as DeepSpeed's elasticity keeps it): the rest of the epoch keeps its
    steps, re-dealt to the new rank's micro-batches, so with the step-normalized loss and
    per-document anchors the resumed run's losses are the uninterrupted run's, step for
    step (to float32 rounding: the sums run in another order)."""
    # AdamW: its update is fp32; the default Muon's goes through bf16 (torch's Newton-Schulz),
    # which rounds the sums' 2e-8 into ~2e-6 of the loss (docs/TRAINER.md, "One objective").
    steps = 8
    extra = ("--ckpt-every", "1", "--num-eval-prompts", "0", "--optimizer", "adamw",
             "--grad-accum", "2")  # fmt: skip
    run(train_cmd(daemon.endpoint, tmp_path / "whole", "w", steps, *extra), tmp_path / "w.log")
    cut = train_cmd(daemon.endpoint, tmp_path / "cut", "c", steps, *extra)
    _train_until(cut, tmp_path / "cut", tmp_path / "a.log", 3)
    one = [*cut[:4], "--nproc-per-node", "1", *cut[6:-2], "--grad-accum", "4", "--resume"]
    assert cut[-2:] == ["--grad-accum", "2"]
    run(one, tmp_path / "b.log")
    log = (tmp_path / "b.log").read_text()
    k = int(log.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert f"world_size 2 x grad_accum 2 -> 1 x 4 at epoch 0 step {k}" in log
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "cut")
    assert sorted(resumed) == sorted(whole) == list(range(steps + 1)) and k < steps
    for s in range(k + 1, steps + 1):
        a, b = whole[s], resumed[s]
        assert (a["tokens"], a["blocks"]) == (b["tokens"], b["blocks"]), s
        # Measured: 2.2e-8 relative at most (steps 4-8 after a kill at 3), grad norms 9e-8.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), s
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), s


def test_epochs_train_every_step_of_every_epoch(small_daemon, tmp_path):
    """Epoch plans are cut afresh, so their step counts differ by one or so: ``--epochs 3``
    trains exactly the steps of the three plans (not 3 x the first one's), with the final
    evaluation and checkpoint at the last."""
    from loader_server.data.dataset import open_dataset
    from loader_server.planning.planner import plan_epoch
    from loader_server.wire.spec import BatchSpec

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", small_daemon.endpoint,
           "--job", "epochs", "--run-dir", str(run_dir), "--epochs", "3", "--block-size", "8",
           "--anchors-per-doc", "16", "--token-budget", "4096", "--max-seq-len", "256",
           "--layout", "padded",  # packed rows fill every epoch to the same step count
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
