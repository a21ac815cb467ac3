"""Planner targets (issue 3) on the reference shape, with the baselines measured in the same run.

    .venv/bin/python benchmarks/bench_planner.py [--samples 902000] [--world-size 8] [--repeats 3]

Lengths come from ``synth_lengths`` (lognormal, median 1500, sigma 0.8, clipped to
[16, 8192]); no corpus is written. Every row plans epochs 0 and 1 (composition repeat
compares them). ``plan s`` is the best of ``--repeats`` cold plans (bucket cache cleared:
the DP included), ``warm s`` the best later-epoch plan (buckets cached). Also printed: the
DP time for K <= 64, the efficiency curve, and a plain-Python sort + greedy pack of the
same lengths (the original approach) with the speed ratio.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import click
import numpy as np

from loader_server.data.synth import SynthSpec, synth_lengths
from loader_server.planning import buckets as bk
from loader_server.planning import metrics
from loader_server.wire.spec import REFERENCE_BUCKETS, BatchSpec


def python_sort_and_pack(lengths: list[int], budget: int, max_rows: int) -> list[list[int]]:
    """The original pipeline in plain Python: one length sort, greedy batches."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and (
            len(current) + 1 > max_rows or (len(current) + 1) * max(longest, n) > budget
        ):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def best_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(lengths: np.ndarray, spec: BatchSpec, repeats: int) -> dict[str, Any]:
    runs = [metrics.evaluate(lengths, spec) for _ in range(repeats)]
    out = runs[0]
    out["plan_s"] = min(r["plan_s"] for r in runs)
    out["plan_warm_s"] = min(r["plan_warm_s"] for r in runs)
    return out


@click.command()
@click.option("--samples", type=int, default=902_000, show_default=True)
@click.option("--world-size", type=int, default=8, show_default=True)
@click.option("--token-budget", type=int, default=65536, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
def main(samples: int, world_size: int, token_budget: int, repeats: int) -> None:
    lengths = synth_lengths(SynthSpec(num_samples=samples))
    base = BatchSpec(token_budget=token_budget, world_size=world_size)  # packed: the default
    padded = dataclasses.replace(base, layout="padded")
    reference = dataclasses.replace(padded, buckets=REFERENCE_BUCKETS, order="shuffled")
    configs = {
        "ours packed (default)": base,
        "ours padded": padded,
        "ours padded, grad_accum 4": dataclasses.replace(padded, grad_accum=4),
        "ours buckets, order shuffled": dataclasses.replace(padded, order="shuffled"),
        "  same, grad_accum 4": dataclasses.replace(padded, order="shuffled", grad_accum=4),
        "sorted (original)": dataclasses.replace(padded, composition="sorted"),
        "random": dataclasses.replace(padded, composition="random"),
        "reference 6 buckets": reference,
    }
    print(
        f"{samples:,} samples, {int(lengths.sum()):,} tokens; token_budget {token_budget}, "
        f"world_size {world_size}, max_batch_size {base.max_batch_size}; best of {repeats}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (times grow with it)"
    )
    rows = {name: measure(lengths, spec, repeats) for name, spec in configs.items()}
    print(metrics.format_table(rows))

    dp_s = best_time(lambda: bk.solve(lengths, 64), repeats)
    curve = bk.efficiency_curve(lengths, 32)
    auto_k = rows["ours padded"]["num_buckets"]
    as_list = lengths.tolist()
    py_s = best_time(lambda: python_sort_and_pack(as_list, token_budget, base.max_batch_size), 1)
    ours = rows["ours padded"]
    print(f"\nbucket DP, K = 1..64: {dp_s:.3f} s; auto picked K = {auto_k}")
    print("optimal-bucket efficiency (to bucket bound), K = 1..32:")
    for lo in range(0, 32, 8):
        print("  " + "  ".join(f"K={k + 1:<2} {curve[k]:.4f}" for k in range(lo, lo + 8)))
    print(
        f"plain-Python sort + greedy pack: {py_s:.3f} s; ours (cold plan, DP included) "
        f"{ours['plan_s']:.3f} s = {py_s / ours['plan_s']:.1f}x faster, "
        f"warm {ours['plan_warm_s']:.3f} s = {py_s / ours['plan_warm_s']:.1f}x"
    )
    _targets(rows, dp_s)


def _targets(rows: dict[str, dict[str, Any]], dp_s: float) -> None:
    ours, g4 = rows["ours padded"], rows["ours padded, grad_accum 4"]
    packed = rows["ours packed (default)"]
    shuffled, shuffled4 = rows["ours buckets, order shuffled"], rows["  same, grad_accum 4"]
    eff, mix, imb = "padding_efficiency", "step_mix_distance", "rank_imbalance"
    checks = [  # (what, measured, limit, higher is better)
        ("padded efficiency", ours[eff], 0.97, True),
        ("packed efficiency", packed[eff], 0.995, True),
        ("composition repeat", ours["composition_repeat"], 0.01, False),
        ("composition repeat (packed)", packed["composition_repeat"], 0.01, False),
        ("mix / shuffled mix (ga 1)", ours[mix] / shuffled[mix], 0.5, False),
        ("mix / shuffled mix (packed)", packed[mix] / shuffled[mix], 0.5, False),
        ("mix / shuffled mix (ga 4)", g4[mix] / shuffled4[mix], 0.5, False),
        ("rank imbalance (ga 1)", ours[imb], 1.05, False),
        ("rank imbalance (ga 4)", g4[imb], 1.05, False),
        ("rank imbalance (packed)", packed[imb], 1.05, False),
        ("plan s (cold, padded)", ours["plan_s"], 0.5, False),
        ("plan s (cold, packed)", packed["plan_s"], 0.5, False),
        ("bucket DP s (K <= 64)", dp_s, 1.0, False),
    ]
    print("\ntargets")
    for name, value, limit, higher in checks:
        ok = value >= limit if higher else value <= limit
        sign = ">=" if higher else "<="
        print(f"  {name:<30}{value:>9.4f}  {sign} {limit:<6} {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
