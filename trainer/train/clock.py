"""The data clock and the LR schedule it drives.

The schedule (linear warm-up, then cosine) is a function of how much data the run has
trained on, not of how many optimizer steps it took: a run resumed on another number of
ranks (or another ``grad_accum``) takes steps of another size, and counting steps would
make its LR jump. So the clock counts micro-batches over all ranks (each one token
budget) and reads them in steps of the shape the run started with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: ``--lr-schedule``: how the rate falls after the warm-up.
SCHEDULES = ("cosine", "linear")


def lr_factor(
    schedule: str, warmup: int, total: int, min_ratio: float = 0.0
) -> Callable[[float], float]:
    """LR multiplier: a linear ramp over ``warmup`` steps, then down to ``min_ratio`` at
    ``total``, along a cosine or a straight line (``SCHEDULES``; speculators' is linear).
    ``step`` may be fractional (``Clock.steps``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}: one of {', '.join(SCHEDULES)}")

    def factor(step: float) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        fall = 1.0 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * fall

    return factor


@dataclass
class Clock:
    """How far training is, for the LR schedule and the end of a run: micro-batches consumed
    over all ranks (``micro``), in steps of the shape the run started with (``unit``
    micro-batches each: world size x grad_accum). A run that keeps its shape has
    ``steps == step``, so its schedule is the plain step schedule; one resumed on other
    ranks continues from the data consumed (each micro-batch is one token budget), so its
    LR does not jump. ``steps_per_epoch`` is the first shape's, which turns ``--epochs``
    into steps."""

    micro: int = 0
    unit: int = 1
    steps_per_epoch: int = 0

    @property
    def steps(self) -> float:
        return self.micro / self.unit

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Clock:
        clock = cls(**{k: int(d[k]) for k in ("micro", "unit", "steps_per_epoch")})
        if clock.micro < 0 or clock.unit < 1 or clock.steps_per_epoch < 0:
            raise ValueError(f"bad LR clock in the checkpoint: {d}")
        return clock


@dataclass(frozen=True)
class SavedClock:
    """What a resumed checkpoint says of its clock: the clock itself (None for checkpoints
    written before clocks), and the shape it was trained in (its world size and its loader
    spec's grad_accum), which rebuilds a missing clock."""

    clock: dict[str, Any] | None
    world_size: int
    grad_accum: int


def start_clock(
    saved: SavedClock | None,
    *,
    step: int,
    shape: int,
    steps_per_epoch: int,
    legs: Sequence[Sequence[int]] = (),
) -> Clock:
    """The clock a run continues: the checkpoint's, one rebuilt for a checkpoint written
    before clocks (at ``step`` steps of its own shape), or a new one. ``shape`` is this
    run's micro-batches per step, ``steps_per_epoch`` what the loader now plans for it and
    ``legs`` the epoch's earlier shapes (``(steps, world_size, grad_accum)`` each)."""
    if saved is None:
        return Clock(0, shape, steps_per_epoch)
    if saved.clock is not None:
        return Clock.from_dict(saved.clock)
    unit = saved.world_size * saved.grad_accum
    per_epoch = steps_per_epoch
    if unit != shape:
        # The first shape's epoch, in micro-batches: what the legs of this epoch served
        # plus the rest the loader now plans for this shape.
        served = sum(leg[0] * leg[1] * leg[2] for leg in legs)
        per_epoch = round((served + steps_per_epoch * shape) / unit)
    return Clock(step * unit, unit, per_epoch)


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    clock: Clock,
    factor: Callable[[float], float],
    state: dict[str, Any] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule read off ``clock`` (the live object: the loop advances it), with a
    resumed run's scheduler ``state`` put back."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: factor(clock.steps))
    if state is not None:
        scheduler.load_state_dict(state)
        # Building the scheduler stepped it once (step 0's LR); put back the saved LR.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    return scheduler
