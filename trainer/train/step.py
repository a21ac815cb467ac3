"""One optimizer step's numbers: the sums every rank adds up (``StepSums``, one all-reduce),
the values whose maximum over ranks is reported (``StepPeaks``, one max all-reduce), what
a step hands the loop to record (``StepResult``), and the metrics record made of them
(``step_record``; its fields: ``trainer.train.metrics``)."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch

from trainer.model.loss import LossOutput
from trainer.train.distributed import DistEnv, all_reduce

_PER_OFFSET = {"per_offset": True}  # a StepSums field with one value per block offset 1..B-1


@dataclass(kw_only=True)
class StepSums:
    """One optimizer step's sums on this rank, added over ranks by one all-reduce of
    ``to_tensor()``: float64, the fields in this order, each a scalar except the
    ``per_offset`` ones (``B - 1`` values). Accumulated on the model's device (no host sync)."""

    ce: torch.Tensor  # weighted block cross-entropy
    divisor: torch.Tensor  # what it is divided by (--loss-divisor: weights, slots, documents)
    micro_means: torch.Tensor  # sum of each micro-batch's ce / divisor (the old normalization)
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
        self.divisor += out.divisor
        if out.loss is not None:
            self.micro_means += out.loss.detach()
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


class Applied(NamedTuple):
    """Why an optimizer step was not applied (both False: it was), as every rank agreed."""

    skipped: bool  # non-finite loss or gradients on some rank
    empty: bool  # no rank's step had weight (no supervised slot trained): no objective

    @classmethod
    def agree(cls, grad_norm: torch.Tensor, sums: StepSums, env: DistEnv) -> Applied:
        """Whether some rank's loss or the (all-reduced, so common) gradient norm is not
        finite, and whether no rank's step has weight: one decision for all ranks (one max
        all-reduce under DDP, the step's one host sync)."""
        bad = (~torch.isfinite(grad_norm)) | (~torch.isfinite(sums.ce))
        flags = torch.stack([bad.to(torch.float64), (sums.divisor > 0).to(torch.float64)])
        worst = all_reduce(flags.reshape(2), env, op="max").tolist()
        return cls(skipped=worst[0] > 0, empty=worst[1] == 0)


class StepResult(NamedTuple):
    """What one optimizer step returns to be recorded."""

    sums: StepSums
    grad_norm: torch.Tensor
    lr: float
    skipped: bool = False  # non-finite loss or gradients on some rank: no optimizer update
    empty: bool = False  # no weight on any rank: no optimizer update either


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


def step_record(
    raw: StepResult, env: DistEnv, *, step: int, epoch: int, normalization: str = "step"
) -> dict[str, Any]:
    """Combine the ranks' sums (one sum and one max all-reduce) into a metrics record. Its
    ``loss`` is the objective the step optimized: the step's weighted CE over its divisor, or
    under the old ``normalization`` "micro-batch" the mean of the micro-batches' means."""
    mine, n, offsets = raw.sums, env.world_size, int(raw.sums.correct.numel())
    total = StepSums.from_tensor(all_reduce(mine.to_tensor(), env).cpu(), offsets)
    peaks = StepPeaks(float(mine.step_time), float(mine.wait_frac), *_memory_peaks_gb(env.device))
    mx = StepPeaks.from_tensor(all_reduce(peaks.to_tensor(env.device), env, op="max"))
    ce, weight = float(total.ce), float(total.divisor)
    tokens, blocks = float(total.tokens), float(total.blocks)
    correct, count = total.correct, total.count
    if normalization == "micro-batch":
        loss = float(total.micro_means) / float(total.micro) if weight > 0 else None
    else:
        loss = ce / weight if weight > 0 else None
    grad_norm = float(raw.grad_norm)
    rec = {
        "step": step,
        "epoch": epoch,
        "loss": _finite_or_none(loss) if raw.skipped else loss,
        "acc": float(correct.sum() / count.sum()) if count.sum() > 0 else None,
        "acc_k": [round(float(c / max(k, 1)), 5) for c, k in zip(correct, count, strict=True)],
        "lr": raw.lr,
        "grad_norm": _finite_or_none(grad_norm) if raw.skipped else grad_norm,
        "tokens": int(tokens),
        "blocks": int(blocks),
        "anchors_per_micro": blocks / max(float(total.micro), 1),
        "anchors_capped": int(total.capped),
        "step_time_s": float(total.step_time / n),  # the mean over ranks
        "tokens_per_s": tokens / mx.step_time,
        "anchors_per_s": blocks / mx.step_time,
        "data_wait_s": float(total.wait / n),
        "data_wait_frac": float(total.wait_frac / n),
        "data_wait_frac_max": mx.wait_frac,
        "rss_peak_gb": round(mx.rss_gb, 3),  # max over ranks, since the process began
        "gpu_mem_peak_gb": round(mx.gpu_mem_gb, 3),  # max over ranks (0 on CPU)
        "time": time.time(),
    }
    if raw.skipped:  # only then: the records of a healthy run are unchanged
        rec["skipped_nonfinite"] = 1
    elif raw.empty:
        rec["skipped_empty"] = 1
    return rec


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; a no-op context on CPU."""
    return torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")


def _memory_peaks_gb(device: torch.device) -> tuple[float, float]:
    """Peak resident memory of this process and peak CUDA memory allocated, in GiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return rss, gpu


def _finite_or_none(x: float | None) -> float | None:
    """``x``, or None for NaN and inf (JSON has no such numbers)."""
    return x if x is not None and math.isfinite(x) else None
