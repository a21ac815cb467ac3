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

Modelled costs (a cost model on; the paths above stay as they are for token costs, whose
plans are pinned): units are cost-matched, a step's micro-batches go to ranks by
``balance_ranks`` (every split tried for small steps, else LPT and then swaps with the
most loaded rank), and theta is the one whose finished steps balance best while the step
mix distance stays within ``MIX_LIMIT`` (docs/PLANNER.md, "Modelled costs: ranks balanced
within the mix target"). On the reference shape with an 8B/H100 model: grad_accum 4
1.0175 -> 1.0015 (mix 0.039 -> 0.072), grad_accum 1 unchanged at 1.038 (one micro-batch
per rank: only the mix could buy more).

Long context (modelled costs): a 64K-token micro-batch costs ~6x one of 64 rows of 200
tokens (attention is quadratic in the document's length). Stratified units then put a
costly one next to cheap ones on every step, which waits ~3x for its slowest rank. So the
costliest micro-batches (above 8, 4, 2 or 1.5x the median cost; none on the reference
shape, whose plans are unchanged) are grouped by cost into units of their own too, and
when no threshold meets the balance target (``BALANCE_LIMIT``) within the mix target,
balance wins: the least mix among the plans that meet it, else the best balanced
(``_choose``). Shuffled steps (packed rows) likewise become steps of like-cost rows when
that balances better. Measured on 50,000 200-token and 200 64K-token samples
(``benchmarks/bench_long_context.py plan``): grad_accum 1 3.06 -> 1.06, grad_accum 4
1.19 -> 1.008, packed 1.38 -> 1.007 (each step then mixes fewer length bands).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from typing import cast

import numpy as np

BALANCE_TOLERANCE = 0.04
# Length bands of equal token mass that the step mix distance counts tokens in.
NUM_BANDS = 4
_THETAS = np.linspace(0.0, 1.0, 11)
# Modelled costs: the step mix distance a balancing threshold may reach (the plan target),
# or this much above the least mix any threshold gives.
MIX_LIMIT, MIX_SLACK = 0.10, 0.01
# Of the thresholds balanced within this of the best, the one of least step mix is taken.
BALANCE_SLACK = 0.002
# The rank imbalance target (1 + this): a plan that misses it within the mix limit is
# chosen by how far it misses both targets instead (``_choose``).
BALANCE_LIMIT = 0.05
# Costly micro-batches (above these multiples of the median cost) grouped into units of
# their own, as the cheap ones are: a corpus of 64K-token documents next to 200-token ones.
_COSTLY = (8.0, 4.0, 2.0, 1.5)
# Steps with at most this many splits into ranks are balanced exactly (every split tried).
_EXACT_SPLITS = 128
# At most this many rounds of trades per step (each round trades once in every step).
_MAX_SWAPS = 16


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
    modelled: bool = False,
    sequential: bool = False,
) -> np.ndarray:
    """[num_steps, world_size*grad_accum] micro-batch indices in random order, rank-major.
    ``modelled``: ranks by ``balance_ranks`` (else LPT in rounds). ``sequential``: in the
    order the batches were made instead (``order="sequential"``: with sorted batches the
    shortest steps first and the longest last, every epoch alike; an experiment's worst
    case, not a way to train)."""
    width = world_size * grad_accum
    kept = drop_remainder(tokens, width)
    steps = (kept if sequential else kept[rng.permutation(kept.size)]).reshape(-1, width)
    if sequential:  # ranks balanced, and not relabeled at random either
        return (
            _lpt(steps, costs, grad_accum)
            if not modelled
            else balance_ranks(steps, costs, grad_accum)
        )
    if not modelled:
        return _relabel(_lpt(steps, costs, grad_accum), world_size, rng)
    ranked = balance_ranks(steps, costs, grad_accum)
    if _balance(ranked, costs, world_size, grad_accum) > 1.0 + BALANCE_LIMIT:
        # Rows of unequal cost (a 64K-token document alone in its packed row, next to rows
        # of short ones): steps of like-cost micro-batches instead, in random order, when
        # they balance better (each step then mixes less).
        by_cost = kept[np.argsort(costs[kept], kind="stable")].reshape(-1, width)
        alike = balance_ranks(by_cost[rng.permutation(by_cost.shape[0])], costs, grad_accum)
        if _balance(alike, costs, world_size, grad_accum) < _balance(
            ranked, costs, world_size, grad_accum
        ):
            ranked = alike
    return _relabel(ranked, world_size, rng)


def stratified_steps(
    lens: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    rng: np.random.Generator,
    tolerance: float = BALANCE_TOLERANCE,
    modelled: bool = False,
    samples: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """[num_steps, world_size*grad_accum] micro-batch indices, rank-major within a step.

    ``modelled`` (costs from a cost model; ``samples`` is then ``(lengths, starts)``: the
    samples in micro-batch order and where each micro-batch begins, for the step mix):
    units are cost-matched (``_deal_matched``), each step's micro-batches go
    to ranks by ``balance_ranks``, and of the cheap-unit thresholds the one whose finished
    steps are best balanced is taken, among those whose step mix distance is within
    ``MIX_LIMIT`` (or ``MIX_SLACK`` above the least any threshold gives, when that is
    more). Otherwise (token costs: the default plans, which stay as they were) units take
    random micro-batches of each stratum, the threshold is the smallest whose units' own
    max/mean is within ``tolerance``, and ranks get LPT in rounds."""
    kept = drop_remainder(tokens, world_size * grad_accum)
    if not modelled:
        units = _token_units(kept, lens, costs, world_size, rng, tolerance)
        steps = _lpt(_compose(units, lens, grad_accum, rng), costs, grad_accum)
        return _relabel(steps, world_size, rng)
    if samples is None:
        raise ValueError("modelled balancing needs the micro-batches' samples (their bands)")
    bands = band_tokens(*samples, kept=kept)
    by_len, by_cost, cost_rank = _orders(kept, lens, costs, rng)
    cheap = list(_cheap_counts(costs[by_cost], world_size))
    # (cheap, costly) micro-batches grouped by cost; the costly tail only where there is
    # one (a corpus without one plans exactly as before: the same candidates, the same draws)
    groupings = [(n, 0) for n in cheap]
    groupings += [(n, k) for k in _costly_counts(costs[by_cost], world_size) for n in cheap]
    candidates = []
    for n_cheap, n_costly in groupings:
        if n_cheap + n_costly > kept.size:
            continue
        rank = cost_rank[by_len]
        mixed = by_len[(rank >= n_cheap) & (rank < kept.size - n_costly)]  # sorted by length
        units = np.concatenate(
            [
                by_cost[:n_cheap].reshape(-1, world_size),
                by_cost[kept.size - n_costly :].reshape(-1, world_size),
                _deal_matched(mixed, world_size, costs, rng),
            ]
        )
        steps = _compose(units, lens, grad_accum, rng)
        candidates.append((step_mix(bands, steps), steps))
    best = _choose(candidates, costs, world_size, grad_accum)
    return _relabel(best, world_size, rng)


def _choose(
    candidates: list[tuple[float, np.ndarray]], costs: np.ndarray, world: int, grad_accum: int
) -> np.ndarray:
    """The candidate steps (``(mix, steps)``) to serve, split into ranks: the best balanced
    whose step mix is within ``MIX_LIMIT`` (or ``MIX_SLACK`` above the least mix), of those
    within ``BALANCE_SLACK`` the least mix. When even that misses the balance target
    (imbalance above ``1 + BALANCE_LIMIT``: micro-batches whose costs differ by several
    times, as 64K-token documents next to 200-token ones), the balance target wins: of the
    candidates that meet it, the least mix; if none does, the best balanced. A step waits
    for its slowest rank: a 3x imbalance triples its time, whatever its mix."""
    limit = max(MIX_LIMIT, min(m for m, _ in candidates) + MIX_SLACK)
    scored = []
    for mix, steps in candidates:
        ranked = balance_ranks(steps, costs, grad_accum) if mix <= limit else None
        scored.append((_balance(ranked, costs, world, grad_accum), mix, steps, ranked))
    within = [x for x in scored if x[3] is not None]
    best_ratio = min(r for r, *_ in within)
    choice = min((x for x in within if x[0] <= best_ratio + BALANCE_SLACK), key=lambda x: x[1])
    if choice[0] <= 1.0 + BALANCE_LIMIT:
        return cast(np.ndarray, choice[3])
    for i, (_, mix, steps, ranked) in enumerate(scored):
        if ranked is None:
            ranked = balance_ranks(steps, costs, grad_accum)
            scored[i] = (_balance(ranked, costs, world, grad_accum), mix, steps, ranked)
    balanced = [x for x in scored if x[0] <= 1.0 + BALANCE_LIMIT]
    if balanced:
        return cast(np.ndarray, min(balanced, key=lambda x: x[1])[3])
    return cast(np.ndarray, min(scored, key=lambda x: x[0])[3])


def _balance(ranked: np.ndarray | None, costs: np.ndarray, world: int, grad_accum: int) -> float:
    """Mean over steps of max / mean rank load of ``ranked`` steps (inf: not split yet)."""
    if ranked is None:
        return math.inf
    return _mean_ratio(costs[ranked].reshape(-1, world, grad_accum).sum(axis=2))


def band_tokens(
    lengths: np.ndarray, starts: np.ndarray, kept: np.ndarray | None = None
) -> np.ndarray:
    """[num_micro, NUM_BANDS] int64: each micro-batch's tokens in each length band of equal
    token mass (``metrics.band_edges`` of the samples the plan serves: those of the
    ``kept`` micro-batches, default all). ``lengths``: the samples in micro-batch order;
    micro-batch m begins at ``starts[m]``."""
    x = np.asarray(lengths, np.int64)
    if starts.size == 0:
        return np.zeros((0, NUM_BANDS), np.int64)
    micro = np.repeat(np.arange(starts.size), np.diff(np.append(starts, x.size)))
    served = x
    if kept is not None:
        keep = np.zeros(starts.size, bool)
        keep[kept] = True
        served = x[keep[micro]]
    if served.size == 0:
        return np.zeros((starts.size, NUM_BANDS), np.int64)
    mass = np.cumsum(np.bincount(served) * np.arange(int(served.max()) + 1, dtype=np.int64))
    edges = np.searchsorted(mass, mass[-1] * np.arange(1, NUM_BANDS) / NUM_BANDS)
    band = np.searchsorted(edges, x, side="left")
    flat = np.bincount(micro * NUM_BANDS + band, weights=x, minlength=starts.size * NUM_BANDS)
    return flat.astype(np.int64).reshape(-1, NUM_BANDS)


def step_mix(bands: np.ndarray, steps: np.ndarray) -> float:
    """Step mix distance of ``steps`` (``metrics.step_mix_distance``) from each
    micro-batch's tokens per length band (``bands``: [num_micro, NUM_BANDS] integers).
    Integer sums, elementwise float operations and ``math.fsum``: the same value on every
    machine."""
    if steps.shape[0] == 0:
        return 0.0
    t = bands[steps].sum(axis=1)  # [steps, bands], exact
    total = t.sum(axis=0)
    epoch = total / max(int(total.sum()), 1)
    per_step = t / np.maximum(t.sum(axis=1, keepdims=True), 1)
    dist = np.abs(per_step[:, 0] - epoch[0])
    for b in range(1, t.shape[1]):
        dist = dist + np.abs(per_step[:, b] - epoch[b])
    return 0.5 * math.fsum(dist.tolist()) / steps.shape[0]


def _orders(
    kept: np.ndarray, lens: np.ndarray, costs: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``kept`` by length (random among equals), by cost, and each one's cost rank."""
    by_len = kept[np.lexsort((rng.random(kept.size), lens[kept]))]
    by_cost = kept[np.argsort(costs[kept], kind="stable")]
    cost_rank = np.empty(costs.shape[0], np.int64)
    cost_rank[by_cost] = np.arange(kept.size)
    return by_len, by_cost, cost_rank


def _cheap_counts(sorted_costs: np.ndarray, world: int) -> Iterator[int]:
    """How many of the cheapest micro-batches to group by cost, for each threshold theta
    of ``_THETAS`` x the median cost (whole units; each count once)."""
    if sorted_costs.size == 0:
        yield 0
        return
    median = float(np.median(sorted_costs))
    seen = -1
    for theta in _THETAS * median:
        n = int(np.searchsorted(sorted_costs, theta)) // world * world
        if n != seen:
            seen = n
            yield n


def _costly_counts(sorted_costs: np.ndarray, world: int) -> Iterator[int]:
    """How many of the costliest micro-batches to group by cost: those above each of
    ``_COSTLY`` x the median cost (whole units, each count once, none of 0). Empty
    where nothing costs 1.5x the median (the reference shape: full micro-batches cost
    alike)."""
    if sorted_costs.size == 0:
        return
    median = float(np.median(sorted_costs))
    seen = 0
    for factor in _COSTLY:
        above = sorted_costs.size - int(np.searchsorted(sorted_costs, factor * median, "right"))
        n = above // world * world
        if n != seen:
            seen = n
            yield n


def _token_units(
    kept: np.ndarray,
    lens: np.ndarray,
    costs: np.ndarray,
    world: int,
    rng: np.random.Generator,
    tolerance: float,
) -> np.ndarray:
    """[num_units, world]: cheap micro-batches grouped by cost, the rest stratified by L
    (one random micro-batch of every stratum), the threshold judged by the units' own
    max/mean. The default plans' scheduler, unchanged (their bytes are pinned)."""
    if kept.size == 0 or world == 1:
        return kept.reshape(-1, world)
    by_len, by_cost, cost_rank = _orders(kept, lens, costs, rng)
    median = float(np.median(costs[kept]))
    units = kept.reshape(-1, world)
    for theta in _THETAS * median:
        n_cheap = int(np.searchsorted(costs[by_cost], theta)) // world * world
        mixed = by_len[cost_rank[by_len] >= n_cheap]  # still sorted by length
        units = np.concatenate([by_cost[:n_cheap].reshape(-1, world), _deal(mixed, world, rng)])
        if _mean_ratio(costs[units]) <= 1.0 + tolerance:
            break
    return units


def _compose(
    units: np.ndarray, lens: np.ndarray, grad_accum: int, rng: np.random.Generator
) -> np.ndarray:
    """[num_steps, world*grad_accum]: ``grad_accum`` units per step, dealt by the same
    systematic sampling over their mean length (so cheap units spread over steps); in
    random order when a step is one unit."""
    if grad_accum == 1:
        return units[rng.permutation(units.shape[0])]
    u = np.arange(units.shape[0])
    by_len = np.lexsort((rng.random(u.size), lens[units].mean(axis=1)))
    at = _deal(u[by_len], grad_accum, rng)
    return units[at].reshape(at.shape[0], units.shape[1] * grad_accum)


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
    """Each step rank-major (``out[s, r*grad_accum + g]``) by ``balance_ranks``, ranks
    relabeled at random per step."""
    return _relabel(balance_ranks(steps, costs, grad_accum), steps.shape[1] // grad_accum, rng)


def balance_ranks(steps: np.ndarray, costs: np.ndarray, grad_accum: int) -> np.ndarray:
    """Each step's micro-batches to ranks, ``grad_accum`` each, least max rank load first:
    rank-major ``out[s, r*grad_accum + g]``. ``costs`` are integers (exact sums).

    Exact when a step has few ways to split (``_EXACT_SPLITS``: 2 ranks x up to 5, 3 x 2,
    4 x 2): every split is tried. Beyond, LPT in rounds and then swaps: while some
    micro-batch of the most loaded rank can trade places with one of another rank so
    that the larger of the two loads falls, the best such trade is made (each one lowers
    the sum of squared loads, so this ends; all steps at once, vectorized)."""
    num_steps, width = steps.shape
    world = width // grad_accum
    if grad_accum == 1 or world == 1 or num_steps == 0:
        return _lpt(steps, costs, grad_accum)
    splits = _splits(world, grad_accum)
    if splits is not None:
        return _exact(steps, costs, splits)
    return _swap(_lpt(steps, costs, grad_accum).reshape(num_steps, world, grad_accum), costs)


def _lpt(steps: np.ndarray, costs: np.ndarray, grad_accum: int) -> np.ndarray:
    """LPT in rounds: round g hands out the g-th largest ``world`` micro-batches, largest
    to the rank with the least cost so far. Rank-major ``[num_steps, width]``."""
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
    return out.reshape(num_steps, width)


def _relabel(ranked: np.ndarray, world: int, rng: np.random.Generator) -> np.ndarray:
    """Ranks relabeled at random per step, so no rank systematically gets the longest or
    costliest micro-batches."""
    num_steps, width = ranked.shape
    out = ranked.reshape(num_steps, world, width // world)
    relabel = np.argsort(rng.random((num_steps, world)), axis=1)
    return out[np.arange(num_steps)[:, None], relabel].reshape(num_steps, width)


@functools.cache
def _splits(world: int, grad_accum: int) -> np.ndarray | None:
    """Every split of ``world*grad_accum`` positions into ``world`` unordered groups of
    ``grad_accum``, as [splits, world, grad_accum]; None when there are more than
    ``_EXACT_SPLITS``."""
    n = world * grad_accum
    count = math.factorial(n) // (math.factorial(grad_accum) ** world * math.factorial(world))
    if count > _EXACT_SPLITS:
        return None

    def build(rest: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
        if not rest:
            return [[]]
        first, others = rest[0], rest[1:]
        out = []
        for mates in itertools.combinations(others, grad_accum - 1):
            left = tuple(x for x in others if x not in mates)
            out += [[(first, *mates), *tail] for tail in build(left)]
        return out

    return np.array(build(tuple(range(n))), np.int64)


def _exact(steps: np.ndarray, costs: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """The split of least max rank load for every step (the first such, in ``splits``
    order), in chunks of steps that keep the [steps, splits, world] loads small."""
    num_steps, width = steps.shape
    c = costs[steps]
    best = np.empty(num_steps, np.int64)
    chunk = max(1, (1 << 22) // splits.size)
    for a in range(0, num_steps, chunk):
        loads = c[a : a + chunk][:, splits].sum(axis=3)  # [chunk, splits, world]
        best[a : a + chunk] = loads.max(axis=2).argmin(axis=1)
    return np.take_along_axis(steps, splits[best].reshape(num_steps, width), axis=1)


def _swap(out: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Improve [steps, world, grad_accum] by single trades with the most loaded rank (see
    ``balance_ranks``). Rank-major ``[num_steps, width]``."""
    num_steps, world, accum = out.shape
    active = np.arange(num_steps)
    for _ in range(_MAX_SWAPS):
        if active.size == 0:
            break
        c = costs[out[active]]  # [a, world, accum]
        load = c.sum(axis=2)
        rows = np.arange(active.size)
        top = load.argmax(axis=1)
        high = load[rows, top][:, None, None, None]
        d = c[rows, top][:, :, None, None] - c[:, None, :, :]  # its item i for rank w's j
        larger = np.maximum(high - d, load[:, None, :, None] + d)
        gain = np.where(d > 0, high - larger, 0).reshape(active.size, -1)
        pick = gain.argmax(axis=1)
        ok = gain[rows, pick] > 0
        i, w, j = np.unravel_index(pick[ok], (accum, world, accum))
        s, h = active[ok], top[ok]
        mine = out[s, h, i]
        out[s, h, i] = out[s, w, j]
        out[s, w, j] = mine
        active = s
    return out.reshape(num_steps, world * accum)
