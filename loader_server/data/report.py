"""Corpus summaries for humans and scripts: length statistics, text histograms, plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (1, 10, 25, 50, 75, 90, 99)


def length_summary(lengths: np.ndarray) -> dict[str, Any]:
    """Samples, tokens and length percentiles of a lengths array."""
    lengths = np.asarray(lengths)
    pct = np.percentile(lengths, PERCENTILES) if lengths.size else np.zeros(len(PERCENTILES))
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "mean_len": float(lengths.mean()) if lengths.size else 0.0,
        "min_len": int(lengths.min()) if lengths.size else 0,
        "max_len": int(lengths.max()) if lengths.size else 0,
        "percentiles": {f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)},
    }


def log_bins(lengths: np.ndarray, num_bins: int = 16) -> np.ndarray:
    """Geometric bin edges covering the lengths (lengths are lognormal-ish)."""
    lo, hi = max(1, int(lengths.min())), int(lengths.max()) + 1
    edges = np.unique(np.geomspace(lo, hi, num_bins + 1).round().astype(np.int64))
    return edges if edges.size >= 2 else np.array([lo, hi + 1])


def text_histogram(lengths: np.ndarray, num_bins: int = 16, width: int = 40) -> str:
    """A histogram of sample counts over geometric length bins, one line per bin."""
    edges = log_bins(lengths, num_bins)
    counts, _ = np.histogram(lengths, bins=edges)
    top = max(int(counts.max()), 1)
    lines = []
    for k, c in enumerate(counts):
        bar = "#" * round(width * int(c) / top)
        lines.append(f"{int(edges[k]):>6}-{int(edges[k + 1]) - 1:<6} {int(c):>9} {bar}")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    pct = "  ".join(f"{k}={v:.0f}" for k, v in summary["percentiles"].items())
    return (
        f"samples {summary['samples']:,}  tokens {summary['tokens']:,}  "
        f"mean length {summary['mean_len']:.1f}  min {summary['min_len']}  "
        f"max {summary['max_len']}\nlength percentiles: {pct}"
    )


def plot_length_histogram(lengths: np.ndarray, out: str | Path, title: str = "") -> None:
    """Write a PNG of the length histogram (needs matplotlib: ``pip install .[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'dflash-loader[plot]'") from e
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(lengths, bins=log_bins(lengths, 48).tolist(), color="#4472c4")
    ax.set_xscale("log")
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(title or "length histogram")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
