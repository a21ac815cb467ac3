"""The trainer against a real daemon: 2-rank torchrun, and kill -9 + --resume equality.

Starts `dflash-loader serve` on ipc://<tmp_path>/loader.sock (rings in a private /dev/shm
folder), waits for its READY line, then runs `torchrun --standalone --nproc-per-node 2 -m
trainer.cli train` against it (``trainer_jobs``). All waits are bounded polls. Resumes on
another number of ranks and ``--epochs`` runs: ``test_trainer_elastic_resume.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from procs import children
from trainer_jobs import RUN_TIMEOUT_S, Daemon, daemon, env, private_shm, records, run, train_cmd

from loader_server.data.synth import SynthSpec, write_corpus

pytestmark = [pytest.mark.integration, pytest.mark.heavy(25)]
__all__ = ["daemon"]  # the fixture (trainer_jobs)


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
    # the same folder without --resume is refused, and its config.json still repeats the run
    config = (whole / "config.json").read_bytes()
    cmd = train_cmd(daemon.endpoint, whole, "whole", 2 * steps, *extra)
    again = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=RUN_TIMEOUT_S)
    assert again.returncode != 0 and "already has checkpoints" in again.stdout + again.stderr
    assert (whole / "config.json").read_bytes() == config

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
    shm = private_shm(tmp_path)
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
    rule = {"block_size": 8, "anchors_per_doc": 4, "tokens_per_anchor": 32, "max_anchors": 0}
    assert {k: served[k] for k in rule} == rule
    assert json.loads((run_dir / "config.json").read_text())["requested_loader_spec"] == rule
    assert '"token_budget": 512' in (tmp_path / "t.log").read_text()  # logged as served
    recs = records(run_dir)
    assert sorted(recs) == [0, 1, 2, 3]
    # Two micro-batches of at most 512 padded tokens, rows cut at 128, per step.
    assert all(0 < recs[s]["tokens"] <= 2 * 512 for s in (1, 2, 3))


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
