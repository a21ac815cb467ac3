"""The batching experiment: spikiness measures on hand-made loss series, the run commands,
and a tiny end-to-end run of ``python -m benchmarks.experiment`` (real daemon and trainers)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from benchmarks.experiment.analysis import length_bands, pooled_diff_std, rolling_mean, spikiness
from benchmarks.experiment.run import SPECS, ExperimentConfig, train_command

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


@pytest.mark.parametrize("bad", [[1.0, 2.0], [1.0, float("nan"), 2.0], [[1.0, 2.0, 3.0]]])
def test_spikiness_rejects_bad_series(bad):
    with pytest.raises(ValueError):
        spikiness(bad)


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

    assert pairs(cmds["sorted"]) == ["composition=sorted"]
    assert pairs(cmds["shuffled"]) == ["buckets=auto:8", "order=shuffled"]
    assert pairs(cmds["stratified"]) == ["buckets=auto:8", "order=stratified"]


@pytest.mark.parametrize(
    "kw",
    [
        {"specs": ("sorted", "bogus")},
        {"specs": ()},
        {"seeds": (0, 0)},
        {"steps": 2},
        {"token_budget": 512, "max_len": 1024},
        {"burn_in": 1.0},
    ],
)
def test_config_rejects_bad_values(tmp_path, kw):
    with pytest.raises(ValueError):
        ExperimentConfig(out_dir=tmp_path, **kw)


# ---- end to end ---------------------------------------------------------------------------

TINY = [
    "--samples", "200", "--heldout-samples", "48", "--steps", "6", "--median-len", "64",
    "--min-len", "16", "--max-len", "256", "--token-budget", "512", "--buckets", "auto:4",
]  # fmt: skip


def _experiment(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "benchmarks.experiment", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)


@pytest.mark.integration
def test_tiny_experiment_end_to_end(tmp_path):
    out = tmp_path / "exp"
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
