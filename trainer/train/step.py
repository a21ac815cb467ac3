"""One optimizer step's numbers: the sums every rank adds up (``StepSums``, one all-reduce),
the values whose maximum over ranks is reported (``StepPeaks``, one max all-reduce), and what
a step hands the loop to record (``StepResult``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from trainer.model.loss import LossOutput

_PER_OFFSET = {"per_offset": True}  # a StepSums field with one value per block offset 1..B-1


@dataclass(kw_only=True)
class StepSums:
    """One optimizer step's sums on this rank, added over ranks by one all-reduce of
    ``to_tensor()``: float64, the fields in this order, each a scalar except the
    ``per_offset`` ones (``B - 1`` values). Accumulated on the model's device (no host sync)."""

    ce: torch.Tensor  # weighted block cross-entropy
    weight: torch.Tensor  # the weights of that cross-entropy
    tokens: torch.Tensor  # real tokens
    blocks: torch.Tensor  # anchors trained on
    capped: torch.Tensor  # anchors drawn but dropped by the per-micro-batch cap
    micro: torch.Tensor  # micro-batches
    correct: torch.Tensor = field(metadata=_PER_OFFSET)  # argmax hits per block offset
    count: torch.Tensor = field(metadata=_PER_OFFSET)  # supervised slots per block offset
    step_time: torch.Tensor  # seconds, first next() to the end of the optimizer step
    wait: torch.Tensor  # seconds blocked in next()
    wait_frac: torch.Tensor  # wait / step_time

    @staticmethod
    def _shapes(offsets: int) -> dict[str, tuple[int, ...]]:
        return {
            f.name: (offsets,) if f.metadata.get("per_offset") else () for f in fields(StepSums)
        }

    @classmethod
    def zeros(cls, offsets: int, device: torch.device | str) -> StepSums:
        return cls(
            **{
                name: torch.zeros(shape, dtype=torch.float64, device=device)
                for name, shape in cls._shapes(offsets).items()
            }
        )

    def add(self, out: LossOutput) -> None:
        """Add one micro-batch's loss sums (in place)."""
        self.ce += out.weighted_ce_sum
        self.weight += out.weight_sum
        self.tokens += out.num_tokens
        self.blocks += out.num_blocks
        self.capped += out.capped_blocks
        self.micro += 1
        self.correct += out.correct
        self.count += out.count

    def to_tensor(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])

    @classmethod
    def from_tensor(cls, t: torch.Tensor, offsets: int) -> StepSums:
        """The inverse of ``to_tensor`` (fields are views of ``t``)."""
        shapes = cls._shapes(offsets)
        sizes = [math.prod(shape) for shape in shapes.values()]
        if t.shape != (sum(sizes),):
            raise ValueError(
                f"step sums of {offsets} offsets need {sum(sizes)} values, got {t.shape}"
            )
        parts = t.split(sizes)
        return cls(
            **{
                name: p.reshape(shape)
                for (name, shape), p in zip(shapes.items(), parts, strict=True)
            }
        )


class StepResult(NamedTuple):
    """What one optimizer step returns to be recorded."""

    sums: StepSums
    grad_norm: torch.Tensor
    lr: float
    skipped: bool = False  # non-finite loss or gradients on some rank: no optimizer update


class StepPeaks(NamedTuple):
    """One step's values whose maximum over ranks is reported (one max all-reduce)."""

    step_time: float  # seconds: the slowest rank sets the step's throughput
    wait_frac: float
    rss_gb: float  # peak resident memory since the process began
    gpu_mem_gb: float  # peak CUDA memory allocated (0 on CPU)

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        # float32: these are only compared and reported (rounded), never summed.
        return torch.tensor(self, dtype=torch.float32).to(device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepPeaks:
        return cls(*t.tolist())
