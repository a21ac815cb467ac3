"""A local target loaded whole or sharded (``--target-shard``, ``trainer.model.sharding``),
measured on every rank, under torchrun:

    python -m torch.distributed.run --nproc-per-node N -m scripts.checks.target_shard \\
        DIR whole|sharded DTYPE DEVICE OUT.json [TOKENS REPS]

Each rank: the seconds of the load, its peak host memory beyond its own baseline (VmHWM
reset just before the load), its GPU peak, and its parameter bytes (decoder layers here
and in all, the replicated rest); then ``train_features`` of TOKENS tokens of its own, REPS
times after one warm-up (median seconds); sharded, also the largest difference of those
features from the whole target's (loaded afterwards, on the same rank). Rank 0 writes
OUT.json, one record per rank. ``measure`` runs it: the figures of
``python benchmarks/bench_target_shard.py`` (CPU) and of the GPU check's ``shard`` stage
(``scripts/checks/gpu_check.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def measure(
    path: Path, mode: str, dtype: str, device: str, ranks: int, out: Path, tokens: int = 512,
    reps: int = 3,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run the measurement on ``ranks`` processes; one record per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), "-m", "scripts.checks.target_shard", str(path), mode, dtype, device,
           str(out), str(tokens), str(reps)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-2000:] + res.stderr[-4000:])
    return json.loads(out.read_text())


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401  # before the baseline

    from trainer.model.sharding import param_bytes, sharder
    from trainer.model.target import load_target

    path, mode, dtype_name, device_kind, out = argv[:5]
    tokens, reps = int(argv[5]), int(argv[6])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if device_kind.startswith("cuda") else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    shard = sharder(device) if mode == "sharded" else None
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from here
    before, t0 = _status("VmRSS"), time.perf_counter()
    target = load_target(path, device=device, dtype=dtype, shard=shard)  # 5 layers spread
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rec: dict[str, Any] = {"rank": rank, "mode": mode, "load_s": time.perf_counter() - t0,
                           "host_extra": _status("VmHWM") - before}  # fmt: skip
    rec["gpu_peak"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    rec.update(vars(param_bytes(target.model)))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, target.vocab_size, (1, tokens), generator=g).to(device)
    rec["forward_s"], feats = _time_features(target, ids, reps)
    if shard is not None:
        whole = load_target(path, device=device, dtype=dtype)
        rec["max_diff"] = float((whole.train_features(ids) - feats).abs().max())
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, rec)
    if rank == 0:
        Path(out).write_text(json.dumps(table, indent=1) + "\n")
    dist.destroy_process_group()


def _time_features(target: Any, ids: Any, reps: int) -> tuple[float, Any]:
    import torch

    times, feats = [], None
    for i in range(reps + 1):
        t0 = time.perf_counter()
        feats = target.train_features(ids)
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times), feats


if __name__ == "__main__":
    _main(sys.argv[1:])
