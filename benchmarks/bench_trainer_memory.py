"""Peak memory of one training micro-batch (forward + backward) as anchors grow.

A tiny random target with the Qwen3 vocabulary (151,936 tokens, hidden 256), a 2-layer
drafter, block 16, one fully supervised document of 4,128 tokens, every anchor kept (no
per-micro-batch cap). Each configuration runs in a fresh process (peak RSS is per process):
two micro-batches, the second timed. Unchunked (``--loss-chunk 0``, the reference path)
runs only while its estimated logits fit in memory.

    python benchmarks/bench_trainer_memory.py [--anchors 64,256,1024,4096] [--chunk 1024]
    python benchmarks/bench_trainer_memory.py --dflash2 [--anchors 256,1024,4096]

``--dflash2``: DFlash (v1) and DFlash2 (the reference shape: 2-tap convolutions over groups
of 16 channels, selector rank 256 and top-16, so two [151,936 x 256] codebooks), both
chunked, side by side, with DFlash2's cost as ratios to v1's.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VOCAB, HIDDEN, BLOCK, DOC_LEN = 151936, 256, 16, 4096 + 32


def one(anchors: int, chunk: int, variant: str = "dflash") -> dict[str, float]:
    import torch

    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.loss import draft_loss
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model
    from trainer.train import hostmem
    from trainer.train.batches import pad_batch

    torch.manual_seed(0)
    spec = TinyTargetSpec(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN)
    target = Target(build_tiny_model(spec), [0, 1, 2])
    extra = {"variant": "dflash2"} if variant == "dflash2" else {}
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=2, block_size=BLOCK,
        mask_token_id=VOCAB - 1, **extra,
    )  # fmt: skip
    drafter = DFlashDrafter(cfg)
    ids = torch.randint(0, VOCAB - 1, (DOC_LEN,)).tolist()
    batch = pad_batch([(ids, [1] * DOC_LEN)])
    loss_cfg = LossConfig(block_size=BLOCK, anchors_per_doc=anchors, max_anchors=0)
    rss_before = _rss_gb()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = draft_loss(
            target, drafter, batch, loss_cfg, torch.Generator(), chunk_size=chunk,
            on_chunks=hostmem.fit_chunks,  # the trainer's CPU allocator policy
        )  # fmt: skip
        out.loss.backward()
        times.append(time.perf_counter() - t0)
        drafter.zero_grad(set_to_none=True)
    return {
        "rss_before_gb": rss_before,
        "rss_peak_gb": _rss_gb(),
        "step_s": times[-1],
        "blocks": out.num_blocks,
    }


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def fits_unchunked(anchors: int, limit_gb: float) -> bool:
    """Unchunked keeps ~3.2 fp32 copies of [slots x vocab] (measured at 64 and 256)."""
    return 3.2 * anchors * (BLOCK - 1) * VOCAB * 4 / 2**30 < limit_gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchors", default="64,256,1024,4096")
    ap.add_argument("--chunk", type=int, default=1024, help="Slots per chunk (chunked runs).")
    ap.add_argument("--limit-gb", type=float, default=14.0, help="Skip unchunked above this.")
    ap.add_argument("--dflash2", action="store_true", help="DFlash2 next to DFlash (chunked).")
    ap.add_argument(
        "--one", nargs=3, metavar=("ANCHORS", "CHUNK", "VARIANT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), int(args.one[1]), args.one[2])))
        return
    if args.dflash2:
        compare_dflash2([int(x) for x in args.anchors.split(",")], args.chunk)
        return
    rows = []
    for a in (int(x) for x in args.anchors.split(",")):
        row = {"anchors": a}
        for name, chunk in (("chunked", args.chunk), ("unchunked", 0)):
            if chunk == 0 and not fits_unchunked(a, args.limit_gb):
                row[name] = None
                continue
            row[name] = _run(a, chunk, "dflash")
        rows.append(row)
        _print_row(row)
    _print_summary(rows)


def _run(anchors: int, chunk: int, variant: str) -> dict[str, float]:
    """One configuration in a fresh process (peak RSS is per process)."""
    res = subprocess.run(
        [sys.executable, __file__, "--one", str(anchors), str(chunk), variant],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare_dflash2(anchors: list[int], chunk: int) -> None:
    print(f"{'anchors':>8} {'DFlash: peak RSS, step':>24} {'DFlash2: peak RSS, step':>24}")
    for a in anchors:
        v1, v2 = _run(a, chunk, "dflash"), _run(a, chunk, "dflash2")
        above = [r["rss_peak_gb"] - r["rss_before_gb"] for r in (v1, v2)]
        print(
            f"{a:>8} {v1['rss_peak_gb']:9.2f} GB {v1['step_s']:7.2f} s "
            f"{v2['rss_peak_gb']:9.2f} GB {v2['step_s']:7.2f} s  ratios DFlash2/DFlash: "
            f"memory {v2['rss_peak_gb'] / v1['rss_peak_gb']:.2f}x, time "
            f"{v2['step_s'] / v1['step_s']:.2f}x, step-time memory above the model "
            f"{above[1] / above[0]:.2f}x"
        )


def _print_row(row: dict) -> None:
    def cell(r: dict | None) -> str:
        if r is None:
            return "does not fit".rjust(24)
        return f"{r['rss_peak_gb']:6.2f} GB {r['step_s']:7.2f} s".rjust(24)

    if "header" not in _print_row.__dict__:
        _print_row.header = True
        print(f"{'anchors':>8} {'chunked: peak RSS, step':>24} {'unchunked: peak RSS, step':>26}")
    print(f"{row['anchors']:>8} {cell(row['chunked'])} {cell(row['unchunked'])}  ratios: ", end="")
    u, c = row["unchunked"], row["chunked"]
    if u and c:
        mem, slow = u["rss_peak_gb"] / c["rss_peak_gb"], c["step_s"] / u["step_s"]
        print(f"unchunked/chunked memory {mem:.2f}x, chunked/unchunked time {slow:.2f}x")
    else:
        print("-")


def _print_summary(rows: list[dict]) -> None:
    peaks = {r["anchors"]: r["chunked"]["rss_peak_gb"] for r in rows}
    if 256 in peaks and 4096 in peaks:
        print(f"chunked peak 4096 vs 256 anchors: {peaks[4096] / peaks[256]:.3f}x (target <= 1.2)")
    base = rows[0]["chunked"]["rss_before_gb"]
    print(f"process RSS before the step (target, drafter, torch): {base:.2f} GB")


if __name__ == "__main__":
    main()
