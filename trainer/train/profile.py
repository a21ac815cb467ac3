"""Where a training step's time goes, and how much of the chip it uses.

The step is cut into named phases (``trainer.model.phases``: copy, plan, target, blocks,
drafter, head, backward, optimizer). ``dflash-train train --profile-step N`` profiles step
N (after warm-up) with ``torch.profiler`` and writes ``RUN_DIR/profile.json`` (rank 0):
each phase's time (device time on CUDA, host time on CPU), its share of the step, the
all-reduce time, and the FLOPs and MFU of the step (``step_flops``; MFU needs the chip's
peak, ``--peak-tflops`` or the table ``PEAK_TFLOPS`` by device name).

The FLOP count is of the model's useful work, real tokens only (padding and activation
recompute are not counted), forward 2 FLOPs per multiply-add, backward twice the forward:

* target (frozen, forward only, layers 0..deepest chosen): per layer and token
  ``2 * (H * (q + 2 kv + q) + 3 * H * I)``; causal attention ``2 * 2 * (l^2 / 2) * q`` per
  document of length ``l``;
* drafter, forward and backward (x3): ``fc`` over every token's features
  ``2 * (n H) * H``; per drafter layer K/V of every context token ``2 * 2 * H * kv``, the
  block tokens' (anchors x B) Q/O projections and MLP ``2 * (2 * H * q + 3 * H * I)``, and
  their attention over their context and block, ``2 * 2 * (ctx + B) * q`` per block token
  (ctx: the mean document length, an upper bound of an anchor's context on average);
* LM head: two products (logits, and the gradient of the hidden states), ``2 * 2 * H * V``
  per supervised slot.

(q = heads x head_dim, kv = KV heads x head_dim.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.model.drafter import DrafterConfig
from trainer.model.phases import PHASES, PREFIX
from trainer.model.target import Target
from trainer.train.distributed import DistEnv
from trainer.train.step import StepResult

log = logging.getLogger(__name__)

#: Dense bf16 peak (TFLOP/s, without sparsity) by a substring of the CUDA device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model: widths and depth."""

    hidden: int
    intermediate: int
    q: int  # heads x head_dim
    kv: int  # KV heads x head_dim
    layers: int

    @classmethod
    def of(cls, config: Any, layers: int | None = None) -> ModelShape:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", heads))
        return cls(
            int(config.hidden_size), int(config.intermediate_size), heads * head_dim,
            kv_heads * head_dim, int(layers if layers is not None else config.num_hidden_layers),
        )  # fmt: skip

    def per_token(self) -> int:
        """Linear-layer FLOPs of one token through one layer (forward)."""
        h = self.hidden
        return 2 * (h * (2 * self.q + 2 * self.kv) + 3 * h * self.intermediate)


@dataclass
class StepWork:
    """One rank's work in a step, summed over its micro-batches."""

    doc_lengths: list[int]
    anchors: int
    slots: int  # supervised slots (the LM head's rows)


def step_flops(
    work: StepWork, target: ModelShape, drafter: ModelShape, *, features: int, block: int,
    vocab: int,
) -> dict[str, float]:  # fmt: skip
    """The step's FLOPs by part (``target``, ``drafter``, ``head``) and their ``total``."""
    lengths = torch.tensor(work.doc_lengths, dtype=torch.float64)
    tokens = float(lengths.sum())
    square_half = float((lengths * lengths).sum()) / 2
    tgt = tokens * target.per_token() * target.layers + 4 * square_half * target.q * target.layers
    block_tokens = work.anchors * block
    mean_ctx = tokens / max(len(work.doc_lengths), 1)
    h = drafter.hidden
    per_layer = (
        tokens * 4 * h * drafter.kv
        + block_tokens * 2 * (2 * h * drafter.q + 3 * h * drafter.intermediate)
        + block_tokens * 4 * (mean_ctx + block) * drafter.q
    )
    draft = 3 * (tokens * 2 * features * h * h + drafter.layers * per_layer)
    head = work.slots * 4 * drafter.hidden * vocab
    return {"target": tgt, "drafter": draft, "head": head, "total": tgt + draft + head}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The chip's dense bf16 peak: ``given``, else by device name (None: unknown, CPU)."""
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def phase_times(events: Iterable[Any], cuda: bool) -> dict[str, float]:
    """Seconds per phase from a profiler's events (device time on CUDA, host otherwise),
    and ``all_reduce`` (the collectives' device time, or host time on CPU)."""
    out = dict.fromkeys(PHASES, 0.0)
    out["all_reduce"] = 0.0
    for ev in events:
        name = str(getattr(ev, "key", None) or getattr(ev, "name", ""))
        us = _device_us(ev) if cuda else float(ev.cpu_time_total)
        if name.startswith(PREFIX) and name[len(PREFIX) :] in out:
            out[name[len(PREFIX) :]] += us / 1e6
        elif "allreduce" in name.replace("_", "").lower():
            out["all_reduce"] += (us if cuda else float(ev.self_cpu_time_total)) / 1e6
    return out


def _device_us(ev: Any) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(ev, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def report(
    times: dict[str, float], step_s: float, flops: dict[str, float], peak: float | None,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """The ``profile.json`` record: phase seconds and shares of the step, FLOPs, MFU."""
    named = sum(times[p] for p in PHASES)
    shares = {p: _sig(times[p] / step_s) for p in PHASES}
    shares["other"] = _sig(max(step_s - named, 0.0) / step_s)
    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "step_s": _sig(step_s),
        "phase_s": {k: _sig(v) for k, v in times.items()},
        "phase_share": shares,
        "flops": {k: _sig(v) for k, v in flops.items()},
        "tflops_per_s": _sig(flops["total"] / step_s / 1e12),
        "peak_tflops": peak,
        "mfu": _sig(flops["total"] / step_s / (peak * 1e12)) if peak else None,
    }
    return rec


def _sig(x: float) -> float:
    """Four significant digits (a JSON record for people, not a checksum)."""
    return float(f"{x:.4g}")


def write(path: Path, rec: dict[str, Any]) -> None:
    path.write_text(json.dumps(rec, indent=2) + "\n")


class StepProfiler:
    """``--profile-step N``: step N runs under ``torch.profiler``; its phases, FLOPs and MFU
    go to ``RUN_DIR/profile.json`` (rank 0). While it runs (``active``) the step adds its
    documents and anchors to ``work`` (a host sync per micro-batch: only then)."""

    def __init__(self, step: int, run_dir: Path, env: DistEnv, peak: float | None) -> None:
        self.step, self.path, self.env, self.peak = step, run_dir / "profile.json", env, peak
        self.active = False
        self.work = StepWork([], 0, 0)

    def run(
        self, step: int, train: Callable[[], StepResult], flops: Callable[[StepWork], dict]
    ) -> StepResult:
        """Train step ``step`` (``train()``), profiled when it is the one asked for."""
        self.work = StepWork([], 0, 0)
        if step != self.step:
            return train()
        cuda = self.env.device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.env.device)
        self.active = True
        try:
            with torch.profiler.profile(activities=acts) as prof:
                raw = train()
                if cuda:
                    torch.cuda.synchronize(self.env.device)
        finally:
            self.active = False
        if self.env.is_main:
            self._write(prof, float(raw.sums.step_time), flops(self.work), step)
        return raw

    def _write(self, prof: Any, step_s: float, flops: dict[str, float], step: int) -> None:
        dev = self.env.device
        times = phase_times(prof.key_averages(), dev.type == "cuda")
        peak = peak_tflops(dev, self.peak)
        rec = report(times, step_s, flops, peak, dev)
        rec.update(step=step, rank=self.env.rank, world_size=self.env.world_size)
        write(self.path, rec)
        log.info(
            "profiled step %d: %.3f s, %.1f TFLOP/s%s; %s", step, step_s,
            rec["tflops_per_s"], f", MFU {rec['mfu']:.1%}" if rec["mfu"] else "", self.path,
        )  # fmt: skip


def trainer_flops(
    work: StepWork, target: Target, drafter: DrafterConfig, block: int
) -> dict[str, float]:
    """``step_flops`` of a step of ``drafter`` trained on ``target``."""
    shape = ModelShape(
        drafter.hidden_size, drafter.intermediate_size, drafter.num_heads * drafter.head_dim,
        drafter.num_kv_heads * drafter.head_dim, drafter.num_layers,
    )  # fmt: skip
    deepest = ModelShape.of(target.config, max(target.layer_ids) + 1)
    return step_flops(
        work, deepest, shape, features=len(target.layer_ids), block=block,
        vocab=target.vocab_size,
    )  # fmt: skip
