"""A local target loaded the trainer's way (``trainer.model.weights.load_model``) against a
plain ``from_pretrained``, side by side: seconds and a rank's peak resident memory beyond
the weights it ends with, for each (checkpoint dtype -> load dtype) a rank can ask for.

    .venv/bin/python benchmarks/bench_target_load.py [--hidden 2048 --layers 8 --vocab 32000]

A random-weight Qwen3 of that shape is saved once in fp32 and in bf16 (in a temporary
folder); every load runs in a fresh process, whose peak (VmHWM) is reset just before it.
On CPU the weights' destination is host memory, so "beyond the weights" is what the
loading itself costs: on a GPU rank, that is all the host memory it takes. The
measurement is ``scripts/checks/target_load.py``'s (the GPU check's ``load`` stage runs it
too), the checkpoint ``scripts/fixtures/random_qwen3.py``'s.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from scripts.checks.target_load import measure  # noqa: E402
from scripts.fixtures.random_qwen3 import save_random  # noqa: E402


@click.command()
@click.option("--hidden", type=int, default=2048, show_default=True)
@click.option("--layers", type=int, default=8, show_default=True)
@click.option("--vocab", type=int, default=32000, show_default=True)
def main(hidden: int, layers: int, vocab: int) -> None:
    mib = 2**20
    with tempfile.TemporaryDirectory() as work:
        saved = {d: save_random(Path(work) / d, d, hidden, layers, vocab)
                 for d in ("float32", "bfloat16")}  # fmt: skip
        sizes = {
            d: sum(f.stat().st_size for f in p.glob("*.safetensors")) for d, p in saved.items()
        }
        print(
            f"random Qwen3, hidden {hidden}, {layers} layers, vocab {vocab}: checkpoint "
            f"{sizes['float32'] / mib:.0f} MiB in fp32, {sizes['bfloat16'] / mib:.0f} MiB in bf16"
        )
        print(f"{'checkpoint -> load':>22} {'weights MiB':>12} {'from_pretrained':>22} "
              f"{'ours':>22} {'peak ratio':>11}")  # fmt: skip
        for src, dst in (("float32", "bfloat16"), ("bfloat16", "float32"),
                         ("bfloat16", "bfloat16"), ("float32", "float32")):  # fmt: skip
            plain, ours = measure(saved[src], "plain", dst), measure(saved[src], "ours", dst)
            cells = [f"{r['seconds']:.1f} s, +{max(r['extra'], 0) / mib:.0f} MiB"
                     for r in (plain, ours)]  # fmt: skip
            ratio = max(ours["extra"], 1) / max(plain["extra"], 1)
            print(f"{src + ' -> ' + dst:>22} {ours['weights'] / mib:>12.0f} {cells[0]:>22} "
                  f"{cells[1]:>22} {ratio:>10.2f}x")  # fmt: skip
        print(
            "+MiB: the peak resident memory of the loading process beyond the weights it "
            "ends with (same-dtype CPU loads keep the weights as views of the file: ~0)"
        )


if __name__ == "__main__":
    main()
