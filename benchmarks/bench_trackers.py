"""What ``--report-to tensorboard,wandb,mlflow`` costs the step loop, on the tiny target.

The same in-process run (tiny target, 1-layer drafter, block 8, 4 rows of 48 tokens per
step, no evaluation) once with no tracker and once with the ones named, each in a fresh
run folder: the loop's wall time per step (``wall_steps_per_s`` of the summary) and the time
spent in ``Trackers.log`` itself, per call; the median time between two steps' records over
the run's second half (the trackers start on their own thread while the first steps run,
which the whole run's wall time includes). W&B runs offline and MLflow to the run folder's
file store, so nothing leaves the machine.

    python benchmarks/bench_trackers.py [--steps 200] [--report-to tensorboard,wandb,mlflow]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def run(steps: int, report_to: str, run_dir: Path) -> dict[str, Any]:
    import torch

    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.target import load_target
    from trainer.sections import RunOptions
    from trainer.train.batches import ListSource
    from trainer.train.distributed import local_env
    from trainer.train.loop import Trainer
    from trainer.train.metrics import metrics_path, read_metrics
    from trainer.train.trackers import Trackers

    torch.set_num_threads(1)
    target = load_target("tiny")
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 511, (48,), generator=g).tolist(), [0] * 8 + [1] * 40)
               for _ in range(64)]  # fmt: skip
    cfg = RunOptions(
        endpoint="in-process", run_dir=run_dir, steps=steps, lr=3e-3, warmup=2,
        no_progress=True, cost_samples=0, ckpt_every=0,
        report_to=(report_to,) if report_to else (),
        **LossConfig(block_size=8, anchors_per_doc=6).options(),
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(
        DrafterConfig.from_target(target.config, num_target_layers=3, block_size=8,
                                  mask_token_id=511)
    )  # fmt: skip
    calls: list[float] = []
    log = Trackers.log

    def timed(self: Trackers, step: int, record: Mapping[str, Any]) -> None:
        t0 = time.perf_counter()
        log(self, step, record)
        calls.append(time.perf_counter() - t0)

    Trackers.log = timed  # type: ignore[method-assign]
    try:
        trainer = Trainer(cfg, target=target, drafter=drafter, source=ListSource(samples, rows=4),
                          env=local_env())  # fmt: skip
        summary = trainer.run()
    finally:
        Trackers.log = log  # type: ignore[method-assign]
    stamps = [r["time"] for r in read_metrics(metrics_path(run_dir)) if "time" in r]
    half = stamps[len(stamps) // 2 :]
    gaps = sorted(b - a for a, b in itertools.pairwise(half))
    return {
        "report_to": report_to or "none",
        "wall_ms_per_step": 1000 / summary["wall_steps_per_s"],
        "median_ms_per_step_2nd_half": 1000 * gaps[len(gaps) // 2],
        "log_ms_per_call": 1000 * sum(calls) / max(len(calls), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--report-to", default="tensorboard,wandb,mlflow")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(args.steps, names, Path(tmp) / f"run{i}")
                for i, names in enumerate(("", args.report_to))]  # fmt: skip
    rows.append(
        {k: rows[1][k] - rows[0][k] for k in ("wall_ms_per_step", "median_ms_per_step_2nd_half")}
    )
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
