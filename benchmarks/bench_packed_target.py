"""The target's forward over one packed row (``train_features``): SDPA (a forward per
document), flex_attention, and the dense ``[T, T]`` mask SDPA used before.

    .venv/bin/python benchmarks/bench_packed_target.py [--docs 16 --doc-len 1024 --reps 3]

A packed row holds several documents end to end (``position_ids`` restart at 0 for each).
Under SDPA the target runs each document as its own forward (``Target._per_document``);
under flex_attention (``--attention flex``, the default on CUDA) a block mask skips every
tile between documents; ``dense``, the reference, is Transformers' own split of the whole
row with a dense ``[T, T]`` mask (what SDPA ran before 2026-12-05), whose memory and
attention work grow with the square of the whole row. Each kernel runs in
a fresh process on the same random-weight Qwen3 and the same row (lengths drawn around
``--doc-len``): after two warm-up calls (flex compiles; a second shape compiles its
dynamic kernel), the median of ``--reps`` calls and the peak resident memory above the
process's resident memory before them (the kernel's own, not the model's). The features
of each are compared with the dense reference's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

MIB = 2**20
KERNELS = ("dense", "sdpa", "flex")  # the reference first


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(kernel: str, docs: int, doc_len: int, reps: int, hidden: int, out: Path) -> None:
    import torch

    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model

    torch.manual_seed(0)
    spec = TinyTargetSpec(
        vocab_size=4096, hidden_size=hidden, num_layers=4, num_heads=hidden // 64,
        num_kv_heads=max(1, hidden // 256), intermediate_size=3 * hidden,
        max_positions=4 * doc_len,
    )  # fmt: skip
    target = Target(build_tiny_model(spec))
    g = torch.Generator().manual_seed(1)

    def row(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.randint(doc_len // 2, doc_len * 3 // 2, (n,), generator=g).tolist()
        pos = torch.cat([torch.arange(n_) for n_ in lens])[None]
        return torch.randint(0, 4096, (1, pos.shape[1]), generator=g), pos

    def features(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if kernel != "dense":
            return target.train_features(ids, pos, kernel)
        with torch.no_grad(), target._attention(None):  # the row at once, its dense mask
            return target._run(ids, pos, None, stop_early=True)[0]

    warm = [row(max(1, docs // 2)), row(max(1, docs // 2 + 1))]
    t0 = time.perf_counter()
    for ids, pos in warm:
        features(ids, pos)
    first_s = time.perf_counter() - t0
    ids, pos = row(docs)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = _status_kib("VmRSS")
    times, feats = [], None
    for _ in range(reps):
        t = time.perf_counter()
        feats = features(ids, pos)
        times.append(time.perf_counter() - t)
    peak = _status_kib("VmHWM")
    assert feats is not None
    torch.save(feats, out.with_suffix(".pt"))
    out.write_text(json.dumps({
        "tokens": int(ids.shape[1]), "warmup_s": first_s, "median_s": statistics.median(times),
        "peak_mib": (peak - base) / 1024,
    }))  # fmt: skip


@click.command()
@click.option("--docs", type=int, default=16, show_default=True, help="Documents in the row.")
@click.option("--doc-len", type=int, default=1024, show_default=True, help="Mean length.")
@click.option("--reps", type=int, default=3, show_default=True)
@click.option("--hidden", type=int, default=256, show_default=True)
@click.option("--worker-kernel", hidden=True)
@click.option("--worker-out", hidden=True, type=click.Path(path_type=Path))
def main(
    docs: int, doc_len: int, reps: int, hidden: int, worker_kernel: str | None,
    worker_out: Path | None,
) -> None:  # fmt: skip
    if worker_kernel:
        assert worker_out is not None
        worker(worker_kernel, docs, doc_len, reps, hidden, worker_out)
        return
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in KERNELS:
            out = Path(tmp) / f"{kernel}.json"
            subprocess.run(
                [sys.executable, __file__, "--docs", str(docs), "--doc-len", str(doc_len),
                 "--reps", str(reps), "--hidden", str(hidden), "--worker-kernel", kernel,
                 "--worker-out", str(out)],
                check=True,
            )  # fmt: skip
            res[kernel] = json.loads(out.read_text())
        import torch

        ref = torch.load(Path(tmp) / "dense.pt")
        diff = {k: float((torch.load(Path(tmp) / f"{k}.pt") - ref).abs().max()) for k in KERNELS}
    d = res["dense"]
    print(
        f"one packed row: {docs} documents, {d['tokens']:,} tokens; random Qwen3, 4 layers, "
        f"hidden {hidden}; CPU, median of {reps}"
    )
    print(f"{'':24}" + "".join(f"{k:>12}" for k in KERNELS)
          + "".join(f"{k + '/dense':>14}" for k in KERNELS[1:]))  # fmt: skip
    for name, key, fmt in (
        ("features s", "median_s", ".3f"),
        ("peak MiB above start", "peak_mib", ".0f"),
        ("warm-up s (compiling)", "warmup_s", ".2f"),
    ):
        vals = [res[k][key] for k in KERNELS]
        ratios = [v / max(vals[0], 1e-9) for v in vals[1:]]
        print(f"{name:<24}" + "".join(f"{v:>12{fmt}}" for v in vals)
              + "".join(f"{r:>14.3f}" for r in ratios))  # fmt: skip
    print("largest feature difference from dense: "
          + ", ".join(f"{k} {diff[k]:.2e}" for k in KERNELS[1:]))  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
