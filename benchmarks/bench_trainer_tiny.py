"""Tiny-target training throughput, this tree against a baseline tree, in one run.

The demo's shape (4-layer tiny target, vocab 512, 1-layer drafter, block 8, 16 anchors per
document) on padded micro-batches of 2,048 tokens built from the demo's length mix: each
tree runs in its own process (``--tree`` puts it first on ``sys.path``), timing forward +
backward + optimizer step over the same micro-batches. The baseline is any checkout of this
project with the trainer's ``model/`` and ``train/`` packages (eb551e2 on), e.g.
``git worktree add /tmp/base eb551e2``.

    python benchmarks/bench_trainer_tiny.py --baseline /tmp/base [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(steps: int) -> dict[str, float]:
    import torch

    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.loss import draft_loss
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model
    from trainer.train import hostmem
    from trainer.train.batches import pad_batch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    target = Target(build_tiny_model(TinyTargetSpec()))
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=8, mask_token_id=511
    )
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):
        lengths = torch.clamp(torch.randn(16, generator=g) * 40 + 128, 48, 256).long().tolist()
        rows = [(torch.randint(0, 511, (n,), generator=g).tolist(), [0] * 16 + [1] * (n - 16))
                for n in lengths]  # fmt: skip
        batches.append(pad_batch(rows))
    loss_cfg = LossConfig(block_size=8, anchors_per_doc=16)
    times, tokens = [], 0
    for i in range(steps + 5):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(i)
        out = draft_loss(target, drafter, batch, loss_cfg, gen, on_chunks=hostmem.fit_chunks)
        assert out.loss is not None  # every document has supervised tokens to anchor on
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 5:  # warm-up
            times.append(time.perf_counter() - t0)
            tokens += out.num_tokens
    return {"micro_per_s": len(times) / sum(times), "tokens_per_s": tokens / sum(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="A checkout to compare against.")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, str(args.tree))
        print(json.dumps(measure(args.steps)))
        return
    trees = {"this tree": ROOT}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    got = {}
    for name, tree in trees.items():
        res = subprocess.run(
            [sys.executable, __file__, "--tree", str(tree), "--steps", str(args.steps)],
            capture_output=True, text=True, check=True, cwd=tree,
        )  # fmt: skip
        got[name] = json.loads(res.stdout.strip().splitlines()[-1])
        r = got[name]
        print(f"{name:>10}: {r['micro_per_s']:7.2f} micro-batches/s {r['tokens_per_s']:9.0f} tok/s")
    if "baseline" in got:
        ratio = got["this tree"]["tokens_per_s"] / got["baseline"]["tokens_per_s"]
        print(f"this tree / baseline: {ratio:.3f}x")


if __name__ == "__main__":
    main()
