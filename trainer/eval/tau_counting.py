"""Every published way of counting the acceptance length, from the same responses.

The tools disagree on tau for one checkpoint because they count differently; each column here
is one tool's count, so a number from any of them can be matched to its column (docs/EVAL.md):

* ``tau`` -- z-lab's DFlash benchmark (``dflash/benchmark.py``): the mean over responses of
  each response's mean acceptance length, every step counted with its bonus token (``j + 1``)
  and z-lab's loop's steps (``trainer.model.verifier``). The number the DFlash tables print.
* ``tau_pooled`` -- all acceptance lengths over all steps, pooled over responses (SpecForge's
  SGLang benchmark, DeepSpec's evaluation): long responses weigh more.
* ``tau_served`` -- an engine's ``1 + accepted / drafts`` over the steps it runs (vLLM's
  ``/metrics``, what speculators reads): pooled, without z-lab's extra step at the end.
* ``position_rates`` -- how often draft slot ``k`` (1..B-1) is accepted, over the served
  steps (vLLM's ``spec_decode_num_accepted_tokens_per_pos`` over its drafts).

Intervals are 95% percentile bootstraps over responses (seeded: the same responses give the
same interval).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trainer.model.verifier import SpecResult

RESAMPLES = 2000


@dataclass(frozen=True)
class Protocols:
    """One set's acceptance statistics under every protocol."""

    responses: int
    steps: int  # z-lab's steps
    served_steps: int  # the steps an engine runs (its drafts)
    output_tokens: int
    tau: float
    tau_ci: tuple[float, float]
    tau_pooled: float
    tau_served: float
    tau_served_ci: tuple[float, float]
    position_rates: tuple[float, ...]  # slot k = 1..B-1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Sequence[SpecResult], block_size: int, *, seed: int = 0) -> Protocols:
    """The statistics of ``results`` (one per response; MT-Bench: one per turn)."""
    resp = [r for r in results if r.steps]
    if not resp:
        raise ValueError("no response took a draft-verify step: nothing to measure")
    tau_r = np.array([r.tau for r in resp])
    acc = np.array([r.accepted for r in resp], dtype=np.float64)
    steps = np.array([r.steps for r in resp], dtype=np.float64)
    s_acc = np.array([r.served_accepted for r in resp], dtype=np.float64)
    s_steps = np.array([r.served_steps for r in resp], dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(resp), size=(RESAMPLES, len(resp)))
    boot_tau = tau_r[idx].mean(1)
    boot_served = s_acc[idx].sum(1) / np.maximum(s_steps[idx].sum(1), 1)
    return Protocols(
        responses=len(resp),
        steps=int(steps.sum()),
        served_steps=int(s_steps.sum()),
        output_tokens=sum(int(r.tokens.numel()) for r in resp),
        tau=float(tau_r.mean()),
        tau_ci=_interval(boot_tau),
        tau_pooled=float(acc.sum() / steps.sum()),
        tau_served=float(s_acc.sum() / max(s_steps.sum(), 1)),
        tau_served_ci=_interval(boot_served),
        position_rates=position_rates(resp, block_size),
    )


def position_rates(results: Sequence[SpecResult], block_size: int) -> tuple[float, ...]:
    """Share of served steps whose draft slot ``k`` was accepted, ``k = 1..B-1``."""
    lengths = np.array(
        [n for r in results for n in r.acceptance_lengths[: r.served_steps]], dtype=np.int64
    )
    if lengths.size == 0:
        return tuple(0.0 for _ in range(block_size - 1))
    k = np.arange(1, block_size)
    return tuple(float(x) for x in ((lengths[:, None] - 1) >= k[None]).mean(0))


def _interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return float(lo), float(hi)
