"""A target whole on every rank against its decoder layers sharded over the ranks
(``--target-shard fsdp``), 2 gloo ranks on CPU: per rank, the parameters it holds, its
peak host memory beyond its baseline while loading, the load's seconds, the time of its
features (``train_features``, the deepest of 5 spread layers, on its own tokens), and how
far the sharded features are from the whole target's.

    .venv/bin/python benchmarks/bench_target_shard.py [--hidden 512 --layers 16 --vocab 8192]

A random-weight Qwen3 of that shape is saved once in bf16 and read in fp32 (the CPU
trainer's dtype: every byte a rank holds is its own, none the file's page cache); each
configuration runs in fresh processes (``scripts/checks/target_shard.py``, which the GPU
check's ``shard`` stage runs too).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from scripts.checks.target_shard import measure  # noqa: E402
from scripts.fixtures.random_qwen3 import save_random  # noqa: E402

MIB = 2**20


@click.command()
@click.option("--hidden", type=int, default=512, show_default=True)
@click.option("--layers", type=int, default=16, show_default=True)
@click.option("--vocab", type=int, default=8192, show_default=True)
@click.option("--ranks", type=int, default=2, show_default=True)
@click.option("--tokens", type=int, default=512, show_default=True, help="Per rank and forward.")
@click.option("--reps", type=int, default=5, show_default=True)
def main(hidden: int, layers: int, vocab: int, ranks: int, tokens: int, reps: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        path = save_random(Path(work) / "target", "bfloat16", hidden, layers, vocab)
        runs = {mode: measure(path, mode, "float32", "cpu", ranks, Path(work) / f"{mode}.json",
                              tokens, reps) for mode in ("whole", "sharded")}  # fmt: skip
    print(f"random Qwen3, hidden {hidden}, {layers} layers, vocab {vocab}, bf16 checkpoint "
          f"read in fp32, {ranks} gloo ranks, {tokens} tokens per rank and forward")  # fmt: skip
    print(f"{'':>8} {'rank':>4} {'layers MiB (all)':>17} {'rest MiB':>9} {'peak +MiB':>10} "
          f"{'load s':>7} {'features s':>11} {'max diff':>9}")  # fmt: skip
    for mode, recs in runs.items():
        for r in recs:
            diff = f"{r['max_diff']:.1e}" if "max_diff" in r else "-"
            print(f"{mode:>8} {r['rank']:>4} {r['layers_local'] / MIB:>7.0f} "
                  f"({r['layers_total'] / MIB:>6.0f}) {r['other'] / MIB:>9.0f} "
                  f"{r['host_extra'] / MIB:>10.0f} {r['load_s']:>7.2f} {r['forward_s']:>11.3f} "
                  f"{diff:>9}")  # fmt: skip
    whole, sharded = runs["whole"], runs["sharded"]
    peak = max(r["host_extra"] for r in sharded) / max(r["host_extra"] for r in whole)
    slow = max(r["forward_s"] for r in sharded) / max(r["forward_s"] for r in whole)
    print(f"sharded / whole: peak host memory per rank {peak:.2f}x, features time {slow:.2f}x")


if __name__ == "__main__":
    main()
