"""What each micro-batch cost this trainer: the measurements ``dflash-train calibrate`` fits.

Every rank appends one JSON line per micro-batch to ``RUN_DIR/costs/rank{R}.jsonl`` for
its first ``cost_samples`` micro-batches (``--cost-samples``; 0: off), after the first
``WARMUP_STEPS`` optimizer steps of the process (allocator growth, kernel autotuning and
lazy initialisation make those unrepresentative). A line holds what the planner's cost
model needs (``layout``, the documents' lengths, the trainer's anchor rule, the kernel its
packed rows ran under) and the measured compute time: forward and backward of that
micro-batch, the data wait excluded, synchronized on CUDA so the time is the GPU's and not
the launch queue's. ``synced`` marks the micro-batch whose backward all-reduces gradients
(the last of a step under DDP): its time includes waiting for the slowest rank, so
calibration leaves those out when it can.

Lines are written with the step and flushed at every optimizer step; a resumed run appends,
and calibration keeps the last line of each ``(rank, epoch, step, micro)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch

from client.batch import Batch
from trainer.model.doc_view import DocView
from trainer.train.cost_records import make_record, rank_file

#: Optimizer steps of each process that are not recorded (warm-up).
WARMUP_STEPS = 2


class CostLog:
    """One rank's micro-batch timings (``start`` / ``stop`` around forward+backward)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        limit: int,
        rule: Sequence[int],
        device: torch.device | str,
        attention: str = "documents",
    ) -> None:
        self.limit, self.rule, self.device = limit, list(rule), torch.device(device)
        self.attention = attention  # the packed rows' kernel: a packed_attention value
        self.path = rank_file(run_dir, rank)
        self.rank = rank
        self.written = 0
        self.steps_seen = 0
        self._file: IO[str] | None = None
        self._t0 = 0.0

    @property
    def active(self) -> bool:
        return self.written < self.limit and self.steps_seen >= WARMUP_STEPS

    def start(self) -> None:
        if self.active:
            self._sync()
            self._t0 = time.perf_counter()

    def stop(self, batch: Batch, *, anchors: int, synced: bool) -> None:
        """Record the micro-batch timed since ``start`` (no-op when not recording)."""
        if not self.active:
            return
        self._sync()
        elapsed = time.perf_counter() - self._t0
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        line = make_record(
            rank=self.rank,
            position=(int(batch.epoch), int(batch.step), int(batch.micro)),
            layout=batch.layout,
            doc_lengths=DocView.of(batch).length.tolist(),
            rule=self.rule,
            anchors=int(anchors),
            synced=bool(synced),
            time_s=elapsed,
            attention=self.attention,
        )
        self._file.write(line)
        self.written += 1

    def end_step(self) -> None:
        self.steps_seen += 1
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
