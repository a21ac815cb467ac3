"""Plan quality measures against brute-force definitions on small hand-made plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_server.planning import metrics
from loader_server.planning.planner import EpochPlan, plan_epoch
from loader_server.wire.spec import BatchSpec


def make_plan(
    batches: list[list[int]], lengths: np.ndarray, *, world_size: int = 1, grad_accum: int = 1
) -> EpochPlan:
    """A plan with the given micro-batches (flat, step-major order), padded costs."""
    spec = BatchSpec(world_size=world_size, grad_accum=grad_accum)
    ids = np.array([i for b in batches for i in b], np.int64)
    rows = np.array([len(b) for b in batches], np.int64)
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    lens = np.array([max(lengths[b]) for b in batches], np.int64)
    return EpochPlan(
        spec=spec,
        epoch=0,
        num_steps=len(batches) // spec.micro_per_step,
        sample_ids=ids,
        sample_lengths=lengths[ids].astype(np.int32),
        offsets=offsets,
        micro_lens=lens,
        micro_costs=(rows * lens).astype(np.float64),
        micro_buckets=np.zeros(len(batches), np.int32),
        bucket_bounds=np.array([8192]),
        stats={"padding_efficiency": float(lengths[ids].sum() / (rows * lens).sum())},
    )


def brute_repeat(a: list[list[int]], b: list[list[int]]) -> float:
    where = {i: k for k, batch in enumerate(b) for i in batch}
    pairs = [p for batch in a for p in itertools.combinations(batch, 2)]
    again = [p for p in pairs if p[0] in where and where[p[0]] == where.get(p[1])]
    return len(again) / len(pairs) if pairs else 0.0


@st.composite
def two_partitions(draw):
    n = draw(st.integers(2, 40))
    cuts_a = sorted(draw(st.sets(st.integers(1, n - 1), max_size=8)))
    perm = draw(st.permutations(range(n)))
    keep = draw(st.integers(1, n))
    cuts_b = sorted(draw(st.sets(st.integers(1, max(1, keep - 1)), max_size=8)) - {keep})
    a = [list(range(lo, hi)) for lo, hi in zip([0, *cuts_a], [*cuts_a, n], strict=True)]
    served_b = list(perm[:keep])
    b = [served_b[lo:hi] for lo, hi in zip([0, *cuts_b], [*cuts_b, keep], strict=True)]
    return a, [x for x in b if x]


@settings(max_examples=150, deadline=None)
@given(two_partitions())
def test_composition_repeat_matches_pair_counting(parts):
    a, b = parts
    lengths = np.arange(1, 41)
    got = metrics.composition_repeat(make_plan(a, lengths), make_plan(b, lengths))
    assert got == pytest.approx(brute_repeat(a, b))


def test_composition_repeat_extremes():
    lengths = np.full(8, 10)
    a = make_plan([[0, 1, 2, 3], [4, 5, 6, 7]], lengths)
    assert metrics.composition_repeat(a, a) == 1.0
    apart = make_plan([[0, 4], [1, 5], [2, 6], [3, 7]], lengths)
    assert metrics.composition_repeat(a, apart) == 0.0


def test_band_edges_split_tokens_evenly():
    x = np.repeat([10, 20, 40, 80], [40, 20, 10, 5])  # 400 tokens per length value
    np.testing.assert_array_equal(metrics.band_edges(x), [10, 20, 40])


def test_step_mix_distance_by_hand():
    lengths = np.array([10, 20, 30, 40, 10, 20, 30, 40, 10, 10, 10, 10], np.int64)
    edges = metrics.band_edges(lengths).tolist()
    # Two steps of 2 micro-batches each.
    batches = [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    plan = make_plan(batches, lengths, world_size=2)
    tokens = np.zeros((2, 4))
    for step, pair in enumerate([batches[:2], batches[2:]]):
        for i in (i for b in pair for i in b):
            band = sum(lengths[i] > e for e in edges)
            tokens[step, band] += lengths[i]
    np.testing.assert_array_equal(metrics.step_band_tokens(plan), tokens)
    epoch = tokens.sum(axis=0) / tokens.sum()
    want = np.mean([0.5 * np.abs(t / t.sum() - epoch).sum() for t in tokens])
    assert want > 0
    assert metrics.step_mix_distance(plan) == pytest.approx(want)
    same = make_plan([[0, 1], [2, 3], [4, 5], [6, 7]], lengths, world_size=2)
    assert metrics.step_mix_distance(same) == pytest.approx(0.0)


def test_rank_imbalance_by_hand():
    lengths = np.array([100, 100, 50, 100], np.int64)
    # world 2, grad_accum 1, two steps: costs (100, 100) then (50, 100).
    plan = make_plan([[0], [1], [2], [3]], lengths, world_size=2)
    assert metrics.rank_imbalance(plan) == pytest.approx((1.0 + 100 / 75) / 2)
    np.testing.assert_array_equal(metrics.rank_costs(plan), [[100, 100], [50, 100]])


def test_summarize_evaluate_and_table():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(300), 0.8, 3000), 1, 2048).astype(np.int32)
    spec = BatchSpec(token_budget=8192, max_seq_len=2048, world_size=4, buckets="auto:6")
    a, b = (plan_epoch(lengths, spec, epoch=e) for e in (0, 1))
    s = metrics.summarize(a, b)
    assert s["padding_efficiency"] == a.stats["padding_efficiency"]
    assert 0 <= s["composition_repeat"] < 0.2 and s["rank_imbalance"] >= 1.0
    rows = {name: metrics.evaluate(lengths, sp) for name, sp in metrics.baselines(spec).items()}
    assert list(rows) == ["this spec", "sorted (original)", "random", "reference 6 buckets"]
    assert rows["sorted (original)"]["composition_repeat"] == 1.0
    table = metrics.format_table(rows)
    assert len(table.splitlines()) == 5 and "efficiency" in table


def test_empty_plan_measures():
    plan = plan_epoch(np.zeros(0, np.int32), BatchSpec(), epoch=0)
    assert metrics.step_mix_distance(plan) == 0.0
    assert metrics.rank_imbalance(plan) == 1.0
    assert metrics.composition_repeat(plan, plan) == 0.0
