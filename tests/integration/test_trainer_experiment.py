"""The batching experiment: spikiness measures on hand-made loss series, the run commands,
and a tiny end-to-end run of ``python -m benchmarks.experiment`` (real daemon and trainers);
the learned-target miniature (``--corpus text``) is ``test_experiment_text.py``."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from benchmarks.experiment.analysis import (
    forgetting,
    frozen_features,
    heldout_loss,
    length_bands,
    pooled_diff_std,
    rolling_mean,
    spikiness,
)
from benchmarks.experiment.arms import SPECS
from benchmarks.experiment.config import ExperimentConfig
from benchmarks.experiment.report import _served_lines
from benchmarks.experiment.run import train_command
from benchmarks.experiment.served import acceptance
from benchmarks.experiment.target import TargetRecipe, continuations, function_tasks, split_of
from benchmarks.experiment.textdata import TextDataSpec, draw_prompts

pytestmark = pytest.mark.heavy(29)  # seconds side by side; scheduled first (tests/conftest.py)


# ---- spikiness ----------------------------------------------------------------------------


def test_flat_series_has_no_spikes():
    s = spikiness([2.0] * 10, threshold=0.1)
    assert s == {
        "num_steps": 10,
        "diff_std": 0.0,
        "max_jump": 0.0,
        "resid_std": 0.0,
        "spike_frac": 0.0,
    }


def test_alternating_series():
    # changes +1, -1, +1, -1: sample std sqrt(4/3); half of them are increases above 0.5
    s = spikiness([1.0, 2.0, 1.0, 2.0, 1.0], threshold=0.5)
    assert s["diff_std"] == pytest.approx(math.sqrt(4 / 3))
    assert s["max_jump"] == 1.0
    assert s["spike_frac"] == 0.5


def test_one_spike_on_a_falling_curve():
    loss = np.linspace(6.0, 4.0, 50)
    loss[30] += 0.8
    s = spikiness(loss, threshold=0.5)
    step = 2.0 / 49
    assert s["max_jump"] == pytest.approx(0.8 - step)  # the spike minus the descent
    assert s["spike_frac"] == pytest.approx(1 / 49)  # one of 49 changes
    smooth = spikiness(np.linspace(6.0, 4.0, 50), threshold=0.5)
    assert smooth["diff_std"] < 1e-12 and smooth["max_jump"] < 0
    assert s["diff_std"] > 0.1 and s["resid_std"] > 0.05


def test_no_threshold_no_spike_fraction():
    assert "spike_frac" not in spikiness([3.0, 2.0, 2.5])


@pytest.mark.parametrize("bad", [[1.0, float("nan"), 2.0], [[1.0, 2.0, 3.0]]])
def test_spikiness_rejects_bad_series(bad):
    with pytest.raises(ValueError):
        spikiness(bad)


@pytest.mark.parametrize("short", [[], [2.0], [2.0, 1.5]])
def test_spikiness_of_too_short_a_series_is_missing_not_an_error(short):
    """A short run whose steps held no anchor keeps its other measures: its spikiness is
    None throughout (left out of summaries and pairs), and so is a threshold pooled from
    fewer than two changes."""
    s = spikiness(short, threshold=0.5)
    assert s == {"num_steps": len(short), "diff_std": None, "max_jump": None,
                 "resid_std": None, "spike_frac": None}  # fmt: skip
    assert "spike_frac" not in spikiness(short)
    assert pooled_diff_std([short, [1.0]]) is None
    changes = [*np.diff(short), 1.0, 2.0]
    assert pooled_diff_std([short, [1.0, 2.0, 4.0]]) == pytest.approx(np.std(changes, ddof=1))


def test_pooled_diff_std_is_the_std_of_all_changes():
    a, b = [1.0, 3.0, 2.0], [0.0, 0.0, 1.0, 4.0]
    assert pooled_diff_std([a, b]) == pytest.approx(np.std([2, -1, 0, 1, 3], ddof=1))


def test_rolling_mean():
    assert np.allclose(rolling_mean(np.full(7, 3.0), 5), 3.0)
    x = np.arange(30, dtype=float)
    assert np.allclose(rolling_mean(x, 5)[2:-2], x[2:-2])  # exact on a line, inside
    assert rolling_mean(x, 5)[0] == pytest.approx(1.0)  # shrunk window: mean of 0, 1, 2


def test_length_bands_are_quartiles():
    band = length_bands(np.arange(1, 101))
    assert np.bincount(band).tolist() == [25, 25, 25, 25]
    assert band[:25].max() == 0 and band[-25:].min() == 3


def test_held_out_features_are_computed_once_and_score_exactly_as_the_target(target, monkeypatch):
    """frozen_features: the target runs once per held-out batch, however many drafters are
    scored, and every score equals the plain target's, bit for bit."""
    import torch
    from drafters import random_docs

    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.target import Target
    from trainer.train.batches import pad_batch

    batches = [(0, pad_batch(random_docs(3))), (1, pad_batch(random_docs(2, seed=1)))]
    cfg = LossConfig(block_size=4, anchors_per_doc=3)
    drafters = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        drafters.append(DFlashDrafter(DrafterConfig.from_target(
            target.config, num_target_layers=len(target.layer_ids), block_size=4,
            mask_token_id=511,
        )))  # fmt: skip
    memo = frozen_features(target)
    calls = []
    plain = Target.train_features

    def counted(self, *a, **k):  # the real forward, counted
        calls.append(1)
        return plain(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(Target, "train_features", counted)
        got = [heldout_loss(memo, d, batches, cfg) for d in (*drafters, drafters[0])]
    want = [heldout_loss(target, d, batches, cfg) for d in drafters]
    assert len(calls) == len(batches)  # not once per drafter
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[0]
    assert got[0]["loss_all"] != got[1]["loss_all"]  # two drafters: two scores


def test_forgetting_measures():
    # Checkpoints at 10..40; steps 21-30 held no short sample, the others did.
    all_hard = np.zeros(40)
    all_hard[20:30] = 1.0
    f = forgetting([10, 20, 30, 40], [3.0, 2.5, 2.7, 2.4], all_hard)
    assert f["long_only"] == [0.0, 1.0, 0.0]
    assert f["delta"] == pytest.approx([-0.5, 0.2, -0.3])
    assert f["long_intervals"] == 1 and f["rises_in_long"] == 1
    assert f["delta_long"] == pytest.approx(0.2) and f["delta_mixed"] == pytest.approx(-0.4)
    assert f["forgetting_corr"] > 0.9
    # A loss that keeps falling through the long-only interval shows no forgetting.
    calm = forgetting([10, 20, 30, 40], [3.0, 2.5, 2.4, 2.0], all_hard)
    assert calm["rises_in_long"] == 0 and calm["delta_long"] < 0
    # Nothing to correlate when every interval has the same long-only share.
    assert forgetting([0, 40], [3.0, 2.0], all_hard)["forgetting_corr"] is None


@pytest.mark.parametrize(
    "steps, losses, n",
    [([10], [1.0], 40), ([20, 10], [1.0, 2.0], 40), ([10, 20], [1.0], 40), ([10, 50], [1, 2], 40)],
)
def test_forgetting_rejects_bad_checkpoints(steps, losses, n):
    with pytest.raises(ValueError):
        forgetting(steps, losses, np.zeros(n))


# ---- the learned target's text ------------------------------------------------------------

SOURCE = '''"""A module."""


def add(a, b=1, *rest):
    """Add two numbers.

    More detail that is not asked for.
    """
    total = a + b
    for x in rest:
        total += x
    return total


class K:
    def method(self, x):
        """Twice x, as a method of a class, long enough to be kept as a task."""
        value = x * 2
        return value


def bare(x):
    return x
'''


def test_function_tasks_ask_for_documented_functions():
    tasks = list(function_tasks("mod.py", SOURCE))
    assert [line for _, line in tasks] == [4, 16]
    (ask, reply), _ = tasks[0]
    assert ask["role"] == "user" and reply["role"] == "assistant"
    assert (
        ask["content"]
        == "Write the Python function `add(a, b=1, *rest)` of `mod.py`: Add two numbers."
    )
    assert (
        reply["content"].startswith("def add(a, b=1, *rest):")
        and "return total" in reply["content"]
    )
    method = tasks[1][0][1]["content"]
    assert method.startswith("def method(self, x):\n")  # dedented out of its class
    assert list(function_tasks("broken.py", "def f(:\n")) == []


def test_continuations_are_consecutive_pieces():
    chats = list(continuations("mod.py", SOURCE, chunk_chars=80))
    assert len(chats) >= 3 and [i for _, i in chats] == list(range(len(chats)))
    replies = [chat[1]["content"] for chat, _ in chats]
    first = chats[0][0][0]["content"]
    piece0 = first.split("```python\n", 1)[1].removesuffix("```")
    assert piece0 + "".join(replies) == SOURCE  # pieces cut at line ends, nothing lost
    assert all(p.endswith("\n") for p in replies)


def test_text_splits_are_stable_and_sized():
    names = [f"pkg/mod{i}.py" for i in range(4000)]
    prompts = [n for n in names if split_of(n, 0.2) == "prompts"]
    assert 0.17 < len(prompts) / len(names) < 0.23
    assert prompts == [n for n in names if split_of(n, 0.2) == "prompts"]  # deterministic


def test_recipe_key_names_what_changes_the_target():
    base = TargetRecipe()
    assert base.key() == TargetRecipe(threads=1).key()  # threads do not change the result
    assert base.key() != TargetRecipe(steps=base.steps + 1).key()
    for bad in ({"hidden": 250}, {"vocab_size": 100}, {"prompt_share": 1.0}, {"steps": 0}):
        with pytest.raises(ValueError):
            TargetRecipe(**bad)


def test_drawn_prompts_are_disjoint_and_mixed():
    recipe = TargetRecipe()
    spec = TextDataSpec(train=300, heldout=60, tau=10, short_share=0.5)
    sets = draw_prompts(recipe, spec)
    assert len(sets["train"]) == 300 and len(sets["heldout"]) == 60
    texts = [r["messages"][0]["content"] for rows in sets.values() for r in rows]
    assert len(set(texts)) == len(texts)  # no prompt in two sets (or twice)
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1
               for rows in sets.values() for r in rows)  # fmt: skip
    continuation = sum(t.startswith("Continue this code") for t in texts)
    assert continuation == 180  # half of 360, the rest short questions
    assert sets == draw_prompts(recipe, spec)  # reproducible
    with pytest.raises(ValueError, match=r"function prompts, \d+ are asked for"):
        draw_prompts(recipe, TextDataSpec(train=100_000, heldout=8, tau=1))


# ---- run commands -------------------------------------------------------------------------


def test_specs_differ_only_in_their_spec_pairs(tmp_path):
    cfg = ExperimentConfig(out_dir=tmp_path, buckets="auto:8")
    cmds = {s: train_command(cfg, s, seed=3) for s in SPECS}

    def common(cmd: list[str]) -> list[str]:
        out, skip = [], False
        for arg in cmd:
            if skip:
                skip = False
            elif arg in ("--spec", "--job", "--run-dir"):
                skip = True
            else:
                out.append(arg)
        return out

    assert common(cmds["sorted"]) == common(cmds["shuffled"]) == common(cmds["stratified"])
    assert "--seed 3" in " ".join(cmds["sorted"]) and "--resume" in cmds["sorted"]

    def pairs(cmd: list[str]) -> list[str]:
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--spec"]

    # The plan's seed too; every spec names its layout (the default is packed).
    pad = ["seed=3", "layout=padded"]
    assert pairs(cmds["sorted"]) == [*pad, "composition=sorted"]
    assert pairs(cmds["six"]) == [*pad, "buckets=96,152,216,304,412", "order=shuffled"]
    assert pairs(cmds["shuffled"]) == [*pad, "buckets=auto:8", "order=shuffled"]
    assert pairs(cmds["stratified"]) == [*pad, "buckets=auto:8", "order=stratified"]
    assert pairs(cmds["packed"]) == ["seed=3", "layout=packed"]
    assert pairs(cmds["frozen"]) == [*pad, "composition=sorted", "order=sequential"]
    assert common(cmds["six"]) == common(cmds["sorted"])


def test_six_buckets_are_the_reference_bounds_scaled():
    assert (
        ExperimentConfig(out_dir=Path("x"), max_len=8192, token_budget=8192).six_buckets
        == "770,1216,1728,2432,3296"
    )
    assert ExperimentConfig(out_dir=Path("x"), max_len=1024).six_buckets == "96,152,216,304,412"


def test_text_runs_train_on_the_learned_target(tmp_path):
    cfg = ExperimentConfig(out_dir=tmp_path, corpus="text", eval_every=25, ckpt_every=10)
    # the original pipeline, its fix, ours padded and packed, and the worst case
    assert cfg.specs == ("sorted", "six", "stratified", "packed", "frozen")
    cmd = " ".join(train_command(cfg, "six", seed=0))
    assert f"--target {cfg.target_dir()}" in cmd and "--tiny-vocab" not in cmd
    assert f"--eval-prompts {tmp_path / 'data' / 'tau.jsonl'}" in cmd
    assert "--eval-every 25" in cmd and "--ckpt-every 10" in cmd
    fixed = cfg.fixed_part()
    assert "target" in fixed and "samples" not in fixed and "threads" not in fixed["target"]
    assert "target" not in ExperimentConfig(out_dir=tmp_path).fixed_part()


@pytest.mark.parametrize(
    "kw",
    [
        {"specs": ("sorted", "bogus")},
        {"seeds": (0, 0)},
        {"steps": 2},
        {"token_budget": 512, "max_len": 1024},
        {"burn_in": 1.0},
        {"corpus": "web"},
        {"jobs": 0},
        {"ckpt_every": -1},
        {"vllm_python": "/usr/bin/python3"},  # synthetic: a random target has no tau
        {"humaneval": 4},  # synthetic, the same
        {"corpus": "text", "humaneval": 165},  # the wheel has 164
        {"corpus": "text", "humaneval": -1},
    ],
)
def test_config_rejects_bad_values(tmp_path, kw):
    with pytest.raises(ValueError):
        ExperimentConfig(out_dir=tmp_path, **kw)


def test_humaneval_rows_are_read_by_run_name():
    from benchmarks.experiment.humaneval import parse_eval

    def row(drafter, set_="humaneval", engine="ours", tau=1.5):
        stats = {"tau": tau, "tau_ci": [tau - 0.1, tau + 0.1], "tau_pooled": tau,
                 "tau_served": tau}  # fmt: skip
        return {"drafter": drafter, "set": set_, "engine": engine, "prompts": 3, "stats": stats}

    doc = {"measurements": [row("packed-s0@300", tau=2.5), row("sorted-s0@300"),
                            row("sorted-s0@300", engine="vllm", tau=9.0),
                            row("sorted-s0@300", set_="gsm8k", tau=9.0)]}  # fmt: skip
    got = parse_eval(doc, ["packed-s0", "sorted-s0"])
    assert got["packed-s0"]["tau"] == 2.5 and got["packed-s0"]["step"] == 300
    assert got["sorted-s0"]["tau"] == 1.5  # not vLLM's row, not another set's
    with pytest.raises(ValueError, match="frozen-s0"):
        parse_eval(doc, ["packed-s0", "frozen-s0"])


# ---- vLLM's acceptance ---------------------------------------------------------------------


def _counters(drafts, accepted, per_pos):
    return {"drafts": float(drafts), "draft_tokens": 7.0 * drafts, "accepted": float(accepted),
            "per_pos": {p: float(n) for p, n in per_pos.items()}}  # fmt: skip


def test_vllm_acceptance_is_counted_between_two_reads():
    before = _counters(100, 40, {0: 30, 1: 10})
    after = _counters(178, 79, {0: 60, 1: 19, 2: 1})  # 78 drafts, 39 accepted
    got = acceptance(before, after)
    assert (got["drafts"], got["accepted"]) == (78, 39)
    assert got["per_pos"] == {0: 30, 1: 9, 2: 1}
    assert got["tau"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no drafts"):
        acceptance(before, before)


def test_served_lines_say_where_vllm_and_the_verifier_differ():
    def run(vllm, verifier):
        return {"vllm": {"tau": vllm, "drafts": 10}, "tau": {"tau_served": [1.0, verifier]}}

    results = {"runs": {"a-s0": run(1.5, 1.5), "b-s0": run(1.6, 1.7)}}
    (text,) = [x for x in _served_lines(results) if x]
    assert "2 drafters (20 drafts)" in text and "in 1 of 2" in text
    assert "b-s0 1.6000/1.7000" in text and "a-s0" not in text
    assert _served_lines({"runs": {"a-s0": {"tau": {}}}}) == []


def test_a_missing_vllm_python_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "exp"
    res = _experiment(out, "--corpus", "text", "--vllm-python", str(tmp_path / "no-python"))
    assert res.returncode != 0
    assert f"--vllm-python {tmp_path / 'no-python'}: no such interpreter" in res.stderr
    assert "serve_check.sh --venv-only" in res.stderr
    assert not (out / "data").exists()  # no target built, no data made


def test_data_only_makes_the_corpora_and_stops(tmp_path):
    out = tmp_path / "exp"
    res = _experiment(out, *TINY, "--data-only")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "data made in" in res.stdout
    for name in ("train.arrow", "heldout.arrow"):
        assert (out / name).exists()
    assert not (out / "runs").exists() and not (out / "logs").exists()  # no daemon, no run


# ---- end to end ---------------------------------------------------------------------------

TINY = [
    "--samples", "200", "--heldout-samples", "48", "--steps", "6", "--median-len", "64",
    "--min-len", "16", "--max-len", "256", "--token-budget", "512", "--buckets", "auto:4",
]  # fmt: skip


def _experiment(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "benchmarks.experiment", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)


def _processes_under(path: Path) -> list[int]:
    """Pids of live processes whose command line names ``path`` (the daemon, trainers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if str(path) in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def _stop_mid_run(out: Path, log: Path) -> None:
    """Start the tiny experiment, SIGTERM it once its first trainer logged a step: it exits
    143 and leaves no daemon or trainer behind."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.experiment", str(out), *TINY],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    try:
        metrics = out / "runs" / "sorted-s0" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no trainer step within 180 s"
            time.sleep(0.1)
        assert _processes_under(out)  # the daemon and a trainer run now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while (left := _processes_under(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running after SIGTERM: {left}"


@pytest.mark.integration
def test_tiny_experiment_end_to_end(tmp_path):
    """SIGTERM mid-run stops the daemon and every trainer; the same command then continues
    and finishes the experiment."""
    out = tmp_path / "exp"
    _stop_mid_run(out, tmp_path / "stopped.log")
    res = _experiment(out, *TINY)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"sorted", "shuffled", "stratified"}
    assert len(results["runs"]) == 3
    for run in results["runs"].values():
        sp = run["spikiness"]
        assert sp["num_steps"] == 6  # burn-in int(0.1 * 6) = 0 steps
        for k in ("diff_std", "max_jump", "resid_std", "spike_frac"):
            assert math.isfinite(sp[k]), (k, sp)
        held = run["heldout"]
        assert len(held["loss"]) == 4 and all(math.isfinite(x) and x > 0 for x in held["loss"])
        assert math.isfinite(held["loss_all"])
        assert 0.0 <= min(run["series"]["hard_frac"]) <= max(run["series"]["hard_frac"]) <= 1.0
    plan = {s: r["plan"] for s, r in ((r["spec"], r) for r in results["runs"].values())}
    assert plan["sorted"]["composition_repeat"] == 1.0  # frozen batches, by construction
    assert plan["shuffled"]["composition_repeat"] < 1.0
    assert len(results["corpus"]["bands"]) == 4
    assert 0.0 <= results["summary"]["stratified"]["all_hard_frac"]["mean"] <= 1.0
    for name in ("loss", "heldout", "jumps", "mix"):
        png = out / f"experiment-{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert "bucketed + stratified" in (out / "results.md").read_text()
    assert not list(Path("/dev/shm").glob(f"dflash-{_daemon_pid(out)}-*"))  # rings unlinked

    # Other settings in the same folder are refused before anything runs.
    res = _experiment(out, *TINY[:-2], "--buckets", "auto:3")
    assert res.returncode != 0 and "other settings (buckets)" in res.stderr


def _daemon_pid(out: Path) -> str:
    for line in (out / "logs" / "daemon.log").read_text().splitlines():
        if "READY endpoint=" in line:
            return line.split("pid=")[1].split()[0]
    raise AssertionError("no READY line")


def test_the_objective_arms_differ_only_in_their_trainer_flags(tmp_path):
    """Part 4's arms: packed with D-PACE or a steeper decay, and stratified and packed under
    the old objective, are their base spec's command with the objective's flags changed (and
    D-PACE from the N(0, 0.02) start); every spec names its start (PyTorch's, ``--init-std
    0``, which Parts 1-4 trained from, but that arm);
    every spec names its weighting (the position decay unless it is an arm: the trainer's
    default is D-PACE since Part 4, and a spec trains the same runs whatever the default);
    every run draws one anchor per token at most (as Parts 1-3), and names its optimizer."""
    from benchmarks.experiment.arms import DECAY, OLD_OBJECTIVE

    cfg = ExperimentConfig(out_dir=tmp_path, buckets="auto:8")
    cmd = {s: train_command(cfg, s, seed=2) for s in SPECS}

    def named(c: list[str]) -> list[str]:  # the run's own name left out
        return ["X" if i and c[i - 1] in ("--job", "--run-dir") else a for i, a in enumerate(c)]

    def without(c: list[str], flags: tuple[str, ...]) -> list[str]:
        c = named(c)
        at = next(i for i in range(len(c)) if c[i : i + len(flags)] == list(flags))
        return c[:at] + c[at + len(flags) :]

    base = {s: without(cmd[s], DECAY) for s in ("packed", "stratified")}
    assert without(cmd["packed-dpace"], ("--loss-weighting", "dpace")) == base["packed"]
    assert without(cmd["packed-gamma3"], (*DECAY, "--gamma", "3")) == base["packed"]
    start = {s: c[c.index("--init-std") + 1] for s, c in cmd.items()}
    assert start.pop("packed-dpace-init02") == start.pop("packed-dpace-init02-muon") == "0.02"
    for spec in [s for s in start if s.startswith("packed-dpace-init02-muon-lr1e-2")]:
        assert start.pop(spec) == "0.02"
    assert set(start.values()) == {"0"}
    assert without(cmd["packed-dpace-init02"], ("--init-std", "0.02")) == without(
        cmd["packed-dpace"], ("--init-std", "0")
    )
    assert without(cmd["packed-old"], (*DECAY, *OLD_OBJECTIVE)) == base["packed"]
    assert without(cmd["stratified-old"], (*DECAY, *OLD_OBJECTIVE)) == base["stratified"]
    issue71 = {  # D-PACE's divisor, speculators' optimizer and depths (issue 71)
        "packed-dpace-slots": ("--loss-divisor", "slots"),
        "packed-dpace-sequence": ("--loss-divisor", "sequence"),
        "packed-dpace-muon": ("--optimizer", "muon"),
        "packed-dpace-depth3": ("--drafter-layers", "3"),
        "packed-dpace-depth5": ("--drafter-layers", "5"),
    }
    for arm, flags in issue71.items():
        assert without(cmd[arm], flags) == named(cmd["packed-dpace"]), arm
    muon = ("--optimizer", "muon")
    assert without(cmd["packed-dpace-init02-muon"], muon) == named(cmd["packed-dpace-init02"])
    # each optimizer at its own rate (the experiment's --lr is 3e-3 by default)
    lr = named(cmd["packed-dpace"]).index("--lr") + 1
    rate = {s: c[lr] for s, c in cmd.items()}
    own = (
        "packed-dpace-lr1e-3",
        "packed-dpace-muon-lr1e-2",
        "packed-dpace-init02-muon-lr1e-2",
        "packed-dpace-init02-muon-lr1e-2-depth3",
        "packed-dpace-init02-muon-lr1e-2-depth5",
    )
    assert [rate.pop(s) for s in own] == ["1e-3", "1e-2", "1e-2", "1e-2", "1e-2"]
    assert set(rate.values()) == {str(cfg.lr)}

    def but_rate(c: list[str]) -> list[str]:
        return c[:lr] + c[lr + 1 :]

    base, init02 = named(cmd["packed-dpace"]), named(cmd["packed-dpace-init02"])
    assert but_rate(named(cmd["packed-dpace-lr1e-3"])) == but_rate(base)
    assert but_rate(without(cmd["packed-dpace-muon-lr1e-2"], muon)) == but_rate(base)
    assert but_rate(without(cmd["packed-dpace-init02-muon-lr1e-2"], muon)) == but_rate(init02)
    defaults = named(cmd["packed-dpace-init02-muon-lr1e-2"])  # the trainer's, since Part 8
    for depth in ("3", "5"):
        arm = cmd[f"packed-dpace-init02-muon-lr1e-2-depth{depth}"]
        assert without(arm, ("--drafter-layers", depth)) == defaults
    for spec, c in cmd.items():
        weighting = c[c.index("--loss-weighting") + 1]
        assert weighting == ("dpace" if spec.startswith("packed-dpace") else "decay"), spec
        assert c[c.index("--tokens-per-anchor") + 1] == "1", spec
        # AdamW unless the arm names Muon (the trainer's default since Part 8): the last wins
        said = [c[i + 1] for i, a in enumerate(c) if a == "--optimizer"]
        assert said[0] == "adamw" and said[-1] == ("muon" if "muon" in spec else "adamw"), spec


def test_the_wire_arms_are_packed_fed_by_vllm_in_their_dtype(tmp_path):
    """Precision on the wire (issue 69): ``packed-bf16`` and ``packed-fp8`` are ``packed``'s
    command but for the feed: the states from a vLLM server the run starts, in the arm's
    ``--states-dtype``, and no tau while training (the decoder is in the engine). Without
    the text corpus and vLLM's python they are refused before anything runs."""
    from benchmarks.experiment.arms import FEEDS

    vllm = str(tmp_path / "vllm-python")
    cfg = ExperimentConfig(out_dir=tmp_path, corpus="text", vllm_python=vllm)

    def flags(c: list[str]) -> dict[str, str]:
        named = {"--job", "--run-dir"}  # the run's own name left out
        return {a: b for a, b in itertools.pairwise(c) if a.startswith("--") and a not in named}

    packed = flags(train_command(cfg, "packed", seed=1))
    for spec, dtype in FEEDS.items():
        fed = flags(train_command(cfg, spec, seed=1))
        engine = {"--target-engine": "vllm", "--vllm-python": vllm, "--states-dtype": dtype}
        assert {k: fed.pop(k) for k in engine} == engine, spec
        tau = ("--eval-prompts", "--num-eval-prompts", "--eval-every", "--eval-new-tokens")
        assert fed == {k: v for k, v in packed.items() if k not in tau}, spec
    for bad in ({"corpus": "text"}, {}):
        with pytest.raises(ValueError, match=r"fed by vLLM: they need corpus='text' and vllm"):
            ExperimentConfig(out_dir=tmp_path, specs=("packed", "packed-fp8"), **bad)


def test_a_vllm_measure_is_reused_only_for_its_checkpoint_target_and_prompts(tmp_path):
    """The cache key (``served.measure_key``) follows the run's newest checkpoint (by its
    manifest), the target and the prompts; a result of another key is measured again."""
    from benchmarks.experiment.served import checkpoint_key, measure_key

    run, target = tmp_path / "run", tmp_path / "target"
    target.mkdir()
    (target / "target.json").write_text('{"steps": 1200}')

    def checkpoint(step: int, body: str) -> None:
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (run / "manifests").mkdir(exist_ok=True)
        (run / "manifests" / f"step-{step:08d}.json").write_text(body)

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint_key(run)
    checkpoint(300, '{"model.pt": "aa"}')
    key = measure_key(run, target, [[1, 2]], [[3]], 32)
    assert key == measure_key(run, target, [[1, 2]], [[3]], 32)
    assert key != measure_key(run, target, [[1, 2]], [[3]], 64)
    assert key != measure_key(run, target, [[1, 3]], [[3]], 32)
    (target / "target.json").write_text('{"steps": 2400}')
    other_target = measure_key(run, target, [[1, 2]], [[3]], 32)
    assert other_target != key
    (run / "manifests" / "step-00000300.json").write_text('{"model.pt": "bb"}')  # retrained
    assert measure_key(run, target, [[1, 2]], [[3]], 32) != other_target
    checkpoint(600, '{"model.pt": "bb"}')  # a newer checkpoint, same bytes: still another one
    assert checkpoint_key(run).startswith("step-00000600:")


def test_every_arm_is_one_entry_whose_contrasts_name_arms():
    """``ARMS`` is the one place an arm is written: its contrasts name arms that exist, no
    pair twice, every label its own; the report's names and colours come from it."""
    from benchmarks.experiment.arms import ARMS, CONTRASTS, color, label

    assert all(b in ARMS and a != b for a, b in CONTRASTS)
    assert len(set(CONTRASTS)) == len(CONTRASTS)
    assert len({arm.label for arm in ARMS.values()}) == len(ARMS)
    assert label("packed-dpace") == "ours, packed rows, D-PACE" and label("other") == "other"
    assert color("packed") == "tab:purple" and color("other") is None
