"""A long-context export in vLLM's config machinery (run by serve-check, or alone).

    python -m scripts.checks.long_context_check --vllm-python VENV/bin/python [--work DIR]

1. a tiny Qwen3 target whose ``config.json`` has YaRN scaling (x4 over a 1,024-token
   original context, ``max_position_embeddings`` 4,096), saved as a model folder; a drafter
   trained against it for a few steps (the real loop, in process), exported in both
   dialects (fp32);
2. each export read by vLLM (``scripts/checks/vllm_rope_check.py`` in vLLM's virtualenv:
   its engine config with the export as the DFlash speculator, or the speculators folder
   alone) and checked: vLLM's draft config has the target's ``rope_parameters``; its
   ``max_position_embeddings`` and the draft's ``max_model_len`` are the target's 4,096
   (the length engines serve the drafter at); the rotary embedding vLLM's DFlash layers
   build (YaRN's) equals the trainer's drafter's (``trainer.model.rope.rotary``) at every
   one of those positions;
3. a table of the checks; exit status 1 naming what failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.checks.serve_harness import ROOT, Check

ORIGINAL = 1024
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
CONTEXT = 4 * ORIGINAL
BLOCK = 4


def yarn_exports(work: Path) -> tuple[Path, dict[str, Path]]:
    """The YaRN target's folder and a trained drafter's exports, by dialect."""
    import torch

    from trainer.hf.export import export_drafter
    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.target import TinyTargetSpec, build_tiny_model, load_target
    from trainer.options import TargetOptions
    from trainer.run import run_meta
    from trainer.sections import RunOptions
    from trainer.train.batches import ListSource
    from trainer.train.distributed import local_env
    from trainer.train.loop import Trainer

    folder = work / "yarn-target"
    build_tiny_model(TinyTargetSpec(max_positions=CONTEXT, rope_scaling=YARN)).save_pretrained(
        folder
    )
    target = load_target(str(folder), layer_ids=[0, 1, 2])
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=BLOCK, mask_token_id=511
    )
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 511, (n,), generator=g).tolist(), [1] * n) for n in (64, 96, 128)]
    run_dir = work / "run"
    loss = LossConfig(block_size=BLOCK, anchors_per_doc=8)
    tc = RunOptions(endpoint="in-process", run_dir=run_dir, steps=2, no_progress=True,
                    cost_samples=0, **loss.options())  # fmt: skip
    Trainer(
        tc, target=target, drafter=DFlashDrafter(cfg), source=ListSource(docs, rows=3),
        env=local_env(), meta=run_meta(TargetOptions(target=str(folder)), target),
    ).run()  # fmt: skip
    exports = {
        fmt: export_drafter(run_dir, work / f"export-{fmt}", dtype="fp32", fmt=fmt)
        for fmt in ("dflash", "speculators")
    }
    return folder, exports


def vllm_reads(vllm_python: str, target: Path, export: Path, out: Path, log: Path) -> Any:
    import torch

    script = ROOT / "scripts" / "checks" / "vllm_rope_check.py"
    with open(log, "w") as f:
        res = subprocess.run([vllm_python, str(script), str(target), str(export), str(out)],
                             stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"{script.name} on {export.name} exited {res.returncode}: "
                           + log.read_text()[-2000:])  # fmt: skip
    return torch.load(out)


def compare(name: str, got: dict[str, Any]) -> list[Check]:
    """vLLM's reading of one export against the trainer's drafter."""
    import torch

    from trainer.model.rope import rotary

    want = {**YARN, "rope_theta": 10000.0}
    rope = {k: v for k, v in got["rope_parameters"].items() if k in want}
    cache = got["cos_sin_cache"]  # [positions, head_dim]: cos half, then sin half
    half = cache.shape[-1] // 2
    cos, sin = rotary(torch.arange(cache.shape[0]), 2 * half, 10000.0, YARN)
    gap = max(float((cache[:, :half] - cos[:, :half]).abs().max()),
              float((cache[:, half:] - sin[:, :half]).abs().max()))  # fmt: skip
    lengths = (got["max_position_embeddings"], got["draft_max_model_len"], cache.shape[0])
    return [
        Check(f"{name}: vLLM's draft config has the target's RoPE", rope == want,
              f"{got['rope_parameters']} ({got['rotary']}); verifier {got['verifier']}"),
        Check(f"{name}: vLLM serves the drafter to the target's context", lengths == (CONTEXT,) * 3,
              f"max_position_embeddings, draft max_model_len, rotary positions: {lengths}; "
              f"target max_model_len {got['target_max_model_len']}"),
        Check(f"{name}: vLLM's rotary == the trainer's drafter's", gap < 1e-5,
              f"max difference {gap:.2e} over {cache.shape[0]} positions"),
    ]  # fmt: skip


def run(vllm_python: str, work: Path) -> list[Check]:
    """The checks, with everything under ``work`` (made here)."""
    work.mkdir(parents=True, exist_ok=True)
    target, exports = yarn_exports(work)
    checks = []
    for fmt, export in exports.items():
        got = vllm_reads(vllm_python, target, export, work / f"vllm-rope-{fmt}.pt",
                         work / f"vllm-rope-{fmt}.log")  # fmt: skip
        checks += compare(f"long context ({fmt} dialect)", got)
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="Python of the vLLM virtualenv.")
    p.add_argument("--work", type=Path, help="Working folder (kept) [a temporary one].")
    args = p.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="long-context-check-"))).resolve()
    if args.work is not None:
        shutil.rmtree(work, ignore_errors=True)  # a rerun starts afresh
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    checks = run(args.vllm_python, work)
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}  {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed in "
          f"{time.perf_counter() - t0:.1f} s" + (f" (logs: {work})" if failed else ""))  # fmt: skip
    if not failed and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
