"""The trainer at real scale on one GPU (run by ``scripts/checks/gpu_check.sh``).

Stages, each writing its figures to ``OUT/gpu_check.json`` as soon as it has them:

1. ``env``: GPU, torch, transformers; ``load``: a 2 GB fp32 checkpoint onto the GPU in
   bf16 the trainer's way (``trainer/model/weights.py``) and ``from_pretrained``'s: host
   memory, GPU peak, time, same weights.
   ``shard``: the same checkpoint with its decoder layers sharded (``--target-shard``,
   ``trainer/model/sharding.py``) over every GPU of the machine (FSDP over a world of one
   on a single GPU: the CUDA path, meta build, slice reads, prefetch, without the memory
   gain), against whole, each rank: GPU peak, host memory, load time, features time, the
   features' largest difference (``scripts/checks/target_shard.py``).
2. ``head``: peak CUDA memory and time of the LM head + weighted cross-entropy, forward and
   backward, at hidden 4096 and vocabulary 151,936 in bf16, chunked (1024 slots) vs
   unchunked, for one document at the reference recipe (512 anchors x 15 slots) and for the
   default per-micro-batch anchor cap (2048 x 15).
3. ``copy_rule``: the daemon serves a synthetic corpus (Qwen3 vocabulary); a client copies
   every batch to the GPU with ``non_blocking=True`` and compares it, after the slot went
   back to the daemon, with a CPU copy taken before.
4. ``train``: ``dflash-train train`` with a random-weight target of Qwen3-8B's shape (36
   layers, hidden 4096, 32/8 heads, MLP 12288, vocabulary 151,936) in bf16 and a 1-layer
   drafter, at the daemon's default spec and the trainer's defaults, for 30 steps: step
   time, tokens/s, anchors/s, peak GPU memory, data wait (``auto``: flex_attention), and
   step 5 profiled (``--profile-step``: each phase's device time and share, the step's
   FLOPs and MFU, ``trainer/train/profile.py``); then half as many steps with
   ``--attention sdpa`` for comparison.
5. ``long_context``: one 32,768-token sample per micro-batch (``--long-seq``), the same
   Qwen3-8B-shaped target and drafter at the trainer's defaults, the loop in process (no
   daemon) for 3 steps: step times, peak GPU memory, and the memory formula's prediction
   for it (``scripts/checks/long_memory.py``, docs/GUIDE.md "Long context").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

QWEN3_8B = {
    "--tiny-vocab": "151936",
    "--tiny-layers": "36",
    "--tiny-hidden": "4096",
    "--tiny-heads": "32",
    "--tiny-kv-heads": "8",
    "--tiny-intermediate": "12288",
}


class Report:
    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_check.json"
        self.data: dict[str, object] = {}

    def put(self, stage: str, values: dict[str, object]) -> None:
        self.data[stage] = values
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")
        print(f"== {stage}: {json.dumps(values)}", flush=True)

    def run(self, stage: str, fn, *args) -> object:
        t0 = time.perf_counter()
        try:
            values = fn(*args)
        except BaseException as e:  # a failed stage is a figure too; go on to the next
            traceback.print_exc()
            self.put(stage, {"error": f"{type(e).__name__}: {e}"[:2000]})
            if isinstance(e, KeyboardInterrupt):
                raise
            return None
        values["stage_s"] = round(time.perf_counter() - t0, 1)
        self.put(stage, values)
        return values


def env_stage() -> dict[str, object]:
    import transformers

    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "gpu_mem_gb": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def head_stage() -> dict[str, object]:
    from trainer.model.loss import head_loss

    dev = torch.device("cuda")
    hidden, vocab = 4096, 151936
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev, dtype=torch.bfloat16)
    head.requires_grad_(False)
    out: dict[str, object] = {}
    for anchors in (512, 2048):
        n = anchors * 15
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        labels = torch.randint(0, vocab, (n,), device=dev, generator=g)
        w = torch.rand(n, device=dev, generator=g)
        for chunk in (1024, 0):
            key = f"{anchors}_anchors_{'chunked' if chunk else 'unchunked'}"
            try:
                peak, secs = _measure_head(head_loss, h, head, labels, w, chunk)
                out[key] = {"peak_gb": round(peak, 2), "ms": round(secs * 1e3, 1)}
            except torch.OutOfMemoryError:
                out[key] = "out of memory"
            torch.cuda.empty_cache()
    return out


def _measure_head(fn, h, head, labels, w, chunk) -> tuple[float, float]:
    torch.cuda.synchronize()
    for _ in range(3):  # the first run warms up kernels; report the last
        x = h.detach().requires_grad_(True)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            total = (fn(x, head, labels, chunk).ce * w).sum()
        total.backward()
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        del x, total
    return peak, secs


def attention_stage() -> dict[str, object]:
    """Compiled flex_attention (BlockMask) against SDPA with the dense chunk mask, bf16, on
    one chunk of 64 blocks of 16 over an 8,192-token document: agreement and time."""
    from trainer.model.attention import BlockChunk, LayerRule, block_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n_ctx, b = 8192, 16
    anchors = torch.sort(torch.randperm(n_ctx - b, device=dev, generator=g)[:64]).values
    chunk = BlockChunk(
        torch.zeros(n_ctx, dtype=torch.long, device=dev),
        torch.arange(n_ctx, device=dev),
        torch.zeros(64, dtype=torch.long, device=dev),
        anchors,
        b,
    )
    q = torch.randn(1, 32, chunk.num_queries, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, chunk.num_keys, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    out: dict[str, object] = {}
    results = {}
    for backend in ("sdpa", "flex"):
        for rep in range(4):  # the first call compiles (flex); each rep builds its mask anew
            fresh = replace(chunk)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if backend == "flex":
                fresh.block_mask()
            else:
                fresh.per_document()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            results[backend] = block_attention(q, k, v, fresh, backend)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if rep == 0:
                out[f"{backend}_first_ms"] = round((t2 - t0) * 1e3, 1)
        out[f"{backend}_mask_ms"] = round((t1 - t0) * 1e3, 2)
        out[f"{backend}_kernel_ms"] = round((t2 - t1) * 1e3, 2)
    diff = (results["flex"].float() - results["sdpa"].float()).abs().max()
    out["max_abs_diff"] = float(diff)
    # A sliding layer (2,048-token window, the z-lab drafters'): the compiled BlockMask of
    # that rule against SDPA's, on the same chunk.
    rule = LayerRule(window=2048)
    sliding = {be: block_attention(q, k, v, replace(chunk), be, rule) for be in ("sdpa", "flex")}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block_attention(q, k, v, replace(chunk), "flex", rule)
    torch.cuda.synchronize()
    out["sliding_flex_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    gap = (sliding["flex"].float() - sliding["sdpa"].float()).abs().max()
    out["sliding_max_abs_diff"] = float(gap)
    return out


def start_daemon(work: Path) -> tuple[subprocess.Popen, str]:
    corpus = work / "corpus.arrow"
    if not corpus.exists():
        subprocess.run(
            [sys.executable, "-m", "loader_server", "synth", str(corpus), "--samples", "6000",
             "--median-len", "1500", "--max-len", "8192", "--vocab-size", "151936",
             "--content", "learnable"],
            check=True,
        )  # fmt: skip
    endpoint = f"ipc://{work}/loader.sock"
    shm = work / "shm"
    shm.mkdir(exist_ok=True)
    os.environ["DFLASH_LOADER_SHM_DIR"] = str(shm)  # this process's and the trainers' clients
    with open(work / "daemon.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "loader_server", "serve", "--dataset", str(corpus),
             "--endpoint", endpoint, "--shm-dir", str(shm)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while b"READY" not in (work / "daemon.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((work / "daemon.log").read_text()[-2000:])
        time.sleep(0.2)
    return proc, endpoint


def copy_stage(endpoint: str) -> dict[str, object]:
    from client import LoaderClient

    checked = mismatched = 0
    with LoaderClient(endpoint, job="copy-check", rank=0, world_size=1) as client:
        it = iter(client)
        prev = None
        t0 = time.perf_counter()
        for _ in range(60):
            batch = next(it)  # a private (pinned) copy: the ring slot is already free again
            if prev is not None:
                ref, on_gpu = prev
                same = torch.equal(on_gpu.input_ids.cpu(), ref.input_ids) and torch.equal(
                    on_gpu.loss_mask.cpu(), ref.loss_mask
                )
                checked += 1
                mismatched += not same
            ref = batch.clone()
            on_gpu = batch.to("cuda", non_blocking=True)
            prev = (ref, on_gpu)
        secs = time.perf_counter() - t0
    return {"batches_checked": checked, "mismatched": mismatched, "s": round(secs, 2)}


def train_stage(
    endpoint: str, work: Path, steps: int, attention: str = "auto", drafter: str = "dflash"
) -> dict[str, object]:
    """``steps`` of the Qwen3-8B-shaped run; ``drafter`` dflash2: the same with DFlash2's
    reference shape (convolutions, rank-256 top-16 selector over the 151,936 tokens)."""
    tag = attention if drafter == "dflash" else f"{attention}-{drafter}"
    run_dir = work / f"run-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun on the same machine starts afresh
    cmd = [
        sys.executable, "-m", "trainer.cli", "train", "--endpoint", endpoint,
        "--run-dir", str(run_dir), "--target", "tiny",
        *[x for kv in QWEN3_8B.items() for x in kv],
        "--steps", str(steps), "--num-eval-prompts", "2", "--eval-new-tokens", "16",
        "--no-progress", "--attention", attention, "--job", f"gpu-check-{tag}",
        "--profile-step", str(min(steps, 5)),  # a steady-state step, profiled
        "--drafter", drafter,
    ]  # fmt: skip
    t0 = time.perf_counter()
    log_path = work / f"train-{tag}.log"
    with open(log_path, "wb") as log:
        res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=330)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("loss") is not None or r.get("tokens")]
    if res.returncode != 0 or not train:
        raise RuntimeError(log_path.read_text(errors="replace")[-3000:])
    steady = train[3:] or train
    spec = json.loads((run_dir / "loader_spec.json").read_text())

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in steady), 4)

    return {
        "steps": len(train),
        "wall_s": round(wall, 1),
        "first_step_s": round(train[0]["step_time_s"], 2),
        "step_time_s": med("step_time_s"),
        "tokens_per_s": med("tokens_per_s"),
        "anchors_per_s": med("anchors_per_s"),
        "anchors_per_micro": med("anchors_per_micro"),
        "data_wait_frac": med("data_wait_frac"),
        "gpu_mem_peak_gb": max(r["gpu_mem_peak_gb"] for r in train),
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
        "tau": [r.get("tau") for r in recs if "tau" in r],
        "spec": {k: spec[k] for k in ("token_budget", "max_batch_size", "max_seq_len")},
        # where the profiled step's time went, its FLOPs and MFU (trainer/train/profile.py)
        "profile": json.loads((run_dir / "profile.json").read_text()),
    }


def long_stage(
    work: Path, seq: int, steps: int = 3, device: str = "cuda", shape: str = "QWEN3_8B"
) -> dict[str, object]:
    """``steps`` training steps of one ``seq``-token document each (see the docstring);
    ``device`` cpu and ``shape`` LONG_SHAPE: the same code as a smoke run on CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts.checks import long_memory
    from scripts.checks.long_memory import memory_terms

    sh, dev = getattr(long_memory, shape), torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run_dir = work / f"run-long-{seq}"
    t0 = time.perf_counter()
    _train_long(sh, dev, seq, steps, run_dir)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("loss") is not None or r.get("tokens")]
    size = 2 if cuda else 4
    terms = memory_terms(sh, seq, weight_bytes=size, act_bytes=size,
                         attention="flex" if cuda else "sdpa")  # fmt: skip
    whole = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {
        "seq": seq,
        "steps": len(train),
        "wall_s": round(wall, 1),
        "step_time_s": [round(r["step_time_s"], 2) for r in train],
        "gpu_mem_peak_gb": max(r["gpu_mem_peak_gb"] for r in train),
        "gpu_mem_peak_whole_stage_gib": None if whole is None else round(whole, 2),
        "predicted_peak_gib": round(terms["peak"] / 2**30, 2),
        "predicted_terms_gib": {k: round(v / 2**30, 2) for k, v in terms.items()},
        "loss_first": train[0]["loss"],
        "loss_last": train[-1]["loss"],
    }


def _train_long(sh: Any, dev: torch.device, seq: int, steps: int, run_dir: Path) -> None:
    """The target (bf16 on a GPU) and a drafter of ``sh``'s shape, trained by the loop on
    ``steps`` random ``seq``-token documents, one per micro-batch, into ``run_dir``."""
    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model
    from trainer.options import TargetOptions
    from trainer.run import run_meta
    from trainer.sections import RunOptions
    from trainer.train.batches import ListSource
    from trainer.train.distributed import local_env
    from trainer.train.loop import Trainer

    spec = TinyTargetSpec(
        vocab_size=sh.vocab, hidden_size=sh.hidden, num_layers=sh.layers, num_heads=sh.heads,
        num_kv_heads=sh.kv_heads, intermediate_size=sh.intermediate,
        max_positions=max(40960, seq),
    )  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = Target(build_tiny_model(spec, dev, dtype), list(sh.feature_layers))
    cfg = DrafterConfig.from_target(target.config, num_target_layers=len(sh.feature_layers),
                                    mask_token_id=sh.vocab - 1)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, sh.vocab - 1, (seq,), generator=g).tolist(), [1] * seq)
            for _ in range(steps)]  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)
    loss = LossConfig(block_size=sh.block, anchors_per_doc=sh.anchors_per_doc,
                      tokens_per_anchor=sh.tokens_per_anchor)  # fmt: skip
    tc = RunOptions(endpoint="in-process", run_dir=run_dir, steps=steps,
                    loss_chunk=sh.loss_chunk, no_progress=True, cost_samples=0,
                    **loss.options())  # fmt: skip
    Trainer(
        tc, target=target, drafter=DFlashDrafter(cfg).to(dev), source=ListSource(docs, rows=1),
        env=local_env(str(dev)), meta=run_meta(TargetOptions(), target),
    ).run()  # fmt: skip


def load_stage(work: Path) -> dict[str, object]:
    """A local target onto the GPU (trainer/model/weights.py) against ``from_pretrained``
    and ``.to(cuda)``: a 2 GB fp32 checkpoint loaded in bf16, each in a fresh process:
    host memory beyond the baseline, GPU peak, time, and the same weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts.checks.target_load import measure
    from scripts.fixtures.random_qwen3 import save_random

    path = work / "target-fp32"
    if not (path / "config.json").is_file():
        save_random(path, "float32", hidden=2048, layers=8, vocab=32000)
    out: dict[str, object] = {}
    sums = {}
    for mode in ("plain", "ours"):
        r = measure(path, mode, "bfloat16", "cuda:0")
        sums[mode] = r["checksum"]
        out[mode] = {
            "seconds": round(r["seconds"], 2),
            "host_extra_mib": round(r["extra"] / 2**20),
            "gpu_peak_mib": round(r["gpu_peak"] / 2**20),
            "weights_mib": round(r["weights"] / 2**20),
        }
    out["same_weights"] = sums["plain"] == sums["ours"]
    return out


def shard_stage(work: Path) -> dict[str, object]:
    """The ``load`` stage's checkpoint whole and sharded over the GPUs (``--target-shard``),
    in bf16, 512 tokens per rank and forward: per rank figures, sharded / whole."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts.checks.target_shard import measure
    from scripts.fixtures.random_qwen3 import save_random

    path = work / "target-fp32"
    if not (path / "config.json").is_file():
        save_random(path, "float32", hidden=2048, layers=8, vocab=32000)
    ranks = min(torch.cuda.device_count(), 8)
    out: dict[str, object] = {"ranks": ranks}
    runs = {}
    for mode in ("whole", "sharded"):
        runs[mode] = recs = measure(path, mode, "bfloat16", "cuda", ranks, work / f"{mode}.json")
        out[mode] = [
            {"gpu_peak_mib": round(r["gpu_peak"] / 2**20), "layers_mib": round(r["layers_local"]
             / 2**20), "host_extra_mib": round(r["host_extra"] / 2**20),
             "load_s": round(r["load_s"], 2), "forward_ms": round(r["forward_s"] * 1e3, 1),
             **({"max_diff": r["max_diff"]} if "max_diff" in r else {})}
            for r in recs
        ]  # fmt: skip
    worst = {m: max(r["forward_s"] for r in recs) for m, recs in runs.items()}
    out["forward_ratio"] = round(worst["sharded"] / worst["whole"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-sdpa", action="store_true", help="Skip the SDPA comparison run.")
    ap.add_argument("--no-dflash2", action="store_true", help="Skip the DFlash2 run.")
    ap.add_argument("--no-shard", action="store_true", help="Skip the sharded-target stage.")
    ap.add_argument("--long-seq", type=int, default=32768, help="Long-context stage (0: skip).")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "dflash-gpu-check"
    work.mkdir(exist_ok=True)
    report = Report(args.out)
    report.run("env", env_stage)
    report.run("head", head_stage)
    report.run("attention", attention_stage)
    report.run("load", load_stage, work)
    if not args.no_shard:
        report.run("shard", shard_stage, work)
    daemon = None
    try:
        daemon, endpoint = start_daemon(work)
        report.run("copy_rule", copy_stage, endpoint)
        report.run("train", train_stage, endpoint, work, args.steps)
        if not args.no_dflash2:
            report.run("train_dflash2", train_stage, endpoint, work, args.steps // 2, "auto",
                       "dflash2")  # fmt: skip
        if not args.no_sdpa:
            report.run("train_sdpa", train_stage, endpoint, work, args.steps // 2, "sdpa")
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=30)
        for log in [work / "daemon.log", *work.glob("train*.log")]:
            (args.out / log.name).write_text(log.read_text(errors="replace")[-200_000:])
    if args.long_seq:  # in process, after the daemon's runs (their memory is released)
        report.run("long_context", long_stage, work, args.long_seq)
    print(json.dumps(report.data, indent=2))


if __name__ == "__main__":
    main()
