"""Anchors per document against the old per-micro-batch draw, on packed rows shaped like the
reference corpus (lognormal lengths, median 1500, up to 8192; a quarter of each document an
unsupervised prompt; a 151,936-token vocabulary): blocks drawn per 65,536-token row and the
time ``plan_blocks`` takes, side by side, as ratios.

    python benchmarks/bench_anchor_draw.py [--rows 20] [--repeat 5]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import click
import numpy as np
import torch

from trainer.model.blocks import AnchorDraw, DocumentDraw, LossConfig, plan_blocks
from trainer.train.batches import pack_batch

VOCAB, BUDGET = 151_936, 65_536


def rows(n: int, seed: int) -> list:
    """``n`` packed rows of whole documents, each at most ``BUDGET`` tokens."""
    rng = np.random.default_rng(seed)
    out, next_id = [], 0
    for _ in range(n):
        lengths = np.clip(rng.lognormal(np.log(1500), 0.8, 80), 16, 8192).astype(int)
        lengths = lengths[np.cumsum(lengths) <= BUDGET]
        docs = [
            (rng.integers(0, VOCAB - 1, k).tolist(), [0] * (k // 4) + [1] * (k - k // 4))
            for k in lengths
        ]
        out.append(pack_batch(docs, sample_ids=range(next_id, next_id + len(docs))))
        next_id += len(docs)
    return out


@click.command()
@click.option("--rows", "n_rows", default=20, show_default=True, help="Packed rows measured.")
@click.option("--repeat", default=5, show_default=True, help="Timings per row (the least kept).")
@click.option("--seed", default=0, show_default=True)
def main(n_rows: int, repeat: int, seed: int) -> None:
    batches = rows(n_rows, seed)
    kinds: dict[str, tuple[LossConfig, Callable[[int], AnchorDraw]]] = {
        "per document (default)": (LossConfig(), lambda i: DocumentDraw(seed, 0)),
        "per micro-batch, cap 2048 (old)": (
            LossConfig(tokens_per_anchor=1, max_anchors=2048, anchor_draw="micro-batch"),
            lambda i: torch.Generator().manual_seed(i),
        ),
    }
    got: dict[str, tuple[float, float]] = {}
    for name, (cfg, draw) in kinds.items():
        blocks, secs = [], []
        for i, b in enumerate(batches):
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                plan = plan_blocks(b, cfg, draw(i))
                best = min(best, time.perf_counter() - t0)
            assert plan is not None
            blocks.append(len(plan.blk_doc))
            secs.append(best)
        got[name] = (statistics.mean(blocks), statistics.median(secs))
    tokens = statistics.mean(b.num_tokens for b in batches)
    docs = statistics.mean(len(b.sample_ids) for b in batches)
    print(f"{n_rows} packed rows, mean {tokens:,.0f} tokens and {docs:.1f} documents each")
    print(f"{'draw':<34} {'blocks per row':>15} {'plan_blocks ms':>15}")
    for name, (mean_blocks, sec) in got.items():
        print(f"{name:<34} {mean_blocks:>15.0f} {sec * 1e3:>15.1f}")
    (b_new, t_new), (b_old, t_old) = got.values()
    print(f"per document / old: blocks {b_new / b_old:.2f}x, planning time {t_new / t_old:.2f}x")


if __name__ == "__main__":
    main()
