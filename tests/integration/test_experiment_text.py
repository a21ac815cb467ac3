"""A miniature of the batching experiment's learned-target part (``--corpus text``), end to
end: a Qwen3 trained here, replies regenerated through the chat stand-in, five specs
trained on it with tau, the forgetting probe and the paired comparison."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from loader_server.wire.spec import REFERENCE_BUCKETS

pytestmark = pytest.mark.heavy(60)  # seconds side by side; scheduled first (tests/conftest.py)


TEXT = [
    "--corpus", "text", "--target-steps", "100", "--target-layers", "1", "--target-hidden", "64",
    "--target-vocab", "512", "--target-seq-len", "256", "--target-lr", "0.01",
    "--target-threads", "1", "--prompts", "40", "--heldout-prompts", "16", "--tau-prompts", "4",
    "--max-reply-tokens", "32", "--steps", "6", "--grad-accum", "2", "--token-budget", "1024",
    "--max-len", "512", "--eval-every", "3", "--eval-new-tokens", "16", "--ckpt-every", "2",
    "--seeds", "5", "--humaneval", "3",
]  # fmt: skip


@pytest.mark.integration
def test_text_experiment_end_to_end(tmp_path):
    """A miniature of the learned-target experiment: the target trained here (into a cache
    under tmp_path), prompts regenerated through the chat server, the five text specs
    (the default) trained on the learned target with tau measured, the forgetting probe on
    every checkpoint, every spec paired with today's default."""
    out = tmp_path / "exp"
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "benchmarks.experiment", str(out), *TEXT]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    (target,) = (tmp_path / "cache" / "experiment-target").iterdir()
    facts = json.loads((target / "target.json").read_text())
    assert facts["heldout_loss"] < facts["uniform_loss"] - 1.0  # it learned the text
    assert (target / "tokenizer.json").is_file() and (target / "chat_template.jinja").is_file()
    tau_prompts = (out / "data" / "tau.jsonl").read_text().splitlines()
    assert len(tau_prompts) == 4 and all(json.loads(x)["prompt"] for x in tau_prompts)
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"sorted", "six", "stratified", "packed", "frozen"}
    for name, run in results["runs"].items():
        assert run["tau"]["step"] == [0, 3, 6], name
        assert all(1.0 <= t <= 8.0 for t in run["tau"]["tau"])  # 1 .. block size 8
        assert len(run["tau"]["tau_served"]) == 3 and "vllm" not in run
        f = run["forgetting"]
        assert f["steps"] == [2, 4, 6] and len(f["delta"]) == 2
        assert all(math.isfinite(x) and x > 0 for x in f["short_loss"])
        assert all(0.0 <= x <= 1.0 for x in f["long_only"])
        assert run["config"]["target"] == str(target)
        assert run["config"]["loader_spec"]["seed"] == 5, name  # the run's seed plans too
        w = run["weights"]  # the drafter's matrices, first checkpoint to last
        assert w["steps"] == [2, 6] and len(w["matrices"]) >= 2, name
        for m in w["matrices"].values():  # a run whose steps 3-6 held no anchor moved none
            assert m["stable_rank"] >= 1.0 - 1e-6 if m["relative"] > 0 else m["stable_rank"] == 0
        he = run["humaneval"]  # dflash-train eval on the run's final checkpoint
        assert he["prompts"] == 3 and he["step"] == 6 and 1.0 <= he["tau"] <= 8.0, name
        assert he["tau_ci"][0] <= he["tau"] <= he["tau_ci"][1]
    moved = [m["relative"] for m in results["runs"]["packed-s5"]["weights"]["matrices"].values()]
    assert min(moved) > 0  # packed rows train from the first step
    runs = results["runs"]
    equal = {r["at_equal_tokens"]["tokens"] for r in runs.values()}
    assert equal == {min(r["real_tokens"] for r in runs.values())}  # one seed, one point
    assert results["reference"] == "stratified"
    assert set(results["paired"]) == {"sorted", "six", "packed", "frozen"}
    for spec, p in results["paired"].items():
        # 6 steps can leave a run under 3 losses (steps with no anchor): no spikiness then,
        # and its pair is left out rather than the analysis failing.
        spiky = [runs[f"{s}-s5"]["spikiness"]["diff_std"] for s in (spec, "stratified")]
        assert ("diff_std" in p) == (None not in spiky), spec
        for k in (
            "heldout_all",
            "tau_final",
            "train_loss_at_equal_tokens",
            "humaneval_tau",
            *p.keys() & {"diff_std"},
        ):
            assert p[k]["n"] == 1 and p[k]["lo"] == p[k]["mean"] == p[k]["hi"]
            assert not p[k]["separates"]  # one seed separates nothing
    assert runs["packed-s5"]["config"]["loader_spec"]["layout"] == "packed"
    frozen = runs["frozen-s5"]["config"]["loader_spec"]
    assert frozen["composition"] == "sorted" and frozen["order"] == "sequential"
    grams = results["corpus"]["heldout_replies_distinct_4grams"]
    assert 0.0 < grams["mean"] <= 1.0 and grams["replies"] >= 4
    ref = results["corpus"]["heldout_references_distinct_4grams"]
    asked = len((out / "data" / "prompts-heldout.jsonl").read_text().splitlines())
    assert 0.75 * asked <= ref["replies"] <= asked  # a reply under 4 tokens has no 4-gram
    assert 0.5 < ref["mean"] <= 1.0  # real code rarely repeats 4 tokens
    kinds = results["corpus"]["heldout_looping_by_kind"]
    assert set(kinds) == {"function", "continuation"}  # every sample's prompt row was found
    held = results["corpus"]["heldout"]["samples"]
    assert sum(k["target"]["samples"] for k in kinds.values()) == grams["samples"] == held
    assert sum(k["reference"]["replies"] for k in kinds.values()) == ref["replies"]
    six = results["runs"]["six-s5"]["config"]["loader_spec"]["buckets"]
    assert six == [round(b * 512 / 8192) for b in REFERENCE_BUCKETS]  # scaled to max_len 512
    assert results["corpus"]["train"]["samples"] >= 15  # empty replies are skipped
    md = (out / "results.md").read_text()
    assert "tau final" in md and "6 hand-set buckets + shuffled" in md
    assert "ours, packed rows" in md and "sorted, batch order not shuffled" in md
    assert "Paired by seed (1), minus bucketed + stratified" in md and "4-grams distinct" in md
    assert "The text's own replies to the same prompts" in md
    assert "served, vLLM" in md and "not run" in md  # no --vllm-python
    assert "HumanEval tau" in md and (out / "humaneval" / "eval.md").is_file()
    assert "stable rank of the change" in md  # the weights moved, by spec
    for name in ("tau", "forgetting"):
        assert (out / f"experiment-{name}.png").read_bytes()[:4] == b"\x89PNG"
    # --data-only on the same settings reuses the target and the data, and says how they loop
    again = subprocess.run(
        [*cmd, "--data-only"], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "data made in" in again.stdout
    want = f"The target's held-out replies: {grams['mean']:.3f} of their 4-grams distinct"
    assert want in again.stdout and "The text's own replies to the same prompts" in again.stdout
    assert "Function prompts: the target" in again.stdout and "at the token limit" in again.stdout
    assert 0.0 <= grams["not_looping"] <= ref["not_looping"] <= 1.0
