"""Acceptance length during training: when the verifier runs, and over which prompts.

The verifier (``trainer.model.verifier``) drafts with the drafter being trained and
verifies with the frozen target, greedy, on held-out prompts; each rank takes every
``world_size``-th prompt and the sums are all-reduced, so an evaluation costs one
rank's share. It runs before the first step of a fresh run (step 0: the untrained
drafter), every ``eval_every`` steps, and after the last step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from trainer.model.drafter import DFlashDrafter
from trainer.model.target import Target
from trainer.model.verifier import DrafterProposer, TauReport, eos_ids, evaluate_tau
from trainer.train.distributed import DistEnv, all_reduce
from trainer.train.step import autocast


class Evaluator:
    """tau of ``drafter`` on this rank's share of ``prompts``, combined over ranks."""

    def __init__(
        self, target: Target, drafter: DFlashDrafter, prompts: Sequence[torch.Tensor], *,
        env: DistEnv, block_size: int, max_new_tokens: int, every: int,
    ) -> None:  # fmt: skip
        self.target, self.drafter, self.env = target, drafter, env
        self.prompts = list(prompts)[env.rank :: env.world_size]
        self.block_size, self.max_new_tokens, self.every = block_size, max_new_tokens, every
        generation = getattr(target.model, "generation_config", None)
        self.eos = tuple(dict.fromkeys(eos_ids(target.config) + eos_ids(generation)))

    def due(self, step: int, final: bool) -> bool:
        """Whether the step just trained is evaluated (the last one always is)."""
        return final or bool(self.every and step % self.every == 0)

    def evaluate(self) -> dict[str, float] | None:
        """``tau`` (mean over prompts of each prompt's committed tokens per step, as
        published) and ``tau_pooled`` (committed tokens over all steps), over all ranks'
        prompts; None when there are none."""
        if not self.prompts and not self.env.distributed:
            return None
        proposer = DrafterProposer(self.target, self.drafter)
        # lockstep: a sharded target's ranks run their different numbers of forwards together
        with torch.no_grad(), autocast(self.env.device), self.target.lockstep():
            rep = evaluate_tau(
                self.target,
                proposer,
                self.prompts,
                block_size=self.block_size,
                max_new_tokens=self.max_new_tokens,
                eos_token_ids=self.eos,
            )
        t = torch.tensor(rep.sums(), dtype=torch.float64, device=self.env.device)
        total = TauReport.from_sums(all_reduce(t, self.env).tolist())
        if total.steps <= 0 or total.prompts <= 0:
            return None
        return total.metrics()

    def add_to(self, rec: dict[str, Any]) -> None:
        """Evaluate now and put the figures (and the time it took) into ``rec``."""
        t0 = time.perf_counter()
        taus = self.evaluate()
        if taus is not None:
            rec.update(taus, eval_s=time.perf_counter() - t0)
