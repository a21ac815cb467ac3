"""Acceptance length during training: when the verifier runs, and over which prompts.

The batched verifier (``trainer.model.speculate.BatchedVerifier``) drafts with the drafter
being trained and verifies with the frozen target, greedy, ``batch`` prompts per target
forward; prompt for prompt its results are the one-prompt reference's
(``trainer.model.verifier``), so the figures do not depend on the batch. Two kinds of
prompts: the held-out ones (``tau``, ``tau_pooled``, ``tau_served``, ``tau_committed``) and
each named evaluation set (``tau/NAME``, ``tau_pooled/NAME``: ``--eval-sets``). Each rank
takes every ``world_size``-th prompt of each, and the sums of all of them are all-reduced in
one collective, so an evaluation costs one rank's share. It runs before the first step of a
fresh run (step 0: the untrained drafter), every ``eval_every`` steps, and after the last
step.

Why batches of ``batch`` prompts rather than a rank's whole share at once: the rows share one
KV cache as wide as the longest of them, next to the training run's own memory. For
Qwen3-8B (36 layers, 8 KV heads of 128, bf16: 144 KiB a position) 16 rows of 2,000
positions hold 4.4 GiB; four sets of 32 prompts on one GPU at once would hold 18 GiB.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trainer.model.drafter import DFlashDrafter
from trainer.model.speculate import BatchedVerifier
from trainer.model.target import Target
from trainer.model.verifier import TauReport, eos_ids
from trainer.train.distributed import DistEnv, all_reduce
from trainer.train.step import autocast

#: The statistics each evaluation set reports, as ``STAT/NAME``.
SET_STATS = ("tau", "tau_pooled")


def set_key(stat: str, name: str) -> str:
    """The record key of statistic ``stat`` on evaluation set ``name`` (``tau/gsm8k``)."""
    return f"{stat}/{name}"


class Evaluator:
    """tau of ``drafter`` on this rank's share of the held-out ``prompts`` and of each set
    in ``sets`` (name -> token prompts), combined over ranks."""

    def __init__(
        self, target: Target, drafter: DFlashDrafter, prompts: Sequence[torch.Tensor], *,
        env: DistEnv, max_new_tokens: int, every: int,
        sets: Mapping[str, Sequence[torch.Tensor]] | None = None, batch: int = 16,
    ) -> None:  # fmt: skip
        if batch < 1:
            raise ValueError(f"eval batch must be >= 1, got {batch}")
        self.target, self.drafter, self.env = target, drafter, env
        # Known on every rank alike (the shares below may be empty on some): none, no tau.
        self.active = bool(prompts) or any(bool(group) for group in (sets or {}).values())
        share = slice(env.rank, None, env.world_size)
        # None: the held-out prompts; every rank has the same groups in the same order
        self.groups: list[tuple[str | None, list[torch.Tensor]]] = [
            (name, list(group)[share]) for name, group in [(None, prompts), *(sets or {}).items()]
        ]
        self.max_new_tokens, self.every, self.batch = max_new_tokens, every, batch
        generation = getattr(target.model, "generation_config", None)
        self.eos = tuple(dict.fromkeys(eos_ids(target.config) + eos_ids(generation)))

    def due(self, step: int, final: bool) -> bool:
        """Whether the step just trained is evaluated (the last one always is)."""
        return final or bool(self.every and step % self.every == 0)

    def evaluate(self) -> dict[str, float] | None:
        """``tau`` (mean over prompts of each prompt's committed tokens per step, as
        published), ``tau_pooled`` (committed tokens over all steps), ``tau_served`` and
        ``tau_committed`` over all ranks' held-out prompts, and ``tau/NAME`` and
        ``tau_pooled/NAME`` over each set's; None when there are no prompts at all."""
        if not self.active:
            return None
        verifier = BatchedVerifier(
            self.target, self.drafter, max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos
        )
        sums = [s for _, prompts in self.groups for s in self._report(verifier, prompts).sums()]
        t = torch.tensor(sums, dtype=torch.float64, device=self.env.device)
        rows = all_reduce(t, self.env).view(len(self.groups), -1).tolist()
        out: dict[str, float] = {}
        for (name, _), row in zip(self.groups, rows, strict=True):
            total = TauReport.from_sums(row)
            if total.steps <= 0 or total.prompts <= 0:
                continue
            stats = total.metrics()
            if name is None:
                out.update(stats)
            else:
                out.update({set_key(k, name): stats[k] for k in SET_STATS})
        return out or None

    def _report(self, verifier: BatchedVerifier, prompts: list[torch.Tensor]) -> TauReport:
        """The sums over ``prompts``, verified ``batch`` at a time, counted in their order."""
        rep = TauReport()
        # lockstep: a sharded target's ranks run their different numbers of forwards together
        with torch.no_grad(), autocast(self.env.device), self.target.lockstep():
            for i in range(0, len(prompts), self.batch):
                for result in verifier.generate(prompts[i : i + self.batch]):
                    rep.add(result)
        return rep

    def add_to(self, rec: dict[str, Any]) -> None:
        """Evaluate now and put the figures (and the time it took) into ``rec``."""
        t0 = time.perf_counter()
        taus = self.evaluate()
        if taus is not None:
            rec.update(taus, eval_s=time.perf_counter() - t0)
