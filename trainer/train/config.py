"""What one run's training loop does (``TrainConfig``): its length, optimizer and schedule,
evaluation and checkpoint cadence, and the guards that stop it. Built from the
``dflash-train train`` options by ``trainer.run``; validated here, once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.model.attention import BACKENDS
from trainer.model.blocks import LossConfig
from trainer.model.loss import DEFAULT_CHUNK_SIZE
from trainer.train.trackers import parse_names


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What the loop does. ``steps`` or ``epochs`` (times the loader's steps per epoch) sets
    the length; ``warmup`` < 1 is a fraction of it, >= 1 a number of steps."""

    run_dir: Path
    loss: LossConfig = field(default_factory=LossConfig)
    steps: int | None = None
    epochs: int | None = None
    grad_accum: int | None = None  # None: the loader's spec decides
    loss_chunk: int = DEFAULT_CHUNK_SIZE  # supervised slots per LM-head chunk (0: unchunked)
    attention: str = "auto"  # drafter attention kernel (trainer.model.attention)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0  # 0: only before the first and after the last step
    eval_new_tokens: int = 64
    eval_batch: int = 16  # prompts per verification forward (trainer.train.evaluation)
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3
    resume: bool = False
    progress: bool = True
    log_every_s: float = 60.0  # progress lines without a terminal (trainer.progress; 0: none)
    cost_samples: int = 2000  # micro-batches per rank timed for calibration (trainer.train.costlog)
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row (0: never)
    max_empty_steps: int = 10  # stop after this many steps in a row without a block (0: never)
    profile_step: int = 0  # profile this step (trainer.train.profile; 0: off)
    peak_tflops: float | None = None  # the chip's bf16 peak for MFU (None: by device name)
    report_to: tuple[str, ...] = ()  # dashboards (trainer.train.trackers; rank 0 only)

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of --steps and --epochs")
        for name in ("steps", "epochs"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name} must be >= 1, got {v}")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 (0: unchunked), got {self.loss_chunk}")
        if self.attention not in BACKENDS:
            raise ValueError(f"attention must be one of {BACKENDS}, got {self.attention!r}")
        if not (self.lr > 0 and self.warmup >= 0 and self.grad_clip > 0):
            raise ValueError(f"bad lr/warmup/grad_clip: {self.lr}, {self.warmup}, {self.grad_clip}")
        if self.cost_samples < 0:
            raise ValueError(f"cost_samples must be >= 0 (0: off), got {self.cost_samples}")
        if self.eval_every < 0 or self.ckpt_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("eval_every and ckpt_every must be >= 0, keep_checkpoints >= 1")
        if self.eval_batch < 1:
            raise ValueError(f"eval_batch must be >= 1, got {self.eval_batch}")
        if self.max_nonfinite_steps < 0 or self.max_empty_steps < 0:
            raise ValueError("max_nonfinite_steps and max_empty_steps must be >= 0 (0: never stop)")
        parse_names(self.report_to)  # an unknown tracker is refused before the run starts

    def total_steps(self, steps_per_epoch: int | None) -> int:
        if self.steps is not None:
            return self.steps
        if not steps_per_epoch:
            raise ValueError("--epochs needs the loader's steps per epoch, which it did not report")
        if self.epochs is None:  # __post_init__: exactly one of steps and epochs
            raise ValueError("give exactly one of steps and epochs")
        return self.epochs * steps_per_epoch

    def warmup_steps(self, total: int) -> int:
        return round(self.warmup * total) if self.warmup < 1 else int(self.warmup)
