"""The target's forward over one packed row (``train_features``), SDPA against flex_attention.

    .venv/bin/python benchmarks/bench_packed_target.py [--docs 16 --doc-len 1024 --reps 3]

A packed row holds several documents end to end (``position_ids`` restart at 0 for each).
Under SDPA, Transformers splits it with a dense ``[T, T]`` mask, so memory and attention
work grow with the square of the whole row; under flex_attention (``--attention flex``,
the default on CUDA) a block mask skips every tile between documents. Each kernel runs in
a fresh process on the same random-weight Qwen3 and the same row (lengths drawn around
``--doc-len``): after two warm-up calls (flex compiles; a second shape compiles its
dynamic kernel), the median of ``--reps`` calls and the peak resident memory above the
process's resident memory before them (the kernel's own, not the model's). The features
of the two are compared.
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

    warm = [row(max(1, docs // 2)), row(max(1, docs // 2 + 1))]
    t0 = time.perf_counter()
    for ids, pos in warm:
        target.train_features(ids, pos, kernel)
    first_s = time.perf_counter() - t0
    ids, pos = row(docs)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = _status_kib("VmRSS")
    times, feats = [], None
    for _ in range(reps):
        t = time.perf_counter()
        feats = target.train_features(ids, pos, kernel)
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
        for kernel in ("sdpa", "flex"):
            out = Path(tmp) / f"{kernel}.json"
            subprocess.run(
                [sys.executable, __file__, "--docs", str(docs), "--doc-len", str(doc_len),
                 "--reps", str(reps), "--hidden", str(hidden), "--worker-kernel", kernel,
                 "--worker-out", str(out)],
                check=True,
            )  # fmt: skip
            res[kernel] = json.loads(out.read_text())
        import torch

        diff = (torch.load(Path(tmp) / "sdpa.pt") - torch.load(Path(tmp) / "flex.pt")).abs().max()
    s, f = res["sdpa"], res["flex"]
    print(
        f"one packed row: {docs} documents, {s['tokens']:,} tokens; random Qwen3, 4 layers, "
        f"hidden {hidden}; CPU, median of {reps}"
    )
    print(f"{'':24}{'sdpa':>12}{'flex':>12}{'flex/sdpa':>12}")
    print(f"{'features s':<24}{s['median_s']:>12.3f}{f['median_s']:>12.3f}"
          f"{f['median_s'] / s['median_s']:>12.3f}")  # fmt: skip
    print(f"{'peak MiB above start':<24}{s['peak_mib']:>12.0f}{f['peak_mib']:>12.0f}"
          f"{f['peak_mib'] / max(s['peak_mib'], 1e-9):>12.3f}")  # fmt: skip
    print(f"{'warm-up s (compiling)':<24}{s['warmup_s']:>12.2f}{f['warmup_s']:>12.2f}")
    print(f"largest feature difference: {float(diff):.2e}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
