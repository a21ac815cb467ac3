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

``--long 4096,8192,16384``: one document of each length per micro-batch, a whole training
step (forward, backward, AdamW step, its state allocated first), at Qwen3-8B's proportions
scaled down (``LONG_SHAPE``: hidden 256, 8 layers of which 6 run, 5 feature layers, 4/1
heads of 64, MLP 3x, vocabulary 32,000, a 1-layer drafter, the trainer's defaults: 512
anchors per document, chunk 1024), fp32 as on CPU: the measured peak RSS next to
``memory_terms``' prediction (``scripts/checks/long_memory.py``, the formula docs/GUIDE.md
"Long context" evaluates at the Qwen3-8B shape), and the same formula at Qwen3-8B in bf16
for 32K and 64K.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

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
    loss_cfg = LossConfig(block_size=BLOCK, anchors_per_doc=anchors, tokens_per_anchor=1)
    rss_before = _rss_gb()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = draft_loss(
            target, drafter, batch, loss_cfg, torch.Generator(), chunk_size=chunk,
            on_chunks=hostmem.fit_chunks,  # the trainer's CPU allocator policy
        )  # fmt: skip
        assert out.loss is not None  # a fully supervised document: blocks to train on
        out.loss.backward()
        times.append(time.perf_counter() - t0)
        drafter.zero_grad(set_to_none=True)
    return {
        "rss_before_gb": rss_before,
        "rss_peak_gb": _rss_gb(),
        "step_s": times[-1],
        "blocks": out.num_blocks,
    }


def one_long(seq: int) -> dict[str, float]:
    """A whole training step on one ``seq``-token document at ``LONG_SHAPE`` (fp32, CPU):
    the process's resident memory before building anything and before the step, and the
    peak during the step (the kernel's high-water mark, reset before it)."""
    import torch

    from scripts.checks.long_memory import LONG_SHAPE
    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.loss import draft_loss
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model
    from trainer.train import hostmem
    from trainer.train.batches import pad_batch

    torch.manual_seed(0)
    runtime = _proc_gb("VmRSS")
    sh = LONG_SHAPE
    spec = TinyTargetSpec(
        vocab_size=sh.vocab, hidden_size=sh.hidden, intermediate_size=sh.intermediate,
        num_layers=sh.layers, num_heads=sh.heads, num_kv_heads=sh.kv_heads,
        max_positions=max(seq, 8192),
    )  # fmt: skip
    target = Target(build_tiny_model(spec), list(sh.feature_layers))
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=len(sh.feature_layers), num_layers=sh.drafter_layers,
        block_size=BLOCK, mask_token_id=sh.vocab - 1,
    )  # fmt: skip
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95))
    for p in drafter.parameters():  # AdamW's state, allocated before the measured step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, sh.vocab - 1, (seq,)).tolist()
    batch = pad_batch([(ids, [1] * seq)])
    loss_cfg = LossConfig(block_size=BLOCK, anchors_per_doc=sh.anchors_per_doc,
                          tokens_per_anchor=sh.tokens_per_anchor)  # fmt: skip
    before = _proc_gb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    out = draft_loss(
        target, drafter, batch, loss_cfg, torch.Generator(), chunk_size=sh.loss_chunk,
        on_chunks=hostmem.fit_chunks,
    )  # fmt: skip
    assert out.loss is not None  # a fully supervised document: blocks to train on
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {
        "runtime_gb": runtime,
        "rss_before_gb": before,
        "rss_peak_gb": _proc_gb("VmHWM"),
        "step_s": time.perf_counter() - t0,
        "blocks": out.num_blocks,
    }


def _proc_gb(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    """Reset the peak resident memory (``VmHWM``) to the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def compare_long(seqs: list[int]) -> None:
    """Measured memory against the formula, side by side (``--long``)."""
    from scripts.checks.long_memory import LONG_SHAPE, QWEN3_8B, memory_terms

    gib = 2**30
    print(
        f"{'tokens':>7} {'resident before the step':>26} {'the step, above it':>22} "
        f"{'step error':>10} {'time':>7}"
    )
    print(f"{'':>7} {'measured':>12} {'predicted':>13} {'measured':>10} {'predicted':>11}")
    for seq in seqs:
        res = subprocess.run(
            [sys.executable, __file__, "--one-long", str(seq)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        m = json.loads(res.stdout.strip().splitlines()[-1])
        t = memory_terms(LONG_SHAPE, seq, weight_bytes=4, act_bytes=4, attention="sdpa")
        resident = m["rss_before_gb"] - m["runtime_gb"]
        step = m["rss_peak_gb"] - m["rss_before_gb"]
        predicted = (t["peak"] - t["resident"]) / gib
        print(
            f"{seq:>7} {resident:9.3f} GB {t['resident'] / gib:10.3f} GB {step:7.3f} GB "
            f"{predicted:8.3f} GB {predicted / step - 1:+10.1%} {m['step_s']:6.1f} s"
        )
    print(f"(resident: beyond the {m['runtime_gb']:.2f} GB of the process before building)")
    print("Qwen3-8B shape, bf16 target, fp32 drafter under bf16 autocast, flex attention:")
    for seq in (32768, 65536):
        t = memory_terms(QWEN3_8B, seq, weight_bytes=2, act_bytes=2, attention="flex")
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in t.items() if k != "peak")
        print(f"  {seq:>6} tokens: peak {t['peak'] / gib:.1f} GiB ({parts})")


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
    ap.add_argument("--long", help="Document lengths: whole steps at LONG_SHAPE vs the formula.")
    ap.add_argument(
        "--one", nargs=3, metavar=("ANCHORS", "CHUNK", "VARIANT"), help=argparse.SUPPRESS
    )
    ap.add_argument("--one-long", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_long:
        print(json.dumps(one_long(args.one_long)))
        return
    if args.long:
        compare_long([int(x) for x in args.long.split(",")])
        return
    if args.one:
        print(json.dumps(one(int(args.one[0]), int(args.one[1]), args.one[2])))
        return
    if args.dflash2:
        compare_dflash2([int(x) for x in args.anchors.split(",")], args.chunk)
        return
    rows: list[dict[str, Any]] = []
    for a in (int(x) for x in args.anchors.split(",")):
        row: dict[str, Any] = {"anchors": a}
        for name, chunk in (("chunked", args.chunk), ("unchunked", 0)):
            if chunk == 0 and not fits_unchunked(a, args.limit_gb):
                row[name] = None
                continue
            row[name] = _run(a, chunk, "dflash")
        rows.append(row)
        _print_row(row, header=len(rows) == 1)
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


def _print_row(row: dict, header: bool) -> None:
    def cell(r: dict | None) -> str:
        if r is None:
            return "does not fit".rjust(24)
        return f"{r['rss_peak_gb']:6.2f} GB {r['step_s']:7.2f} s".rjust(24)

    if header:
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
