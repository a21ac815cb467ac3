"""serve-check's acceptance comparison (``scripts/checks/serve_drafters.py``): vLLM's
counters must equal the trainer's verifier's prompt by prompt, except where one near-tie
of the drafter's, decided the other way, gives vLLM's counters exactly (two fp32
implementations may break a tie apart), in at most one prompt in eight. The verifier's
side runs the real verifier with a trained drafter; vLLM's side is its counters, written
as the flipped run's counts (or as counts no flip gives)."""

from __future__ import annotations

import pytest
import torch
from drafters import greedy_samples, train_run, trained_drafter

import scripts.checks.serve_harness as common
from scripts.checks.serve_drafters import _compare_pass, max_tied, mismatches
from scripts.checks.serve_harness import Verifier
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.verifier import DrafterProposer, speculative_generate
from trainer.vllm.metrics import SpecCounters

pytestmark = pytest.mark.integration

B, MASK, NEW = 6, 511, 24


@pytest.fixture(scope="module")
def verifier(target, tmp_path_factory) -> Verifier:
    samples = greedy_samples(target, MASK)
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=MASK
    )
    torch.manual_seed(0)
    run = train_run(target, samples, tmp_path_factory.mktemp("run"), DFlashDrafter(cfg),
                    LossConfig(block_size=B, anchors_per_doc=8), 40)  # fmt: skip
    v = Verifier.__new__(Verifier)  # the folder-reading constructor's state, from memory
    v.target, v.block, v.eos = target, B, ()
    v.proposer = DrafterProposer(target, trained_drafter(run))
    v.prompts = [ids[:8] for ids, _ in samples]
    return v


def counters(steps: list[common.PromptSteps]) -> list[SpecCounters]:
    """vLLM's cumulative counters read before the first prompt and after each, had vLLM
    counted ``steps``."""
    reads = [SpecCounters(0, 0, 0, (0,) * (B - 1))]
    for s in steps:
        pos = tuple(reads[-1].per_position[k] + s.per_position.get(k, 0) for k in range(B - 1))
        last = reads[-1]
        reads.append(SpecCounters(last.drafts + s.drafts, last.draft_tokens + s.drafts * (B - 1),
                                  last.accepted + s.accepted, pos))  # fmt: skip
    return reads


def accepted_draft(verifier: Verifier, prompt: list[int]) -> tuple[int, int]:
    """The (step, position) of the first draft the verifier accepted for ``prompt``."""
    r, _ = verifier.generate(prompt, NEW, [])
    step = next(k for k, n in enumerate(r.acceptance_lengths[: r.served_steps]) if n > 1)
    return step, 0


def test_the_recording_proposer_drafts_as_the_verifier(verifier):
    for p in verifier.prompts:
        r, s = verifier.generate(p, NEW, [])
        ref = speculative_generate(verifier.target, verifier.proposer, torch.tensor(p),
                                   block_size=B, max_new_tokens=NEW)  # fmt: skip
        assert r.acceptance_lengths == ref.acceptance_lengths and torch.equal(r.tokens, ref.tokens)
        served = ref.acceptance_lengths[: ref.served_steps]
        assert (s.drafts, s.accepted) == (len(served), sum(served) - len(served))
        assert sum(s.per_position.values()) == s.accepted
        assert all(gap < common.NEAR_TIE for gap, _, _ in s.ties)


def test_a_difference_one_flipped_tie_explains_passes_and_others_fail(verifier, monkeypatch):
    # every deciding position counts as a tie here, so that a flip is there to find
    monkeypatch.setattr(common, "NEAR_TIE", float("inf"))
    monkeypatch.setattr(common, "TIES_TRIED", 10**6)
    ps = verifier.prompts
    steps = [verifier.generate(p, NEW, [])[1] for p in ps]
    assert all(s.ties for s in steps)
    # a flip of the drafter's first choice at an accepted draft moves the counts
    flipped = verifier.generate(ps[0], NEW, [], flip=accepted_draft(verifier, ps[0]))[1]
    assert flipped.counts() != steps[0].counts()
    stops = [[] for _ in ps]
    assert mismatches(verifier, ps, NEW, stops, steps, counters(steps)) == []

    seen = counters([flipped, *steps[1:]])
    odd = mismatches(verifier, ps, NEW, stops, steps, seen)
    assert [m.prompt for m in odd] == [0] and odd[0].tie is not None
    _, s2, p2 = odd[0].tie  # the flip it found gives vLLM's counts (perhaps another flip)
    assert verifier.generate(ps[0], NEW, [], flip=(s2, p2))[1].counts() == flipped.counts()
    tokens = [verifier.generate(p, NEW, [])[0].tokens.tolist() for p in ps]
    passed = _compare_pass("max_tokens", tokens, tokens, _Rep(), tokens, steps, seen, odd)
    assert passed.equal_acceptance and "with its second choice there" in passed.acceptance

    # counts no single flip gives: not explained, and the check fails
    odd_counts = common.PromptSteps(steps[1].drafts + 50, steps[1].accepted, {}, [])
    seen = counters([steps[0], odd_counts, *steps[2:]])
    odd = mismatches(verifier, ps, NEW, stops, steps, seen)
    assert [(m.prompt, m.tie) for m in odd] == [(1, None)]
    failed = _compare_pass("max_tokens", tokens, tokens, _Rep(), tokens, steps, seen, odd)
    assert not failed.equal_acceptance and "no near-tie explains it" in failed.acceptance


def test_more_tied_prompts_than_one_in_eight_fail(verifier, monkeypatch):
    monkeypatch.setattr(common, "NEAR_TIE", float("inf"))
    monkeypatch.setattr(common, "TIES_TRIED", 10**6)
    ps = verifier.prompts
    steps = [verifier.generate(p, NEW, [])[1] for p in ps]
    assert len(ps) // 8 == max_tied(len(ps)) == 1
    flips = []
    for i in (0, 1):
        flips.append(verifier.generate(ps[i], NEW, [], flip=accepted_draft(verifier, ps[i]))[1])
    assert all(f.counts() != s.counts() for f, s in zip(flips, steps, strict=False))
    seen = counters([*flips, *steps[2:]])
    odd = mismatches(verifier, ps, NEW, [[] for _ in ps], steps, seen)
    assert [m.prompt for m in odd] == [0, 1] and all(m.tie is not None for m in odd)
    tokens = [[0] for _ in ps]
    result = _compare_pass("max_tokens", tokens, tokens, _Rep(), tokens, steps, seen, odd)
    assert not result.equal_acceptance and "more than 1 of 8 prompts differ" in result.acceptance


class _Rep:
    """The verifier's report's figures the comparison prints."""

    tau_served = tau = tau_committed = 1.0
