"""Speculative decoding with known answers: oracle drafter tau == B, wrong drafter tau == 1;
stopping at EOS like greedy decoding; the per-prompt mean and the pooled tau by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import Target
from trainer.model.verifier import (
    DrafterProposer,
    TauReport,
    eos_ids,
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
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
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
    assert rep.steps > 0 and 1.0 <= rep.tau <= B and 1.0 <= rep.tau_pooled <= B
    assert rep.prompts == len(prompts)
    with pytest.raises(ValueError, match="drafts"):
        DrafterProposer(target, drafter).propose(PROMPT, torch.zeros(6, 384), 3)


# ---- EOS -------------------------------------------------------------------------------


def first_new_token_at(tokens: list[int], k: int) -> int:
    """The first token at index >= k of ``tokens`` that does not occur before it, and its index."""
    for i in range(k, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i
    raise AssertionError(f"no new token after index {k} in {tokens}")


def drafter_proposer(target):
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511
    )
    torch.manual_seed(0)
    return DrafterProposer(target, DFlashDrafter(cfg))


@pytest.mark.parametrize("make", [Oracle, Wrong, lambda t: FirstK(t, 2), drafter_proposer])
def test_stops_at_eos_like_greedy(target, make):
    full = greedy_generate(target, PROMPT, 40)
    eos, k = first_new_token_at(full.tolist(), 7)  # a token the target really produces
    unused = next(t for t in range(target.vocab_size) if t not in full.tolist())
    for ids in [(eos,), (unused, eos)]:
        ref = greedy_generate(target, PROMPT, 40, eos_token_ids=ids)
        assert torch.equal(ref, full[: k + 1])  # greedy stops right after the EOS, kept
        r = speculative_generate(
            target, make(target), PROMPT, block_size=B, max_new_tokens=40, eos_token_ids=ids
        )
        assert torch.equal(r.tokens, ref)
        # every token after the prefill's first one is committed by a step, nothing past EOS
        assert r.committed == k == sum(r.acceptance_lengths)
        assert r.steps == len(r.acceptance_lengths)
    # an EOS beyond max_new_tokens changes nothing
    r = speculative_generate(
        target, make(target), PROMPT, block_size=B, max_new_tokens=k, eos_token_ids=(eos,)
    )
    assert torch.equal(r.tokens, full[:k])


def test_eos_step_counts_only_tokens_up_to_eos(target):
    full = greedy_generate(target, PROMPT, 40).tolist()
    eos, k = first_new_token_at(full, B + 1)  # in the oracle's second block, not its first
    assert B + 1 <= k < 2 * B + 1
    r = speculative_generate(
        target, Oracle(target), PROMPT, block_size=B, max_new_tokens=40, eos_token_ids=(eos,)
    )
    assert r.acceptance_lengths == [B, k - B] and r.tau == k / 2
    r = speculative_generate(
        target, Wrong(target), PROMPT, block_size=B, max_new_tokens=40, eos_token_ids=(eos,)
    )
    assert r.acceptance_lengths == [1] * k and r.tau == 1.0


def test_eos_as_first_token_has_no_steps(target):
    first = int(greedy_generate(target, PROMPT, 1)[0])
    r = speculative_generate(
        target, Oracle(target), PROMPT, block_size=B, max_new_tokens=20, eos_token_ids=(first,)
    )
    assert r.tokens.tolist() == [first] and r.steps == 0 and r.acceptance_lengths == []
    assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 20, eos_token_ids=(first,)))


def test_last_step_counts_in_full_past_max_new_tokens(target):
    r = speculative_generate(target, Oracle(target), PROMPT, block_size=B, max_new_tokens=10)
    assert r.acceptance_lengths == [B, B] and r.committed == 2 * B and r.tokens.numel() == 10


# ---- the two statistics ----------------------------------------------------------------


class OracleOrWrong(Oracle):
    """The oracle on prompts starting with ``PROMPT[0]``, always wrong on the others."""

    def propose(self, committed, ctx, num):
        good = super().propose(committed, ctx, num)
        if committed[0] != PROMPT[0]:
            good[0] = (good[0] + 1) % self.target.vocab_size
        return good


def test_per_prompt_mean_and_pooled_tau(target):
    other = torch.tensor([1, 2, 3])
    # PROMPT: 4 oracle steps of B tokens (tau B); other: 4*B wrong steps of 1 token (tau 1)
    rep = evaluate_tau(
        target, OracleOrWrong(target), [PROMPT, other], block_size=B, max_new_tokens=4 * B + 1
    )
    assert (rep.committed, rep.steps) == (4 * B + 4 * B, 4 + 4 * B)
    assert (rep.prompt_tau_sum, rep.prompts) == (B + 1.0, 2)
    assert rep.tau == (B + 1) / 2  # 3.5: the reference statistic, every prompt weighs the same
    assert rep.tau_pooled == pytest.approx(8 * B / (4 + 4 * B))  # 48/28: dominated by `other`
    assert rep.tau != pytest.approx(rep.tau_pooled)

    # always right / always wrong: both statistics agree
    rep = evaluate_tau(target, Oracle(target), [PROMPT, other], block_size=B, max_new_tokens=13)
    assert rep.tau == rep.tau_pooled == B
    rep = evaluate_tau(target, Wrong(target), [PROMPT, other], block_size=B, max_new_tokens=13)
    assert rep.tau == rep.tau_pooled == 1.0 and rep.steps == 24


def test_prompt_without_steps_counts_for_neither(target):
    first = int(greedy_generate(target, PROMPT, 1)[0])
    other = torch.tensor([1, 2, 3])
    assert first not in greedy_generate(target, other, 13).tolist()
    rep = evaluate_tau(
        target,
        Wrong(target),
        [PROMPT, other],
        block_size=B,
        max_new_tokens=13,
        eos_token_ids=(first,),
    )
    assert rep == TauReport(committed=12, steps=12, prompt_tau_sum=1.0, prompts=1)
    assert rep.tau == rep.tau_pooled == 1.0
    assert TauReport(committed=0, steps=0).tau == TauReport(committed=0, steps=0).tau_pooled == 0


def test_eos_ids_from_config(target):
    assert eos_ids(target.config) == ()  # the tiny target has none
    assert eos_ids(SimpleNamespace(eos_token_id=7)) == (7,)
    assert eos_ids(SimpleNamespace(eos_token_id=[151645, 151643, 151645])) == (151645, 151643)
    assert eos_ids(SimpleNamespace(eos_token_id=None)) == ()
    assert eos_ids(SimpleNamespace()) == ()
