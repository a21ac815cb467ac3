"""Paired differences with bootstrap intervals, and a plain measure of looping text.

Every spec of one seed trains on the same corpus with the same drafter init and is scored
on the same held-out blocks and prompts, so specs are compared *paired*: per seed, a
spec's measure minus the reference spec's. The interval is a percentile bootstrap (95%)
of the mean paired difference over seeds. For vLLM's acceptance length, whose per-prompt
counts are kept, the bootstrap is hierarchical: seeds are drawn with replacement and,
within each drawn seed, prompts too (the same prompts for both specs: the pairing), and
tau is pooled as vLLM pools it (``1 + accepted / drafts``) over the drawn prompts. A
difference whose interval excludes 0 separates the specs; one that includes 0 does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DRAWS = 10_000
LEVEL = 0.95
SEED = 20261203


def _interval(draws: np.ndarray, mean: float, n: int) -> dict[str, Any]:
    lo, hi = np.quantile(draws, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "n": n,
            "separates": bool(lo > 0 or hi < 0)}  # fmt: skip


def paired_mean(diffs: Sequence[float], *, draws: int = DRAWS, seed: int = SEED) -> dict:
    """Mean of per-seed paired differences and its bootstrap interval over seeds (one
    seed: an interval of width 0, which separates nothing it could not)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 1 or d.size == 0 or not np.isfinite(d).all():
        raise ValueError(f"need >= 1 finite paired differences, got {diffs!r}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, d.size, size=(draws, d.size))
    out = _interval(d[picks].mean(axis=1), float(d.mean()), int(d.size))
    if d.size == 1:
        out["separates"] = False
    return out


def pooled_tau(counts: np.ndarray) -> float:
    """vLLM's acceptance length over prompts: ``1 + sum(accepted) / sum(drafts)`` of
    ``counts`` [prompts, 2] = (drafts, accepted) per prompt."""
    c = np.asarray(counts, dtype=np.float64)
    drafts = c[..., 0].sum(axis=-1)
    return 1.0 + c[..., 1].sum(axis=-1) / np.maximum(drafts, 1.0)


def paired_tau(
    spec: Sequence[np.ndarray], ref: Sequence[np.ndarray], *, draws: int = DRAWS, seed: int = SEED
) -> dict[str, Any]:
    """Mean over seeds of ``tau(spec) - tau(ref)``, each pooled over that seed's prompts,
    with a hierarchical bootstrap interval (module docstring). ``spec[s]`` and ``ref[s]``:
    [prompts, 2] (drafts, accepted) per prompt of seed s, the same prompts in the same
    order."""
    if len(spec) != len(ref) or not spec:
        raise ValueError(f"need the same >= 1 seeds for both specs, got {len(spec)}, {len(ref)}")
    rng = np.random.default_rng(seed)
    per_seed = []
    point = []
    for a, b in zip(spec, ref, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or a.ndim != 2 or a.shape[1] != 2 or a.shape[0] == 0:
            raise ValueError(
                f"per-prompt counts must be [prompts, 2] alike, got {a.shape}, {b.shape}"
            )
        point.append(float(pooled_tau(a) - pooled_tau(b)))
        idx = rng.integers(0, a.shape[0], size=(draws, a.shape[0]))
        per_seed.append(pooled_tau(a[idx]) - pooled_tau(b[idx]))  # [draws]
    d = np.stack(per_seed)  # [seeds, draws]
    seeds = rng.integers(0, d.shape[0], size=(draws, d.shape[0]))
    boot = d[seeds, np.arange(draws)[:, None]].mean(axis=1)
    return _interval(boot, float(np.mean(point)), len(spec))


def distinct_ngram_share(tokens: np.ndarray, n: int = 4) -> float | None:
    """The share of distinct ``n``-grams among a text's ``n``-grams (1.0: none repeats; a
    reply that loops ``self.tk.tk.tk`` scores near 0). None when it has fewer than n tokens."""
    t = np.asarray(tokens, dtype=np.int64)
    if t.size < n:
        return None
    if t.min() < 0 or t.max() >= 1 << (63 // n):
        raise ValueError(f"token ids must be in [0, 2**{63 // n}) to pack {n} of them")
    grams = np.lib.stride_tricks.sliding_window_view(t, n)
    keys = np.zeros(grams.shape[0], dtype=np.int64)
    for j in range(n):  # n columns, not tokens: one vectorized pass per column
        keys = (keys << (63 // n)) | grams[:, j]
    return float(np.unique(keys).size / keys.size)
