"""One objective, however a step is cut (docs/TRAINER.md): the gradient of one optimizer
step over the same 12 documents is the same whether the loader cut them as 1 rank x 1
micro-batch, 1 x 4 (micro-batches of 1 to 8 documents: very unequal block counts) or
2 ranks x 2 (gloo, DDP), padded or packed, under the decay and D-PACE weights: equal to
1e-10 relative in float64 and 1e-5 in float32, the logged loss too. The old
normalization (each micro-batch's mean alike) fails the same comparison."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import python_path

pytestmark = [pytest.mark.integration, pytest.mark.heavy(20)]
ROOT = Path(__file__).parents[2]
WORKER = ROOT / "tests" / "workers" / "step_gradient.py"
CUTS = ("1x1", "1x4", "2x2")
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


@pytest.fixture(scope="module")
def gradients(tmp_path_factory) -> Path:
    """Every cut's gradients: one process for the one-rank cuts, torchrun for 2 x 2."""
    out = tmp_path_factory.mktemp("step")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(ROOT)}
    one = [sys.executable, str(WORKER), str(out)]
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(WORKER), str(out)]  # fmt: skip
    for cmd in (one, two):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-4000:]
    return out


def _load(out: Path, layout: str, dtype: str, objective: str) -> dict[str, dict]:
    return {c: torch.load(out / f"{layout}-{dtype}-{objective}-{c}.pt") for c in CUTS}


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference over every gradient, relative to the largest gradient entry."""
    top = max(float(g.abs().max()) for g in a.values())
    return max(float((a[n] - b[n]).abs().max()) for n in a) / top


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_steps_gradient_does_not_depend_on_its_cut(gradients, layout, dtype, weighting):
    runs = _load(gradients, layout, dtype, f"step-{weighting}")
    whole = runs["1x1"]
    assert whole["blocks"] > 60  # every document trained (12 documents, 3 to 9 blocks each)
    for cut in ("1x4", "2x2"):
        assert runs[cut]["blocks"] == whole["blocks"], cut
        assert _gap(whole["grads"], runs[cut]["grads"]) <= TOLERANCE[dtype], cut
        assert runs[cut]["loss"] == pytest.approx(whole["loss"], rel=TOLERANCE[dtype]), cut


@pytest.mark.parametrize("divisor", ["slots", "sequence"])
def test_every_divisor_is_one_objective_however_the_step_is_cut(gradients, divisor):
    """``--loss-divisor slots`` and ``sequence`` (speculators' and the reference's) sum
    over the step's documents too: the cut moves nothing; and each is another objective
    than the weights' mean (its gradient differs by more than rounding)."""
    runs = _load(gradients, "packed", "float64", f"step-dpace-{divisor}")
    whole, weight = runs["1x1"], _load(gradients, "packed", "float64", "step-dpace")["1x1"]
    for cut in ("1x4", "2x2"):
        assert _gap(whole["grads"], runs[cut]["grads"]) <= TOLERANCE["float64"], cut
        assert runs[cut]["loss"] == pytest.approx(whole["loss"], rel=TOLERANCE["float64"]), cut
    assert _gap(whole["grads"], weight["grads"]) > 1e-3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_padded_and_packed_rows_of_the_same_documents_train_alike(gradients, dtype):
    padded = _load(gradients, "padded", dtype, "step-decay")["2x2"]
    packed = _load(gradients, "packed", dtype, "step-decay")["2x2"]
    assert _gap(padded["grads"], packed["grads"]) <= 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_old_normalization_depends_on_the_cut(gradients, layout):
    """Each micro-batch's mean alike: a block of a one-document micro-batch weighs several
    times one of eight short documents, so the gradient moves with the cut (by far more than
    any rounding), and one micro-batch is the step normalization exactly."""
    old = _load(gradients, layout, "float64", "micro-batch-decay")
    new = _load(gradients, layout, "float64", "step-decay")
    assert _gap(old["1x1"]["grads"], new["1x1"]["grads"]) <= 1e-12
    for cut in ("1x4", "2x2"):
        assert _gap(old["1x1"]["grads"], old[cut]["grads"]) > 0.1, cut


EMPTY_WORKER = ROOT / "tests" / "workers" / "empty_slots.py"


@pytest.fixture(scope="module")
def empty_slots(tmp_path_factory) -> Path:
    """Two ranks of a DFlash2 drafter through steps with micro-batches of anchors but no
    supervised slot (``tests/workers/empty_slots.py``): the records, under each
    normalization. A hang (DDP's collectives out of step) fails on the timeout."""
    out = tmp_path_factory.mktemp("empty")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(EMPTY_WORKER), str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.mark.parametrize("normalization", ["step", "micro-batch"])
def test_anchors_without_a_supervised_slot_train_nothing_and_stop_nothing(
    empty_slots, normalization
):
    """A micro-batch whose anchors predict no supervised token is a micro-batch without
    blocks: no NaN (under the old normalization its mean was 0/0), every parameter of a
    DFlash2 drafter (its selector included) still reaches DDP's all-reduce, so the next
    step runs; and a step without weight on any rank is not applied (AdamW's momentum and
    weight decay moved the weights before), its record saying so."""
    import json

    mixed, again, empty = json.loads((empty_slots / f"{normalization}.json").read_text())
    for rec in (mixed, again):
        assert rec["loss"] is not None and math.isfinite(rec["loss"])
        assert rec["grads_finite"] and not rec["skipped_nonfinite"] and not rec["skipped_empty"]
        assert rec["blocks"] > 0 and rec["moved"] > 0
    assert empty["blocks"] == 0 and empty["loss"] is None
    assert empty["skipped_empty"] == 1 and not empty["skipped_nonfinite"]
    assert empty["moved"] == 0.0
