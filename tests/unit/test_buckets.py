"""Optimal length buckets: the DP against brute force, bounds, auto K, assignment."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_server.planning import buckets as bk
from loader_server.wire.spec import BatchSpec


def brute_padding(lengths: np.ndarray, k: int) -> int:
    """Least padding with at most k buckets, trying every choice of bounds."""
    values = np.unique(lengths)
    best = None
    for r in range(1, min(k, values.size) + 1):
        for cut in itertools.combinations(values[:-1].tolist(), r - 1):
            bounds = np.array([*cut, values[-1]])
            pad = int((bounds[np.searchsorted(bounds, lengths)] - lengths).sum())
            best = pad if best is None else min(best, pad)
    assert best is not None
    return best


def padding_of(lengths: np.ndarray, bounds: np.ndarray) -> int:
    return int((bounds[bk.assign(lengths, bounds)] - lengths).sum())


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=14),
    st.integers(1, 5),
)
def test_dp_matches_brute_force(lengths, k):
    x = np.array(lengths)
    table = bk.solve(x, k)
    for kk in range(1, k + 1):
        want = brute_padding(x, kk)
        assert table.padding[kk - 1] == want
        bounds = table.bounds(kk)
        assert bounds.size <= kk and bounds[-1] == x.max()
        assert np.all(np.diff(bounds) > 0)
        assert padding_of(x, bounds) == want


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=300), st.integers(1, 12))
def test_bounds_realize_the_table_and_efficiency_rises(lengths, k):
    x = np.array(lengths)
    table = bk.solve(x, k)
    eff = table.efficiency()
    assert np.all(np.diff(eff) >= -1e-12) and eff[-1] <= 1.0
    for kk in range(1, k + 1):
        assert padding_of(x, table.bounds(kk)) == table.padding[kk - 1]
    if np.unique(x).size <= k:
        assert eff[-1] == 1.0


def test_efficiency_curve_on_a_lognormal_shape():
    rng = np.random.default_rng(0)
    x = np.clip(np.rint(rng.lognormal(np.log(1500), 0.8, 50_000)), 16, 8192).astype(np.int64)
    curve = bk.efficiency_curve(x, 32)
    assert curve.shape == (32,)
    assert 0.2 < curve[0] < 0.3 and curve[5] > 0.79 and curve[31] > 0.95


def test_stop_at_ends_the_table_at_the_target():
    x = np.arange(1, 1001)
    full = bk.solve(x, 64)
    short = bk.solve(x, 64, stop_at=0.9)
    k = full.smallest_k(0.9)
    assert short.max_k == k and short.efficiency()[-1] >= 0.9
    assert full.efficiency()[k - 2] < 0.9
    np.testing.assert_array_equal(short.bounds(k), full.bounds(k))


def test_resolve_bounds_for_each_form():
    x = np.array([10, 20, 20, 30, 400, 500])
    explicit = bk.resolve_bounds(x, BatchSpec(buckets=(25, 100), max_seq_len=512, token_budget=512))
    np.testing.assert_array_equal(explicit, [25, 100, 512])
    two = bk.resolve_bounds(x, BatchSpec(buckets="auto:2"))
    np.testing.assert_array_equal(two, bk.optimal_bounds(x, 2))
    assert two[-1] == 500
    many = np.repeat(x, 5000)  # enough micro-batches for every bucket auto wants
    auto = bk.resolve_bounds(many, BatchSpec(buckets="auto", target_efficiency=1.0))
    assert padding_of(many, auto) == 0
    empty = bk.resolve_bounds(np.zeros(0, np.int64), BatchSpec())
    np.testing.assert_array_equal(empty, [8192])


def test_auto_keeps_enough_micro_batches_per_bucket_on_small_corpora():
    spec = BatchSpec(buckets="auto", token_budget=2048, max_seq_len=512)
    small = np.random.default_rng(0).integers(16, 512, 200)  # ~53K tokens: ~26 micro-batches
    assert bk.auto_bucket_cap(small, spec) == 1
    assert bk.resolve_bounds(small, spec).size == 1
    big = np.random.default_rng(0).integers(16, 512, 50_000)
    cap = bk.auto_bucket_cap(big, spec)
    assert cap == min(64, int(big.sum() / 2048) // bk.MIN_MICRO_PER_BUCKET)
    bounds = bk.resolve_bounds(big, spec)
    assert 1 < bounds.size <= cap
    micro_per_bucket = np.bincount(bk.assign(big, bounds)) * big.mean() / 2048
    assert micro_per_bucket.min() >= bk.MIN_MICRO_PER_BUCKET / 4  # by tokens, roughly


def test_resolve_bounds_is_cached_but_returns_fresh_arrays():
    x = np.arange(1, 500)
    bk.clear_cache()
    a = bk.resolve_bounds(x, BatchSpec(buckets="auto:4"))
    a[0] = -1
    b = bk.resolve_bounds(x, BatchSpec(buckets="auto:4"))
    assert b[0] != -1


def test_assign_puts_a_length_in_the_first_bound_at_or_above_it():
    bounds = np.array([770, 1216, 8192])
    x = np.array([1, 770, 771, 1216, 1217, 8192])
    np.testing.assert_array_equal(bk.assign(x, bounds), [0, 0, 1, 1, 2, 2])
    assert bk.assign(np.zeros(0, np.int64), bounds).size == 0


def test_bad_inputs():
    with pytest.raises(ValueError, match="max_k"):
        bk.solve(np.array([1, 2]), 0)
    with pytest.raises(ValueError, match=">= 1"):
        bk.solve(np.array([0, 2]), 2)
    with pytest.raises(ValueError, match=r"k must be in 1\.\.3"):
        bk.solve(np.array([1, 2]), 3).bounds(4)
