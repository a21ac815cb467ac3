"""Quality measures of epoch plans (definitions in DESIGN.md), vectorized over a whole epoch.

* ``padding_efficiency``: real tokens / sum over micro-batches of rows x L (padded), or
  real tokens / (rows x token_budget) (packed).
* ``composition_repeat(a, b)``: of all pairs of samples sharing a micro-batch in plan a,
  the fraction that share one again in plan b. Frozen batches give 1.0, a fresh random
  composition ~0. Counted without enumerating pairs: tag every sample of a with its
  micro-batch in b, then count equal (a-batch, b-batch) keys: sum of c*(c-1)/2.
* ``step_mix_distance``: tokens of each optimizer step spread over 4 length bands of equal
  token mass (quartiles of the epoch's tokens by length), total-variation distance to the
  epoch's spread (1/4 each), averaged over steps. Random order of 8 length-homogeneous
  micro-batches: ~0.25 on the reference shape; a per-step band quota: < 0.1.
* ``rank_imbalance``: mean over steps of max rank cost / mean rank cost (1.0 = perfect),
  by the plan's own cost (tokens, or the modelled cost with a cost model on).
  ``rank_imbalance_modelled``: the same by a cost model's cost (``modelled_costs``: the
  spec's own model, or the one ``evaluate`` is given, so that a token-balanced plan can be
  judged by the time it would take).

``evaluate`` plans two consecutive epochs and measures them (with plan times);
``baselines`` and ``format_table`` give the comparison that ``dflash-loader plan
--compare`` and ``benchmarks/bench_planner.py`` print.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from loader_server.planning import buckets as bk
from loader_server.planning import cost
from loader_server.planning.planner import EpochPlan, plan_epoch
from loader_server.planning.schedule import NUM_BANDS
from loader_server.wire.spec import COEFFICIENTS, REFERENCE_BUCKETS, BatchSpec

#: The cost fields of a spec without a cost model (cost = tokens, budget = token budget).
TOKEN_COST: dict[str, Any] = {
    name: getattr(BatchSpec(), name) for name in (*COEFFICIENTS, "cost_budget")
}


def padding_efficiency(plan: EpochPlan) -> float:
    """Real tokens over the tokens the plan's tensors hold (padding included)."""
    return float(plan.stats["padding_efficiency"])


def micro_of_sample(plan: EpochPlan) -> np.ndarray:
    """For each position of ``plan.sample_ids``, the flat index of its micro-batch."""
    return np.repeat(np.arange(plan.num_micro, dtype=np.int64), plan.micro_rows())


def composition_repeat(a: EpochPlan, b: EpochPlan) -> float:
    """Fraction of a's same-micro-batch sample pairs that are together again in b."""
    rows = a.micro_rows()
    pairs = int((rows * (rows - 1) // 2).sum())
    if pairs == 0:
        return 0.0
    size = int(max(a.sample_ids.max(initial=-1), b.sample_ids.max(initial=-1))) + 1
    in_b = np.full(size, -1, np.int64)
    in_b[b.sample_ids] = micro_of_sample(b)
    tag = in_b[a.sample_ids]
    keep = tag >= 0
    key = micro_of_sample(a)[keep] * (b.num_micro + 1) + tag[keep]
    _, counts = np.unique(key, return_counts=True)
    return float((counts * (counts - 1) // 2).sum()) / pairs


def band_edges(lengths: np.ndarray, num_bands: int = NUM_BANDS) -> np.ndarray:
    """Upper length bounds of the first ``num_bands-1`` bands of equal token mass."""
    x = np.sort(np.asarray(lengths, dtype=np.int64))
    if x.size == 0:
        return np.zeros(num_bands - 1, np.int64)
    mass = np.cumsum(x)
    q = mass[-1] * np.arange(1, num_bands) / num_bands
    return x[np.minimum(np.searchsorted(mass, q), x.size - 1)]


def step_band_tokens(plan: EpochPlan, num_bands: int = NUM_BANDS) -> np.ndarray:
    """[num_steps, num_bands] tokens of each step in each length band."""
    x = plan.sample_lengths.astype(np.int64)
    band = np.searchsorted(band_edges(x, num_bands), x, side="left")
    step = micro_of_sample(plan) // plan.spec.micro_per_step
    flat = np.bincount(step * num_bands + band, weights=x, minlength=plan.num_steps * num_bands)
    return flat.reshape(plan.num_steps, num_bands)


def step_mix_distance(plan: EpochPlan, num_bands: int = NUM_BANDS) -> float:
    """Mean over steps of the TV distance between step and epoch band spreads."""
    if plan.num_steps == 0:
        return 0.0
    t = step_band_tokens(plan, num_bands)
    epoch = t.sum(axis=0) / t.sum()
    per_step = t / np.maximum(t.sum(axis=1, keepdims=True), 1)
    return float(0.5 * np.abs(per_step - epoch).sum(axis=1).mean())


def rank_costs(plan: EpochPlan, costs: np.ndarray | None = None) -> np.ndarray:
    """[num_steps, world_size] cost each rank runs in each step (``costs``: per micro-batch,
    default the plan's own)."""
    s = plan.spec
    c = plan.micro_costs if costs is None else costs
    return c.reshape(plan.num_steps, s.world_size, s.grad_accum).sum(axis=2)


def rank_imbalance(plan: EpochPlan, costs: np.ndarray | None = None) -> float:
    """Mean over steps of (max rank cost / mean rank cost)."""
    if plan.num_steps == 0:
        return 1.0
    c = rank_costs(plan, costs)
    mean = c.mean(axis=1)
    return float((c.max(axis=1) / np.where(mean > 0, mean, 1.0)).mean())


def modelled_costs(plan: EpochPlan, coefficients: np.ndarray) -> np.ndarray:
    """Each micro-batch's cost under a cost model (``cost.FEATURES`` order), whatever the
    plan was cut and balanced by; the anchor rule is the plan spec's."""
    s = plan.spec
    f = cost.features(
        plan.sample_lengths, plan.offsets[:-1], layout=s.layout, rule=s.anchor_rule,
        packed_attention=s.packed_attention,
    )  # fmt: skip
    return f @ np.asarray(coefficients, np.float64)


def summarize(
    plan: EpochPlan, next_plan: EpochPlan | None = None, model: np.ndarray | None = None
) -> dict[str, Any]:
    """All measures of one plan; composition repeat needs the next epoch's plan. ``model``:
    coefficients to judge rank balance by (default: the spec's own cost model, if on)."""
    st = plan.stats
    if model is None and plan.spec.cost_model_on:
        model = np.asarray(plan.spec.coefficients)
    out: dict[str, Any] = {
        "padding_efficiency": padding_efficiency(plan),
        "composition_repeat": None,
        "step_mix_distance": step_mix_distance(plan),
        "rank_imbalance": rank_imbalance(plan),
        "rank_imbalance_modelled": (
            None if model is None else rank_imbalance(plan, modelled_costs(plan, model))
        ),
        "num_steps": plan.num_steps,
        "num_micro": plan.num_micro,
        "num_buckets": st["num_buckets"],
        "served": st["served"],
        "dropped_leftover": st["dropped_leftover"],
        "dropped_overlong": st["dropped_overlong"],
        "dropped_empty": st["dropped_empty"],
        "truncated": st["truncated"],
    }
    if next_plan is not None:
        out["composition_repeat"] = composition_repeat(plan, next_plan)
    return out


def baselines(spec: BatchSpec) -> dict[str, BatchSpec]:
    """The comparison set for ``spec``: itself, sorted, random, the reference 6 buckets
    (bounds at or above ``max_seq_len`` left out)."""
    padded = replace(spec, layout="padded")
    reference = tuple(b for b in REFERENCE_BUCKETS if b < spec.max_seq_len)
    tokens_only = {"token-balanced": replace(spec, **TOKEN_COST)} if spec.cost_model_on else {}
    return {
        "this spec": spec,
        **tokens_only,
        "sorted (original)": replace(padded, composition="sorted"),
        "random": replace(padded, composition="random"),
        "reference 6 buckets": replace(
            padded, composition="bucketed", buckets=reference, order="shuffled"
        ),
    }


def timed_plans(
    lengths: np.ndarray, spec: BatchSpec, *, epoch: int = 0
) -> tuple[EpochPlan, EpochPlan, float, float]:
    """Plans of ``epoch`` and ``epoch+1`` with their times: the first from a cold bucket
    cache (the DP included), the second warm (as for every later epoch of a run)."""
    clear_caches()
    t0 = time.perf_counter()
    plan = plan_epoch(lengths, spec, epoch=epoch)
    t1 = time.perf_counter()
    following = plan_epoch(lengths, spec, epoch=epoch + 1)
    t2 = time.perf_counter()
    return plan, following, t1 - t0, t2 - t1


def evaluate(
    lengths: np.ndarray, spec: BatchSpec, *, epoch: int = 0, model: np.ndarray | None = None
) -> dict[str, Any]:
    """``summarize`` of epochs ``epoch`` and ``epoch+1`` with ``plan_s`` (cold) and
    ``plan_warm_s`` (buckets cached); ``model`` as for ``summarize``."""
    plan, following, cold, warm = timed_plans(lengths, spec, epoch=epoch)
    out = summarize(plan, following, model)
    out.update(plan_s=cold, plan_warm_s=warm, spec_key=spec.key())
    return out


COLUMNS = (
    ("padding_efficiency", "efficiency", "{:.4f}"),
    ("composition_repeat", "comp. repeat", "{:.4f}"),
    ("step_mix_distance", "mix dist", "{:.3f}"),
    ("rank_imbalance", "rank imb", "{:.4f}"),
    ("rank_imbalance_modelled", "cost imb", "{:.4f}"),
    ("plan_s", "plan s", "{:.3f}"),
    ("plan_warm_s", "warm s", "{:.3f}"),
)


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per named result, fixed-width columns (``COLUMNS``)."""
    width = max([len(name) for name in rows] + [8])
    head = f"{'':<{width}}  " + "  ".join(f"{title:>12}" for _, title, _ in COLUMNS)
    lines = [head]
    for name, r in rows.items():
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in COLUMNS]
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def clear_caches() -> None:
    """Forget cached bucket solutions (for cold timings)."""
    bk.clear_cache()
