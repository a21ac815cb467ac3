"""Scheduling micro-batches into optimizer steps and ranks.

A step has ``world_size * grad_accum`` micro-batches; each rank runs exactly
``grad_accum`` of them (DDP needs the same number of backward passes everywhere). When
the micro-batch count is not a multiple of the step size, the remainder carrying the
fewest tokens (usually the partial last batches of buckets) is dropped and reported.

``shuffled``: a random permutation, cut into steps (what a bucketed sampler without a
scheduler does). Every step is ~8 length-homogeneous micro-batches in random order: on the
reference shape its step mix distance is ~0.24 with grad_accum 1.

``stratified``: systematic sampling by length. Sort micro-batches by their length L and cut
the sorted list into ``world_size`` strata of equal count; a *unit* takes one random
micro-batch from every stratum, so each unit (one micro-batch per rank) spans the whole
length range and each step gets its token-proportional quota of every length band: mix
distance 0.076 with grad_accum 1, 0.021 with 4 (before the balancing below).

Balance. With ``max_batch_size`` 64 and a 65536 budget, samples under ~1000 tokens fill a
micro-batch by rows, not tokens: ~12% of micro-batches cost 0.2-0.9 of the budget, the
rest 0.97 +- 0.02. One cheap micro-batch in a unit of 8 sets that step's imbalance to
~1.05-1.1 (grad_accum 1: each rank runs one micro-batch, nothing can even it out). So the
cheapest micro-batches (cost below a threshold theta) are grouped by cost into units of
their own (equal cost, one per rank) and only the rest are stratified. theta is the
smallest of 0, 0.1, ..., 1.0 x the median cost whose units average a max/mean cost ratio
within ``tolerance`` (0.04): on the reference shape theta = 0.6, giving imbalance ~1.04
and mix ~0.08 with grad_accum 1 (all cheap ones grouped: 1.02 and 0.15; none: 1.07 and
0.07). With grad_accum > 1 units are dealt to steps by the same systematic sampling over
their mean length, so cheap units spread over steps; ranks then get their micro-batches
by LPT in rounds (largest cost to the least loaded rank).

Ranks are relabeled at random in every step so no rank systematically gets the longest or
most expensive micro-batches.
"""

from __future__ import annotations

import math

import numpy as np

BALANCE_TOLERANCE = 0.04
_THETAS = np.linspace(0.0, 1.0, 11)


def drop_remainder(tokens: np.ndarray, step_size: int) -> np.ndarray:
    """Indices of micro-batches kept: all but the ``len % step_size`` with fewest tokens."""
    n = tokens.shape[0]
    r = n % step_size
    keep = np.ones(n, bool)
    keep[np.argsort(tokens, kind="stable")[:r]] = False
    return np.flatnonzero(keep)


def shuffled_steps(
    tokens: np.ndarray,
    costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """[num_steps, world_size*grad_accum] micro-batch indices in random order, rank-major."""
    width = world_size * grad_accum
    kept = drop_remainder(tokens, width)
    steps = kept[rng.permutation(kept.size)].reshape(-1, width)
    return assign_ranks(steps, costs, grad_accum, rng)


def stratified_steps(
    lens: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    rng: np.random.Generator,
    tolerance: float = BALANCE_TOLERANCE,
    match_costs: bool = False,
) -> np.ndarray:
    """[num_steps, world_size*grad_accum] micro-batch indices, rank-major within a step.

    ``match_costs``: a unit takes the micro-batches of equal cost rank in every length
    stratum instead of random ones (see ``_balanced_units``)."""
    kept = drop_remainder(tokens, world_size * grad_accum)
    units = _balanced_units(kept, lens, costs, world_size, rng, tolerance, match_costs)
    if grad_accum == 1:
        steps = units[rng.permutation(units.shape[0])]
    else:
        u = np.arange(units.shape[0])
        by_len = np.lexsort((rng.random(u.size), lens[units].mean(axis=1)))
        at = _deal(u[by_len], grad_accum, rng)
        steps = units[at].reshape(at.shape[0], world_size * grad_accum)
    return assign_ranks(steps, costs, grad_accum, rng)


def _balanced_units(
    kept: np.ndarray,
    lens: np.ndarray,
    costs: np.ndarray,
    world: int,
    rng: np.random.Generator,
    tolerance: float,
    match_costs: bool,
) -> np.ndarray:
    """[num_units, world]: cheap micro-batches grouped by cost, the rest stratified by L.

    With ``match_costs`` the stratified units are cost-matched: every length stratum is
    ordered by cost (random among equals) and unit j takes the j-th of each, so a unit
    still spans every length band while its micro-batches cost alike. Micro-batches cut
    by a cost budget cost 0.8-1.0 of it, the spread set by how many rows they hold, not by
    their length: random dealing leaves units ~1.06 apart, which the cheap-unit threshold
    could only fix by grouping most micro-batches by cost (step mix 0.2-0.5)."""
    if kept.size == 0 or world == 1:
        return kept.reshape(-1, world)
    by_len = kept[np.lexsort((rng.random(kept.size), lens[kept]))]
    by_cost = kept[np.argsort(costs[kept], kind="stable")]
    cost_rank = np.empty(costs.shape[0], np.int64)
    cost_rank[by_cost] = np.arange(kept.size)
    median = float(np.median(costs[kept]))
    units = kept.reshape(-1, world)
    for theta in _THETAS * median:
        n_cheap = int(np.searchsorted(costs[by_cost], theta)) // world * world
        mixed = by_len[cost_rank[by_len] >= n_cheap]  # still sorted by length
        dealt = _deal_matched(mixed, world, costs, rng) if match_costs else _deal(mixed, world, rng)
        units = np.concatenate([by_cost[:n_cheap].reshape(-1, world), dealt])
        if _mean_ratio(costs[units]) <= 1.0 + tolerance:
            break
    return units


def _mean_ratio(unit_costs: np.ndarray) -> float:
    """Mean over units of max / mean cost. Integer sums and ``math.fsum`` (exactly
    rounded) make the threshold decision identical on every machine."""
    world = unit_costs.shape[1]
    ratio = unit_costs.max(axis=1) * world / np.maximum(unit_costs.sum(axis=1), 1)
    return math.fsum(ratio.tolist()) / max(1, ratio.size)


def _deal(sorted_items: np.ndarray, groups: int, rng: np.random.Generator) -> np.ndarray:
    """[len/groups, groups]: cut the sorted items into ``groups`` strata of equal count;
    row j takes one random item of every stratum (systematic sampling)."""
    strata = sorted_items.reshape(groups, -1)
    return rng.permuted(strata, axis=1).T


def _deal_matched(
    sorted_items: np.ndarray, groups: int, costs: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """[len/groups, groups]: like ``_deal``, but row j takes the j-th cheapest item of
    every stratum."""
    strata = sorted_items.reshape(groups, -1)
    order = np.lexsort((rng.random(strata.shape), costs[strata]), axis=-1)
    return np.take_along_axis(strata, order, axis=1).T


def assign_ranks(
    steps: np.ndarray, costs: np.ndarray, grad_accum: int, rng: np.random.Generator
) -> np.ndarray:
    """Rearrange each step so it reads rank-major: ``out[s, r*grad_accum + g]``.

    LPT in rounds: round g hands the g-th largest ``world_size`` micro-batches out, largest
    to the rank with the least cost so far; then ranks are relabeled at random per step.
    """
    num_steps, width = steps.shape
    world = width // grad_accum
    c = costs[steps]
    by_cost = np.argsort(-c, axis=1, kind="stable")
    steps = np.take_along_axis(steps, by_cost, axis=1)
    c = np.take_along_axis(c, by_cost, axis=1)
    out = np.empty((num_steps, world, grad_accum), np.int64)
    load = np.zeros((num_steps, world), costs.dtype)
    rows = np.arange(num_steps)[:, None]
    for g in range(grad_accum):
        lightest = np.argsort(load, axis=1, kind="stable")
        chunk = slice(g * world, (g + 1) * world)
        out[rows, lightest, g] = steps[:, chunk]
        load[rows, lightest] += c[:, chunk]
    relabel = np.argsort(rng.random((num_steps, world)), axis=1)
    return out[rows, relabel].reshape(num_steps, width)
