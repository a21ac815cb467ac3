"""Epoch plans: ``plan_epoch(lengths, spec, epoch=e)`` -> every micro-batch of the epoch.

A plan is a pure, deterministic function of (lengths, spec, epoch): every random choice
comes from ``np.random.default_rng([seed, epoch, purpose, ...])``, never from Python's
``hash`` or global state, so any process on any machine computes the same plan and a
restarted trainer can ask for exactly the micro-batch it stopped at.

Steps (padded layout, ``composition="bucketed"``):

1. Effective lengths ``min(len, max_seq_len)``; empty samples and (``overlong="drop"``)
   overlong ones leave the epoch and are counted.
2. Buckets: explicit bounds, or the optimal ones of ``loader_server.planning.buckets`` (exact DP).
3. Shuffle inside each bucket with ``rng(seed, epoch, bucket)`` and cut each bucket into
   greedy micro-batches under the token budget and ``max_batch_size``
   (``loader_server.planning.packing``, exact greedy, vectorized).
4. Drop the remainder that cannot fill a last step, order micro-batches into steps
   (stratified by length in cost-balanced units, or shuffled) and deal each step's
   micro-batches to ranks balancing cost (``loader_server.planning.schedule``).

``composition="sorted"`` is the original flaw: one stable global length sort, greedy
batches (identical every epoch), only their order shuffled per epoch. ``"random"``:
one full shuffle, greedy batches, shuffled order. ``layout="packed"``: rows of up to
``token_budget`` from randomly drawn samples (windowed worst-fit/first-fit decreasing,
``loader_server.planning.packing``), in shuffled order.

The result is flat numpy (CSR): ``sample_ids`` grouped by micro-batch, micro-batches in
(step, rank, micro) order, so ``plan.micro(step, rank, micro)`` is an O(1) slice.
On the reference shape (902K samples, 8 ranks) a padded plan takes ~0.14 s, ~0.25 s for
the first epoch when the "auto" bucket DP runs (cached by length histogram after that);
a packed plan ~0.27 s (docs/PLANNER.md has the measured table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loader_server.planning import buckets as bk
from loader_server.planning import cost, packing, schedule
from loader_server.wire.layouts import PACKED, PADDED, layout
from loader_server.wire.spec import BatchSpec

# Third element of every RNG seed: what the randomness is for.
_RNG_BUCKET, _RNG_FULL, _RNG_ORDER, _RNG_PACKED = 1, 2, 3, 4
# The rest of an epoch after a shape change (``leg`` k > 0) draws from
# ``[seed, epoch, _RNG_LEG, k, purpose, ...]``: never a seed of a whole epoch's plan.
_RNG_LEG = 5
# Resolution of modelled costs in the scheduler's integer arithmetic (the costliest
# micro-batch's cost): fine enough that rounding never decides a balance.
_COST_UNITS = 2**20


@dataclass(frozen=True, kw_only=True, eq=False)
class EpochPlan:
    """All micro-batches of one epoch, flat.

    Micro-batch ``m = (step*world_size + rank)*grad_accum + micro`` holds
    ``sample_ids[offsets[m]:offsets[m+1]]`` (row order) whose effective lengths are the
    same slice of ``sample_lengths``. ``micro_lens[m]`` is the padded length L (padded
    layout) or the packed row's token count T (packed); ``micro_costs[m]`` its cost under
    the spec's cost model; ``micro_buckets[m]`` its bucket (0 for sorted, random and
    packed plans). ``bucket_bounds`` are the upper bounds of the buckets used.
    """

    spec: BatchSpec
    epoch: int
    num_steps: int
    sample_ids: np.ndarray
    sample_lengths: np.ndarray
    offsets: np.ndarray
    micro_lens: np.ndarray
    micro_costs: np.ndarray
    micro_buckets: np.ndarray
    bucket_bounds: np.ndarray
    stats: dict[str, Any]
    leg: int = 0
    keep: np.ndarray | None = None

    @property
    def num_micro(self) -> int:
        return int(self.micro_lens.shape[0])

    def index(self, step: int, rank: int, micro: int) -> int:
        """Flat micro-batch index of (step, rank, micro); IndexError when out of range."""
        s = self.spec
        if not (0 <= step < self.num_steps and 0 <= rank < s.world_size):
            raise IndexError(
                f"(step {step}, rank {rank}) outside {self.num_steps} steps x "
                f"{s.world_size} ranks of epoch {self.epoch}"
            )
        if not 0 <= micro < s.grad_accum:
            raise IndexError(f"micro {micro} outside grad_accum {s.grad_accum}")
        return (step * s.world_size + rank) * s.grad_accum + micro

    def micro(self, step: int, rank: int, micro: int) -> np.ndarray:
        """Sample ids (int64) of one micro-batch, in row order: a view, no copy."""
        m = self.index(step, rank, micro)
        return self.sample_ids[self.offsets[m] : self.offsets[m + 1]]

    def micro_parts(self, step: int, rank: int, micro: int) -> tuple[np.ndarray, int, int]:
        """``(micro, micro_len, micro_bucket)`` in one lookup (the daemon's hot path)."""
        m = self.index(step, rank, micro)
        ids = self.sample_ids[self.offsets[m] : self.offsets[m + 1]]
        return ids, int(self.micro_lens[m]), int(self.micro_buckets[m])

    def micro_len(self, step: int, rank: int, micro: int) -> int:
        """Padded: longest effective row length L. Packed: total tokens T of the row."""
        return int(self.micro_lens[self.index(step, rank, micro)])

    def micro_bucket(self, step: int, rank: int, micro: int) -> int:
        return int(self.micro_buckets[self.index(step, rank, micro)])

    def micro_rows(self) -> np.ndarray:
        """Samples per micro-batch (int64)."""
        return np.diff(self.offsets)


@dataclass(frozen=True)
class _Batches:
    """Micro-batches over a sample sequence, before scheduling."""

    seq: np.ndarray  # sample ids in batch order
    seq_lengths: np.ndarray  # their effective lengths (int64)
    starts: np.ndarray  # where each micro-batch begins in seq
    lens: np.ndarray  # L (padded) or T (packed)
    costs: np.ndarray
    tokens: np.ndarray
    buckets: np.ndarray
    bounds: np.ndarray
    cut: packing.CostCut | None  # the cost bound (None: token budget only)


def effective_lengths(lengths: np.ndarray, spec: BatchSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(effective lengths int64, servable mask)``: truncated to max_seq_len; empty and
    (policy ``drop``) overlong samples are not servable."""
    raw = np.asarray(lengths)
    if raw.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {raw.shape}")
    if raw.size and raw.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(raw.min())} at {int(raw.argmin())}")
    eff = np.minimum(raw.astype(np.int64), spec.max_seq_len)
    ok = raw > 0
    if spec.overlong == "drop":
        ok &= raw <= spec.max_seq_len
    return eff, ok


def plan_epoch(
    lengths: np.ndarray,
    spec: BatchSpec,
    *,
    epoch: int,
    keep: np.ndarray | None = None,
    leg: int = 0,
) -> EpochPlan:
    """The deterministic plan of one epoch (see the module docstring).

    ``keep`` (bool, one per sample) and ``leg`` > 0 plan only the samples it marks, with
    randomness of their own: the rest of an epoch after its ``leg``-th shape change
    (``loader_server.planning.elastic.plan_rest``, which is what callers use)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    if (keep is None) != (leg == 0):
        raise ValueError(f"keep is the rest of an epoch: it goes with a leg > 0 (leg {leg})")
    epoch = int(epoch)
    eff, ok = effective_lengths(lengths, spec)
    if keep is not None:
        if keep.shape != ok.shape or keep.dtype != np.bool_:
            raise ValueError(
                f"keep must be bool of shape {ok.shape}, got {keep.dtype} {keep.shape}"
            )
        before = int((ok & ~keep).sum())
        ok = ok & keep
    ids = np.flatnonzero(ok).astype(np.int64)
    key = _Seeds(spec.seed, epoch, leg)
    batches = PLANNING[spec.layout](ids, eff, spec, key)
    if leg and 0 < batches.starts.size < spec.micro_per_step:
        batches = _one_short_step(batches, spec)
    steps = _schedule(batches, spec, key)
    plan = _assemble(batches, steps, np.asarray(lengths), ok, spec, epoch)
    if keep is None:
        return plan
    return _as_leg(plan, leg, keep, before)


def _as_leg(plan: EpochPlan, leg: int, keep: np.ndarray, before: int) -> EpochPlan:
    """``plan`` marked as the rest of its epoch after its ``leg``-th shape change."""
    object.__setattr__(plan, "leg", int(leg))
    object.__setattr__(plan, "keep", keep)
    plan.stats["served_before"] = before  # by the legs before this one
    return plan


def redeal_rest(
    lengths: np.ndarray, prior: EpochPlan, first_step: int, spec: BatchSpec, *, leg: int,
    keep: np.ndarray,
) -> EpochPlan:  # fmt: skip
    """The steps ``>= first_step`` of ``prior`` kept whole, each step's micro-batches dealt
    afresh to ``spec``'s ranks (rank balance recomputed): the rest of an epoch after a shape
    change that keeps ``world_size x grad_accum`` (``elastic.plan_rest``). Every step trains
    the same micro-batches as it would have under ``prior``'s shape, so with the trainer's
    step-normalized loss the resumed run takes the uninterrupted run's steps."""
    width = spec.micro_per_step
    if prior.spec.micro_per_step != width:
        raise ValueError(f"steps of {prior.spec.micro_per_step} micro-batches cannot be dealt "
                         f"as {spec.world_size} x {spec.grad_accum}")  # fmt: skip
    m0, m1 = first_step * width, prior.num_micro
    lo = prior.offsets[m0]
    x = prior.sample_lengths[lo:].astype(np.int64)
    starts = prior.offsets[m0:m1] - lo
    cum = np.concatenate([[0], np.cumsum(x)])
    tokens = cum[np.append(starts[1:], x.size)] - cum[starts]  # empty micro-batches too
    cut = None
    if spec.cost_model_on:  # the budget the steps were cut by
        cut = _cut(spec, float(prior.stats["cost_budget"]))
    batches = _Batches(
        prior.sample_ids[lo:], x, starts, prior.micro_lens[m0:m1], prior.micro_costs[m0:m1],
        tokens, prior.micro_buckets[m0:m1], prior.bucket_bounds, cut,
    )  # fmt: skip
    top = float(batches.costs.max(initial=0.0))
    scale = 1.0 if cut is None or top <= 0 else _COST_UNITS / top
    costs = np.ceil(batches.costs * scale).astype(np.int64)
    steps = np.arange(m1 - m0, dtype=np.int64).reshape(-1, width)
    rng = _Seeds(spec.seed, prior.epoch, leg).rng(_RNG_ORDER)
    steps = schedule.assign_ranks(steps, costs, spec.grad_accum, rng)
    ok = effective_lengths(lengths, spec)[1]
    before = int((ok & ~keep).sum())
    plan = _assemble(batches, steps, np.asarray(lengths), ok & keep, spec, prior.epoch)
    return _as_leg(plan, leg, keep, before)


@dataclass(frozen=True)
class _Seeds:
    """Where an epoch's randomness comes from: ``rng(purpose, ...)`` is
    ``default_rng([seed, epoch, purpose, ...])`` for a whole epoch (leg 0), and
    ``[seed, epoch, _RNG_LEG, leg, purpose, ...]`` for the rest of one after a shape change."""

    seed: int
    epoch: int
    leg: int

    def rng(self, *purpose: int) -> np.random.Generator:
        head = (
            [self.seed, self.epoch]
            if self.leg == 0
            else [self.seed, self.epoch, _RNG_LEG, self.leg]
        )
        return np.random.default_rng([*head, *purpose])


def _bucketed_batches(ids: np.ndarray, eff: np.ndarray, spec: BatchSpec, key: _Seeds) -> _Batches:
    bounds = bk.resolve_bounds(eff[ids], spec)
    b = bk.assign(eff[ids], bounds)
    small = b.astype(np.int16) if bounds.size < 2**15 else b  # int16: a stable radix sort
    seq = ids[np.argsort(small, kind="stable")]
    counts = np.bincount(b, minlength=bounds.size)
    edges = np.zeros(bounds.size + 1, np.int64)
    np.cumsum(counts, out=edges[1:])
    for k in np.flatnonzero(counts > 1):
        rng = key.rng(_RNG_BUCKET, int(k))
        part = seq[edges[k] : edges[k + 1]]
        part[:] = part[rng.permutation(part.size)]
    seg_buckets = np.flatnonzero(counts)
    return _greedy(seq, eff, spec, edges[seg_buckets], seg_buckets, bounds)


def _global_batches(ids: np.ndarray, eff: np.ndarray, spec: BatchSpec, key: _Seeds) -> _Batches:
    if spec.composition == "sorted":
        seq = ids[np.argsort(eff[ids], kind="stable")]  # no randomness: frozen batches
    else:
        seq = ids[key.rng(_RNG_FULL).permutation(ids.size)]
    bounds = np.array([spec.max_seq_len], np.int64)
    seg = np.zeros(min(1, seq.size), np.int64)
    return _greedy(seq, eff, spec, seg, seg.astype(np.int32), bounds)


def _greedy(
    seq: np.ndarray,
    eff: np.ndarray,
    spec: BatchSpec,
    seg_starts: np.ndarray,
    seg_buckets: np.ndarray,
    bounds: np.ndarray,
) -> _Batches:
    x = eff[seq]
    cut = cost_cut(eff[seq], spec)
    starts = packing.greedy_starts(
        x,
        seg_starts,
        token_budget=spec.token_budget,
        max_batch_size=spec.max_batch_size,
        cut=cut,
    )
    if starts.size == 0:
        return _empty_batches(seq, x, bounds, cut)
    lens = np.maximum.reduceat(x, starts)
    tokens = np.add.reduceat(x, starts)
    seg_of = np.searchsorted(seg_starts, starts, side="right") - 1
    costs = _costs(x, starts, spec)
    return _Batches(seq, x, starts, lens, costs, tokens, seg_buckets[seg_of], bounds, cut)


def _packed_batches(ids: np.ndarray, eff: np.ndarray, spec: BatchSpec, key: _Seeds) -> _Batches:
    items = ids[key.rng(_RNG_PACKED).permutation(ids.size)]
    bounds = np.array([spec.max_seq_len], np.int64)
    cut = cost_cut(eff[items], spec)
    if items.size == 0:
        return _empty_batches(items, eff[items], bounds, cut)
    sizes = packing.item_sizes(eff[items], spec.token_budget, cut)
    order, starts = packing.pack_rows(sizes, capacity=spec.token_budget)
    seq = items[order]
    x = eff[seq]
    lens = np.add.reduceat(x, starts)
    costs = _costs(x, starts, spec)
    return _Batches(seq, x, starts, lens, costs, lens, np.zeros(starts.size, np.int32), bounds, cut)


def _padded_batches(ids: np.ndarray, eff: np.ndarray, spec: BatchSpec, key: _Seeds) -> _Batches:
    if spec.composition == "bucketed":
        return _bucketed_batches(ids, eff, spec, key)
    return _global_batches(ids, eff, spec, key)


#: Each layout's planning (``loader_server.wire.layouts``): the micro-batches of an epoch's
#: samples, laid out as its rows hold them.
PLANNING = {PADDED.name: _padded_batches, PACKED.name: _packed_batches}


def cost_cut(lengths: np.ndarray, spec: BatchSpec) -> packing.CostCut | None:
    """The cost bound of ``spec`` for samples of these effective lengths (None: the default
    model, where the token budget is the only bound); ``cost_budget`` 0 is ``auto_budget``."""
    if not spec.cost_model_on:
        return None
    return _cut(spec, float(spec.cost_budget) or auto_budget(lengths, spec))


def _cut(spec: BatchSpec, budget: float) -> packing.CostCut:
    row = spec.packed_attention == "row"
    return packing.CostCut(spec.coefficients, budget, spec.anchor_rule, row_attention=row)


def auto_budget(lengths: np.ndarray, spec: BatchSpec) -> float:
    """The cost budget ``cost_budget`` 0 stands for, never below one ``max_seq_len`` row.

    Padded: the cost of the *cheapest full micro-batch*: over the lengths that carry the
    middle 90% of the corpus's tokens, a micro-batch of rows all of one length ``l``, as
    many as the token budget holds (only lengths where that is within
    ``max_batch_size``: micro-batches the token budget fills), the one of least modelled
    cost. Every costlier-per-token shape is cut down to it, so full micro-batches cost
    alike whatever their lengths; only those the row limit or a bucket's end leaves short
    are cheaper (the scheduler groups those). Packed: rows already mix lengths at random,
    so the budget is the cost of a full row of the corpus's average mix (token-weighted
    mean length, anchors and documents per token; under ``packed_attention="row"`` the
    row's own length squared); only rows that drew more than their share of costly
    documents are cut."""
    tb, rule = spec.token_budget, spec.anchor_rule
    floor = spec.row_cost(spec.max_seq_len)
    if lengths.size == 0:
        return floor
    hist = np.bincount(lengths)
    values = np.arange(hist.size)
    if layout(spec.layout).packs:
        tokens = float(hist @ values)
        per_token = (hist @ cost.doc_anchors(rule, values)) / tokens
        sq_per_token = float(hist @ (values * values)) / tokens
        if spec.packed_attention == "row":
            sq_per_token = float(tb)
        cap = rule.max_anchors
        slots = rule.block_size * (min(cap, tb * per_token) if cap > 0 else tb * per_token)
        docs = tb * float(hist.sum()) / tokens
        c0, tok, attn, slot, doc = spec.coefficients
        return max(c0 + tok * tb + attn * tb * sq_per_token + slot * slots + doc * docs, floor)
    mass = np.cumsum(hist * values)
    lo, hi = (int(v) for v in np.searchsorted(mass, mass[-1] * np.array([0.05, 0.95])))
    lo = max(lo, -(-tb // spec.max_batch_size), 1)  # rows = tb // l <= max_batch_size
    candidates = np.arange(lo, max(hi, lo) + 1)
    fill = cost.uniform_features(candidates, tb // candidates, rule=rule) @ np.asarray(
        spec.coefficients
    )
    return max(float(fill.min()), floor)


def _costs(x: np.ndarray, starts: np.ndarray, spec: BatchSpec) -> np.ndarray:
    """Each micro-batch's cost: tokens as laid out (default model; exact integers in
    float64), else the modelled cost."""
    if not spec.cost_model_on:
        if layout(spec.layout).packs:
            return np.add.reduceat(x, starts).astype(np.float64)
        rows = np.diff(np.append(starts, x.size))
        return (rows * np.maximum.reduceat(x, starts)).astype(np.float64)
    f = cost.features(
        x, starts, layout=spec.layout, rule=spec.anchor_rule,
        packed_attention=spec.packed_attention,
    )  # fmt: skip
    return f @ np.asarray(spec.coefficients)


def _empty_batches(
    seq: np.ndarray, x: np.ndarray, bounds: np.ndarray, cut: packing.CostCut | None
) -> _Batches:
    z = np.zeros(0, np.int64)
    return _Batches(seq, x, z, z, z.astype(np.float64), z, z.astype(np.int32), bounds, cut)


def _one_short_step(b: _Batches, spec: BatchSpec) -> _Batches:
    """The rest of an epoch that is too small for one step of the shape it resumes under,
    as exactly one step: the micro-batch of most rows is split in halves until there are
    ``world_size x grad_accum`` (a part never outgrows its micro-batch, so it keeps within
    the token and cost budgets); with fewer samples than that, the last micro-batches are
    empty (their rank trains nothing on them, and stays in step). So a node that returns
    in an epoch's last steps is served the rest exactly once instead of being refused."""
    k, n = spec.micro_per_step, int(b.seq.size)
    starts, parent = b.starts.tolist(), list(range(b.starts.size))
    while len(starts) < k:
        rows = np.diff([*starts, n])
        i = int(np.argmax(rows))
        if rows[i] < 2:
            break
        starts.insert(i + 1, starts[i] + int(rows[i]) // 2)
        parent.insert(i + 1, parent[i])
    at = np.array(starts, np.int64)
    x = b.seq_lengths
    tokens = np.add.reduceat(x, at)
    lens = tokens if layout(spec.layout).packs else np.maximum.reduceat(x, at)
    costs = _costs(x, at, spec)
    empty = k - at.size  # micro-batches of no sample, after the others
    z = np.zeros(empty, np.int64)
    return _Batches(
        b.seq, x, np.append(at, np.full(empty, n, np.int64)), np.append(lens, z),
        np.append(costs, z.astype(np.float64)), np.append(tokens, z),
        np.append(b.buckets[parent], z.astype(b.buckets.dtype)), b.bounds, b.cut,
    )  # fmt: skip


def _schedule(batches: _Batches, spec: BatchSpec, key: _Seeds) -> np.ndarray:
    """[num_steps, world_size*grad_accum] micro-batch indices, rank-major within a step."""
    rng = key.rng(_RNG_ORDER)
    # Only rows of one length band (a padded layout's buckets) are stratified.
    stratify = (
        not layout(spec.layout).packs
        and spec.composition == "bucketed"
        and spec.order == "stratified"
    )
    # Whole-token costs: balancing sums are then exact, independent of summation order.
    # Modelled costs (any unit) are first scaled so that the costliest is 2**20 units.
    top = float(batches.costs.max(initial=0.0))
    scale = 1.0 if batches.cut is None or top <= 0 else _COST_UNITS / top
    costs = np.ceil(batches.costs * scale).astype(np.int64)
    args = (spec.world_size, spec.grad_accum, rng)
    # Modelled costs are balanced further (cost-matched units, exact or swapped rank
    # splits); token costs keep the scheduler of the default plans, whose bytes are pinned.
    modelled = batches.cut is not None
    if stratify:
        samples = (batches.seq_lengths, batches.starts) if modelled else None
        return schedule.stratified_steps(
            batches.lens, batches.tokens, costs, *args, modelled=modelled, samples=samples
        )
    return schedule.shuffled_steps(
        batches.tokens, costs, *args, modelled=modelled, sequential=spec.order == "sequential"
    )


def _assemble(
    batches: _Batches,
    steps: np.ndarray,
    raw: np.ndarray,
    ok: np.ndarray,
    spec: BatchSpec,
    epoch: int,
) -> EpochPlan:
    micro = steps.ravel()
    ends = np.append(batches.starts[1:], batches.seq.size)
    rows = (ends - batches.starts)[micro]
    offsets = np.zeros(micro.size + 1, np.int64)
    np.cumsum(rows, out=offsets[1:])
    pos = np.arange(offsets[-1], dtype=np.int64) + np.repeat(
        batches.starts[micro] - offsets[:-1], rows
    )
    plan = EpochPlan(
        spec=spec,
        epoch=epoch,
        num_steps=int(steps.shape[0]),
        sample_ids=batches.seq[pos],
        sample_lengths=batches.seq_lengths[pos].astype(np.int32),
        offsets=offsets,
        micro_lens=batches.lens[micro].astype(np.int64),
        micro_costs=batches.costs[micro].astype(np.float64),
        micro_buckets=batches.buckets[micro].astype(np.int32),
        bucket_bounds=batches.bounds,
        stats={},
    )
    plan.stats.update(_stats(plan, batches, raw, ok, spec))
    return plan


def _stats(
    plan: EpochPlan, batches: _Batches, raw: np.ndarray, ok: np.ndarray, spec: BatchSpec
) -> dict[str, Any]:
    served_tokens = int(plan.sample_lengths.sum(dtype=np.int64))
    rows = plan.micro_rows()
    if layout(spec.layout).packs:
        capacity = plan.num_micro * spec.token_budget
    else:
        capacity = int((rows * plan.micro_lens).sum())
    empty = int((raw == 0).sum())
    overlong = int((raw > spec.max_seq_len).sum())
    cost_budget = float(spec.token_budget if batches.cut is None else batches.cut.budget)
    return {
        "samples": int(raw.size),
        "served": int(plan.sample_ids.size),
        "tokens": int(raw.sum(dtype=np.int64)),
        "served_tokens": served_tokens,
        "dropped_empty": empty,
        "dropped_overlong": overlong if spec.overlong == "drop" else 0,
        "truncated": int((raw[plan.sample_ids] > spec.max_seq_len).sum()),
        "dropped_leftover": int(ok.sum()) - int(plan.sample_ids.size),
        "dropped_leftover_micro": int(batches.starts.size) - plan.num_micro,
        "num_micro": plan.num_micro,
        "num_steps": plan.num_steps,
        "num_buckets": int(plan.bucket_bounds.size),
        "bucket_bounds": plan.bucket_bounds.tolist(),
        "padding_efficiency": served_tokens / capacity if capacity else 1.0,
        "cost_budget": cost_budget,
        "budget_fill": float(plan.micro_costs.mean() / cost_budget) if rows.size else 0.0,
    }
