"""Speculative decoding with known answers: oracle drafter tau == B, wrong drafter tau == 1."""

from __future__ import annotations

import pytest
import torch

from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.target import Target
from trainer.verifier import (
    DrafterProposer,
    evaluate_tau,
    greedy_generate,
    speculative_generate,
)

B = 6


class Oracle:
    """Proposes exactly what the target would generate greedily."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def propose(self, committed, ctx, num):
        assert ctx.shape[0] == committed.numel() - 1  # features of everything before the anchor
        return greedy_generate(self.target, committed, num)


class Wrong(Oracle):
    """Always wrong at the first draft position (the rest right, which must not count)."""

    def propose(self, committed, ctx, num):
        good = super().propose(committed, ctx, num)
        good[0] = (good[0] + 1) % self.target.vocab_size
        return good


class FirstK(Oracle):
    """Right on the first k drafts, wrong on the next one."""

    def __init__(self, target: Target, k: int) -> None:
        super().__init__(target)
        self.k = k

    def propose(self, committed, ctx, num):
        good = super().propose(committed, ctx, num)
        good[self.k] = (good[self.k] + 1) % self.target.vocab_size
        return good


PROMPT = torch.tensor([5, 77, 301, 12, 9, 480, 33])


def test_oracle_commits_full_blocks(target):
    r = speculative_generate(target, Oracle(target), PROMPT, block_size=B, max_new_tokens=4 * B + 1)
    assert r.tau == B and r.steps == 4
    assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 4 * B + 1))


def test_wrong_drafter_commits_one_token_per_step(target):
    r = speculative_generate(target, Wrong(target), PROMPT, block_size=B, max_new_tokens=10)
    assert r.tau == 1.0 and r.steps == 9  # the prefill gives the first token
    assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 10))


@pytest.mark.parametrize("k", [1, 3])
def test_partial_acceptance(target, k):
    r = speculative_generate(target, FirstK(target, k), PROMPT, block_size=B, max_new_tokens=30)
    assert r.tau == k + 1
    assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 30))


def test_drafter_output_is_lossless_and_tau_in_range(target):
    cfg = DrafterConfig.from_target(target.config, num_target_layers=3, block_size=B)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target.embed_tokens.weight.mean(0))
    prompts = [PROMPT, torch.tensor([1]), torch.arange(40, 60)]
    for p in prompts:
        r = speculative_generate(
            target, DrafterProposer(target, drafter), p, block_size=B, max_new_tokens=20
        )
        assert torch.equal(r.tokens, greedy_generate(target, p, 20))
        assert 1.0 <= r.tau <= B
    rep = evaluate_tau(
        target, DrafterProposer(target, drafter), prompts, block_size=B, max_new_tokens=20
    )
    assert rep.steps > 0 and 1.0 <= rep.tau <= B
    with pytest.raises(ValueError, match="drafts"):
        DrafterProposer(target, drafter).propose(PROMPT, torch.zeros(6, 384), 3)
