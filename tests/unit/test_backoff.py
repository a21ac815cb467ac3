"""The client's reconnect waits: jittered exponential backoff."""

from __future__ import annotations

import random
import statistics

import pytest

from client import backoff as B


def waits(count: int, seed: int = 0, **kw) -> list[float]:
    b = B.Backoff(draw=random.Random(seed).random, **kw)
    return [b.next_wait() for _ in range(count)]


def nominal(k: int) -> float:
    """The k-th wait before jitter, with the module's constants."""
    return min(B.CAP_S, B.INITIAL_S * B.FACTOR**k)


def test_without_jitter_waits_grow_by_the_factor_up_to_the_cap():
    assert waits(7, jitter=0) == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    assert waits(4, jitter=0, initial_s=1, factor=3, cap_s=10) == [1, 3, 9, 10]


@pytest.mark.parametrize("seed", range(20))
def test_each_wait_lies_within_its_jitter_band(seed):
    for k, w in enumerate(waits(12, seed)):
        assert (1 - B.JITTER) * nominal(k) <= w <= nominal(k)


def test_a_long_outage_stays_at_the_cap():
    """Thousands of attempts: no overflow, and never a wait above the cap."""
    many = waits(5000)
    assert max(many) <= B.CAP_S
    assert min(many[-100:]) >= (1 - B.JITTER) * B.CAP_S


def test_jitter_spreads_ranks_that_lost_the_daemon_together():
    first = [waits(1, seed)[0] for seed in range(2000)]
    low, high = (1 - B.JITTER) * B.INITIAL_S, B.INITIAL_S
    assert min(first) < low + 0.05 * (high - low)
    assert max(first) > high - 0.05 * (high - low)
    # Uniform over the band: its mean is the middle, its deviation width / sqrt(12).
    assert statistics.mean(first) == pytest.approx((low + high) / 2, rel=0.02)
    assert statistics.stdev(first) == pytest.approx((high - low) / 12**0.5, rel=0.05)


def test_a_seed_gives_a_repeatable_sequence():
    assert waits(10, seed=7) == waits(10, seed=7)
    assert waits(10, seed=7) != waits(10, seed=8)


def test_the_extremes_of_a_draw_are_the_ends_of_the_band():
    assert B.Backoff(draw=lambda: 0.0).next_wait() == B.INITIAL_S
    top = B.Backoff(draw=lambda: 1.0).next_wait()
    assert top == pytest.approx((1 - B.JITTER) * B.INITIAL_S)


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        ({"initial_s": 0}, "initial_s"),
        ({"initial_s": 3, "cap_s": 2}, "initial_s <= cap_s"),
        ({"factor": 0.5}, "factor"),
        ({"jitter": 1.5}, "jitter"),
    ],
)
def test_nonsense_parameters_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        B.Backoff(**kw)
