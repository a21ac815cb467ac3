"""Measures of the batching experiment (``benchmarks.experiment.run``): loss spikiness, the length
mix of every step, and held-out loss per length band. Pure functions of the numbers: reading
the runs and scoring their drafters is ``benchmarks.experiment.analysis``'s.

* **Spikiness** of a training-loss series ``l_1..l_n`` (after a burn-in that skips the
  fast initial descent): ``diff_std`` = std of ``l_t - l_{t-1}``; ``max_jump`` = the
  largest single-step increase; ``spike_frac`` = the fraction of steps whose increase
  exceeds a threshold shared by all specs of a seed (twice the pooled ``diff_std``), so
  the fraction compares specs on one yardstick; ``resid_std`` = std of the loss around its
  centered rolling mean (noise with the trend removed).
* **Step mix**: the plan is a pure function of (lengths, spec, seed, epoch), so each logged
  step's samples are known exactly; ``hard_frac`` is the share of them at or above the
  corpus's difficulty split (the synth median length). The reconstruction is checked
  against the tokens each step logged. ``corr_resid_hard`` correlates it with the loss
  residual: the mechanism behind the spikes. ``all_hard_frac`` is the share of steps with
  no short (easy) sample at all.
* **Held-out loss per band**: the final checkpoint's drafter, the same weighted block CE
  as training (``trainer.model.loss.draft_loss``), on held-out samples grouped into 4 bands at
  the quartiles of their lengths. Batches and anchor generators are fixed, so every
  drafter is scored on exactly the same blocks (a paired comparison).
* **tau** (``--corpus text``): the trainer's verifier on the held-out prompts, at step 0 (the
  untrained drafter), every ``eval_every`` steps and at the end (``metrics.jsonl``).
* **Forgetting** (``--corpus text``): the held-out loss of the shortest band at every
  checkpoint (every ``ckpt_every`` steps). For each interval between two checkpoints,
  ``long_only`` is the share of its steps that held no sample below the split length, and
  ``delta`` the change of that loss over the interval. Forgetting shows as ``delta > 0``
  where ``long_only`` is high: ``forgetting_corr`` correlates the two, and
  ``delta_long``/``delta_mixed`` average ``delta`` over intervals with ``long_only`` at least
  ``LONG_RUN`` and below it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.experiment.stats import paired_mean, paired_tau

NUM_BANDS = 4
ROLLING_WINDOW = 21
#: An interval of steps counts as a long-only run when at least this share of its steps
#: held no short sample.
LONG_RUN = 0.5


# ---- loss series --------------------------------------------------------------------------


def rolling_mean(x: np.ndarray, window: int = ROLLING_WINDOW) -> np.ndarray:
    """Centered moving average; windows shrink at the ends (no padding bias)."""
    x = np.asarray(x, dtype=np.float64)
    half = window // 2
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, x.size)
    return (c[hi] - c[lo]) / (hi - lo)


def spikiness(losses: Sequence[float], *, threshold: float | None = None) -> dict[str, Any]:
    """Spikiness of one loss series (see the module docstring); ``spike_frac`` only when a
    ``threshold`` (an increase in loss units) is given. Fewer than 3 losses (a short run
    whose steps held no anchor) measure nothing: every value is None, as for a missing
    measure, and summaries and paired differences leave the run out."""
    x = np.asarray(losses, dtype=np.float64)
    if x.ndim != 1 or not np.isfinite(x).all():
        raise ValueError(f"need a series of finite losses, got {losses!r}")
    if x.size < 3:
        keys = ["diff_std", "max_jump", "resid_std"] + ["spike_frac"] * (threshold is not None)
        return {"num_steps": int(x.size), **dict.fromkeys(keys)}
    d = np.diff(x)
    out: dict[str, Any] = {
        "num_steps": int(x.size),
        "diff_std": float(d.std(ddof=1)),
        "max_jump": float(d.max()),
        "resid_std": float((x - rolling_mean(x)).std(ddof=1)),
    }
    if threshold is not None:
        out["spike_frac"] = float((d > threshold).mean())
    return out


def pooled_diff_std(series: Sequence[Sequence[float]]) -> float | None:
    """Std of the step-to-step changes of several series taken together (None for fewer
    than two changes)."""
    d = np.concatenate(
        [np.diff(np.asarray(s, np.float64)) for s in series if len(s) > 1] or [np.empty(0)]
    )
    return float(d.std(ddof=1)) if d.size > 1 else None


# ---- lengths and forgetting ---------------------------------------------------------------


def length_bands(lengths: np.ndarray, num_bands: int = NUM_BANDS) -> np.ndarray:
    """Band of every sample: 0..num_bands-1, cut at the quantiles of ``lengths``."""
    edges = np.quantile(lengths, np.arange(1, num_bands) / num_bands)
    return np.searchsorted(edges, lengths, side="left")


def split_length(cfg: Any, lengths: np.ndarray) -> float:
    """The length that splits short from long: the synthetic corpus's difficulty split (its
    median setting), the text corpus's median length."""
    return float(cfg.median_len) if cfg.corpus == "synthetic" else float(np.median(lengths))


def forgetting(
    steps: Sequence[int], short_loss: Sequence[float], all_hard: np.ndarray
) -> dict[str, Any]:
    """Forgetting measures (module docstring) from the shortest band's held-out loss at
    checkpoint ``steps`` and, per optimizer step 1..n, whether it held no short sample."""
    s = np.asarray(steps, dtype=np.int64)
    loss = np.asarray(short_loss, dtype=np.float64)
    if s.size != loss.size or s.size < 2 or np.any(np.diff(s) <= 0) or s[0] < 0:
        raise ValueError(f"need >= 2 increasing checkpoint steps with a loss each, got {steps}")
    if s[-1] > all_hard.size:
        raise ValueError(f"checkpoint step {s[-1]} is past the {all_hard.size} logged steps")
    long_only = np.array([all_hard[a:b].mean() for a, b in itertools.pairwise(s)])
    delta = np.diff(loss)
    long_iv, mixed_iv = long_only >= LONG_RUN, long_only < LONG_RUN
    spread = long_only.std() > 0 and delta.std() > 0
    return {
        "steps": s.tolist(),
        "short_loss": loss.tolist(),
        "long_only": long_only.tolist(),
        "delta": delta.tolist(),
        "forgetting_corr": float(np.corrcoef(long_only, delta)[0, 1]) if spread else None,
        "long_intervals": int(long_iv.sum()),
        "delta_long": float(delta[long_iv].mean()) if long_iv.any() else None,
        "delta_mixed": float(delta[mixed_iv].mean()) if mixed_iv.any() else None,
        "rises_in_long": int((delta[long_iv] > 0).sum()),
    }


# ---- comparisons --------------------------------------------------------------------------


def reference_of(specs: Sequence[str]) -> str:
    """What the other specs are compared with: ``stratified``, the padded default before
    packed rows, when run."""
    return "stratified" if "stratified" in specs else specs[0]


def at_tokens(series: dict[str, list], tokens: int) -> dict[str, Any]:
    """The run at ``tokens`` unpadded tokens trained (the least any run of its seed
    trained): its step there and its training loss, the rolling mean at that step (so a
    spec that packs more real tokens per step is compared at equal data, not equal steps)."""
    real = np.asarray(series["real_tokens"], dtype=np.int64)
    if real.size == 0:  # no step of the run had a loss
        return {"tokens": int(tokens), "step": None, "train_loss": None}
    i = max(int(np.searchsorted(real, tokens, side="right")) - 1, 0)
    return {
        "tokens": int(tokens),
        "step": int(series["step"][i]),
        "train_loss": float(rolling_mean(np.asarray(series["loss"]))[i]),
    }


def paired(runs: dict[str, dict[str, Any]], spec: str, ref: str, seeds: Sequence[int]) -> dict:
    """Per-seed paired differences ``spec - ref`` of each measure, with bootstrap 95%
    intervals (``benchmarks.experiment.stats``); a measure some run lacks is left out."""
    by = {(r["spec"], r["seed"]): r for r in runs.values()}
    pairs = [(by[spec, s], by[ref, s]) for s in seeds]
    measures: dict[str, Any] = {
        "heldout_all": lambda r: r["heldout"]["loss_all"],
        **{f"heldout_band{b}": (lambda r, b=b: r["heldout"]["loss"][b])
           for b in range(len(pairs[0][0]["heldout"]["loss"]))},
        "diff_std": lambda r: r["spikiness"]["diff_std"],
        "final_loss": lambda r: r["final_loss"],
        "train_loss_at_equal_tokens": lambda r: r["at_equal_tokens"]["train_loss"],
        "heldout_all_at_equal_tokens": lambda r: r["at_equal_tokens"]["heldout"]["loss_all"],
        "tau_final": lambda r: r["tau"]["tau"][-1],
        "vllm_tau": lambda r: r["vllm"]["tau"],
        "humaneval_tau": lambda r: r["humaneval"]["tau"],
    }  # fmt: skip
    out: dict[str, Any] = {}
    for name, get in measures.items():
        try:
            diffs = [float(get(a)) - float(get(b)) for a, b in pairs]
        except (KeyError, IndexError, TypeError):
            continue
        out[name] = paired_mean(diffs)
    try:  # vLLM on every held-out prompt: prompts resampled too
        counts = [[np.asarray(r["vllm"]["heldout"]["per_prompt"]) for r in pair] for pair in pairs]
    except KeyError:
        return out
    out["vllm_tau_heldout"] = paired_tau([a for a, _ in counts], [b for _, b in counts])
    return out


# ---- summaries ----------------------------------------------------------------------------


def _stats(values: list[float | None]) -> dict[str, Any]:
    """Mean, min, max and count of ``values``, the missing (None) left out."""
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def corpus_facts(
    lengths: np.ndarray, held: np.ndarray, band: np.ndarray, split_len: float
) -> dict[str, Any]:
    """Sizes and lengths of the training and held-out corpora, and of each held-out band."""

    def facts(x: np.ndarray) -> dict[str, Any]:
        return {
            "samples": int(x.size),
            "tokens": int(x.sum(dtype=np.int64)),
            "median_len": float(np.median(x)),
            "max_len": int(x.max()),
            "hard_frac": float((x >= split_len).mean()),
        }

    bands = [
        {
            "band": b,
            "min_len": int(held[band == b].min()),
            "max_len": int(held[band == b].max()),
            "samples": int((band == b).sum()),
            "hard_frac": float((held[band == b] >= split_len).mean()),
        }
        for b in range(int(band.max()) + 1)
    ]
    return {"train": facts(lengths), "heldout": facts(held), "split_len": split_len, "bands": bands}


# ---- where acceptance moves, how the weights move -------------------------------------------


def acceptance_by_position(
    drafts: int, per_pos: dict[Any, int], positions: int
) -> list[float | None]:
    """vLLM's acceptance at each of ``positions`` draft positions, conditional: of the
    drafts whose first k tokens were accepted, the share whose next one was too.
    ``per_pos[k]`` counts the drafts whose token k was accepted (acceptance stops at the
    first rejection, so it counts the drafts that reached k + 1); a position no draft
    reached is None. The product of the first k rates is the share of drafts accepting k
    tokens or more: a gain at position 0 raises every later share."""
    reached = np.array(
        [drafts] + [int(per_pos.get(k, per_pos.get(str(k), 0))) for k in range(positions)]
    )
    if drafts <= 0 or (np.diff(reached) > 0).any():
        raise ValueError(f"per-position counts {per_pos} do not fall from {drafts} drafts")
    return [float(a / b) if b else None for a, b in zip(reached[1:], reached[:-1], strict=True)]


def weight_change(first: dict[str, np.ndarray], last: dict[str, np.ndarray]) -> dict[str, Any]:
    """How far each weight matrix moved between two checkpoints, and in how many directions:
    ``relative`` = ||W_last - W_first||_F / ||W_first||_F, and ``stable_rank`` of the change
    = ||dW||_F^2 / ||dW||_2^2 (1 for a change along one direction; the matrix's smaller
    side for one spread evenly over all), with their medians over the matrices."""
    out: dict[str, dict[str, float]] = {}
    for name, w0 in first.items():
        if w0.ndim != 2:
            continue
        d = np.asarray(last[name], dtype=np.float64) - w0
        fro2 = float((d * d).sum())
        top = float(np.linalg.norm(d, ord=2)) if fro2 > 0 else 0.0
        out[name] = {
            "relative": float(np.sqrt(fro2) / max(np.linalg.norm(w0), 1e-30)),
            "stable_rank": fro2 / top**2 if top > 0 else 0.0,
        }
    if not out:
        raise ValueError("no weight matrix to compare")
    return {
        "matrices": out,
        "relative_median": float(np.median([m["relative"] for m in out.values()])),
        "stable_rank_median": float(np.median([m["stable_rank"] for m in out.values()])),
    }


def summarize_spec(runs: dict[str, dict[str, Any]], spec: str) -> dict[str, Any]:
    """Every measure of ``spec``'s runs (one a seed) as mean, min, max and count."""
    mine = [r for r in runs.values() if r["spec"] == spec]
    keys = dict.fromkeys(k for r in mine for k in r["spikiness"])  # spike_frac: some seeds
    out: dict[str, Any] = {k: _stats([r["spikiness"].get(k) for r in mine]) for k in keys}
    out.pop("num_steps")
    for k in ("final_loss", "hard_frac_std", "all_hard_frac", "corr_resid_hard"):
        out[k] = _stats([r[k] for r in mine])
    for k in ("padding_efficiency", "composition_repeat", "step_mix_distance"):
        out[k] = _stats([r["plan"][k] for r in mine])
    out["heldout_all"] = _stats([r["heldout"]["loss_all"] for r in mine])
    out["real_tokens"] = _stats([r["real_tokens"] for r in mine])
    out["train_loss_at_equal_tokens"] = _stats([r["at_equal_tokens"]["train_loss"] for r in mine])
    nb = len(mine[0]["heldout"]["loss"])
    out["heldout_band"] = [_stats([r["heldout"]["loss"][b] for r in mine]) for b in range(nb)]
    out["heldout_acc_all"] = _stats([r["heldout"]["acc_all"] for r in mine])
    if "tau" in mine[0]:
        out["tau_final"] = _stats([r["tau"]["tau"][-1] if r["tau"]["tau"] else None for r in mine])
        out["tau_start"] = _stats([r["tau"]["tau"][0] if r["tau"]["tau"] else None for r in mine])
        for k in ("forgetting_corr", "delta_long", "delta_mixed", "long_intervals"):
            out[k] = _stats([r["forgetting"][k] for r in mine])
        served = [r["tau"]["tau_served"][-1] if r["tau"]["tau_served"] else None for r in mine]
        out["tau_served_final"] = _stats(served)
    if all("vllm" in r for r in mine):
        out["vllm_tau"] = _stats([r["vllm"]["tau"] for r in mine])
        out["vllm_tau_heldout"] = _stats([r["vllm"]["heldout"]["tau"] for r in mine])
        if all("by_position" in r["vllm"]["heldout"] for r in mine):
            rates = [r["vllm"]["heldout"]["by_position"] for r in mine]
            n = min(len(x) for x in rates)
            out["vllm_by_position"] = [_stats([x[k] for x in rates]) for k in range(n)]
    if all("weights" in r for r in mine):
        for k in ("relative_median", "stable_rank_median"):
            out[f"weights_{k}"] = _stats([r["weights"][k] for r in mine])
    if all("humaneval" in r for r in mine):
        out["humaneval_tau"] = _stats([r["humaneval"]["tau"] for r in mine])
    return out
