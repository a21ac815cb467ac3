"""``speculators train`` (vllm-project/speculators 0.9) on a CPU-only torch, for
``benchmarks/bench_vs_speculators.py``. Run with the interpreter that has speculators (the
serve-check virtualenv):

    VENV/bin/python benchmarks/peer/speculators_cpu.py RESULT.json -- SPECULATORS_TRAIN_FLAGS...

The flags after ``--`` go to speculators' own ``TrainConfig.resolve`` and ``cli.main``
unchanged. The installed package is never edited: only what a torch without an accelerator
needs is replaced at run time, each replacement printed as it is made (``PATCHES``):

* P1 ``speculators.train.trainer.get_local_rank`` -> the CPU device: the trainer moves the
  model and every batch with ``.to(self.local_rank)``, and the integer 0 means accelerator 0;
* P2 ``torch.accelerator.synchronize`` -> nothing when there is no accelerator: the step
  timer calls it on every logged step;
* P3 ``Trainer.device_type`` -> ``"cpu"``: it falls back to ``"cuda"`` for ``torch.autocast``;
* P4 ``speculators.train.checkpointer.get_current_device`` -> ``"cpu"``: the map_location
  of a resumed checkpoint.

The run's records (what speculators logs to its ``speculators.metrics`` logger: loss,
accuracies, ``profile.step_ms`` and ``profile.tokens_per_s`` per step) are kept, and
``RESULT.json`` gets them with the wall time of ``cli.main`` and this process's peak RSS
(speculators logs no host memory).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from typing import Any

import torch

PATCHES = (
    ("P1", "speculators.train.trainer.get_local_rank -> torch.device('cpu')"),
    ("P2", "torch.accelerator.synchronize -> no-op without an accelerator"),
    ("P3", "speculators.train.trainer.Trainer.device_type -> 'cpu' (torch.autocast)"),
    ("P4", "speculators.train.checkpointer.get_current_device -> 'cpu' (resume)"),
)


def apply_cpu_patches() -> list[str]:
    """The replacements of ``PATCHES`` (none with an accelerator); the lines applied."""
    if torch.accelerator.is_available():
        return []
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: torch.device("cpu")
    synchronize = torch.accelerator.synchronize

    def _synchronize(*args: Any, **kwargs: Any) -> None:
        if torch.accelerator.is_available():
            synchronize(*args, **kwargs)

    torch.accelerator.synchronize = _synchronize
    init = trainer.Trainer.__init__

    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = _init
    checkpointer.get_current_device = lambda: "cpu"
    return [f"{name} {what}" for name, what in PATCHES]


class _Records(logging.Handler):
    """The dicts speculators logs to ``speculators.metrics``, kept in order."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            self.records.append(json.loads(json.dumps(record.msg, default=float)))


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit(f"usage: {sys.argv[0]} RESULT.json -- SPECULATORS_TRAIN_FLAGS...")
    result, flags = sys.argv[1], sys.argv[3:]
    applied = apply_cpu_patches()
    for line in applied:
        print(f"[speculators_cpu] patch {line}", flush=True)
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    records = _Records()
    setup = cli.setup_metric_logger

    def _setup(*args: Any, **kwargs: Any) -> Any:  # it resets the logger's handlers
        out = setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(records)
        return out

    cli.setup_metric_logger = _setup
    config = TrainConfig.resolve(flags)
    t0 = time.perf_counter()
    cli.main(config)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    out = {"wall_s": wall, "rss_peak_gb": peak, "patches": applied, "threads":
           torch.get_num_threads(), "records": records.records}  # fmt: skip
    with open(result, "w") as f:
        json.dump(out, f)
    print(f"[speculators_cpu] wall {wall:.1f} s, peak RSS {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
