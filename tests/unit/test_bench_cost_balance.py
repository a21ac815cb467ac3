"""The cost-balance benchmark's drift check: ``rank_coupling`` tells timing noise that is
independent per micro-batch (what its noise floor assumes) from drift a rank's
micro-batches share (what timing a rank's micro-batches one after another let in)."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.bench_cost_balance import rank_coupling


def test_independent_noise_couples_at_one_and_shared_drift_above_it():
    rng = np.random.default_rng(0)
    modelled = rng.uniform(0.2, 0.3, (400, 8, 4))
    jitter = np.exp(0.05 * rng.standard_normal(modelled.shape))
    assert abs(rank_coupling(modelled * jitter, modelled) - 1.0) < 0.1
    drift = np.exp(0.05 * rng.standard_normal((400, 8, 1)))  # one offset per rank and step
    assert rank_coupling(modelled * jitter * drift, modelled) > 3.0
    # A whole step slower (every rank alike) is not a rank's own: taken out.
    step = np.exp(0.3 * rng.standard_normal((400, 1, 1)))
    assert abs(rank_coupling(modelled * jitter * step, modelled) - 1.0) < 0.1


def test_rank_coupling_needs_two_micro_batches_a_rank():
    t = np.ones((5, 8, 1))
    assert math.isnan(rank_coupling(t, t))
