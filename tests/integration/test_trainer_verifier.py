"""Speculative decoding with known answers: oracle drafter tau == B, wrong drafter tau == 1;
stopping at EOS like greedy decoding; the steps and acceptance lengths of z-lab's
``dflash_generate`` at the end of a response (a step landing exactly on max_new_tokens, a
stop token inside an accepted block or as the bonus token, EOS as the prefill's token),
checked by hand and against a transcription of z-lab's loop; the statistics by hand."""

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

pytestmark = pytest.mark.heavy(27)  # seconds side by side; scheduled first (tests/conftest.py)

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
    r = speculative_generate(target, Oracle(target), PROMPT, block_size=B, max_new_tokens=4 * B)
    assert r.tau == B and r.steps == r.served_steps == 4
    assert r.acceptance_lengths == [B] * 4 and r.committed == 4 * B  # the last step: 1 past
    assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 4 * B))


def test_wrong_drafter_commits_one_token_per_step(target):
    r = speculative_generate(target, Wrong(target), PROMPT, block_size=B, max_new_tokens=10)
    # the prefill gives the first token; 9 steps give the other 9, and the 9th lands exactly
    # on max_new_tokens: z-lab runs a 10th, a serving engine does not
    assert r.tau == 1.0 and r.steps == 10 and r.served_steps == 9 and r.committed == 9
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
        # every token after the prefill's first one is committed by a step, up to the EOS;
        # the step that reaches it is the last one, counted whole
        assert r.committed == k <= sum(r.acceptance_lengths) < k + B
        assert r.steps == r.served_steps == len(r.acceptance_lengths)
    # an EOS beyond max_new_tokens changes nothing
    r = speculative_generate(
        target, make(target), PROMPT, block_size=B, max_new_tokens=k, eos_token_ids=(eos,)
    )
    assert torch.equal(r.tokens, full[:k])


def test_eos_as_first_token_still_runs_zlabs_first_step(target):
    first = int(greedy_generate(target, PROMPT, 1)[0])
    for make, length in ((Oracle, B), (Wrong, 1), (lambda t: FirstK(t, 2), 3)):
        r = speculative_generate(
            target, make(target), PROMPT, block_size=B, max_new_tokens=20, eos_token_ids=(first,)
        )
        assert r.tokens.tolist() == [first]
        assert torch.equal(r.tokens, greedy_generate(target, PROMPT, 20, eos_token_ids=(first,)))
        # z-lab checks for a stop token after a step: one step, counted whole
        assert r.acceptance_lengths == [length] and r.tau == length
        # a serving engine finishes the request at its first token: no step
        assert r.served_steps == 0 and r.committed == 0 and r.tau_served == 0


def test_step_landing_exactly_on_max_new_tokens_is_followed_by_one_more(target):
    for make, per_step in ((Oracle, B), (lambda t: FirstK(t, 2), 3), (Wrong, 1)):
        for steps in (1, 2, 3):
            n = 1 + steps * per_step  # the prefill's token, then `steps` full steps
            r = speculative_generate(target, make(target), PROMPT, block_size=B, max_new_tokens=n)
            assert r.acceptance_lengths == [per_step] * (steps + 1), (per_step, steps)
            assert r.served_steps == steps and r.committed == n - 1
            assert r.tau == r.tau_served == r.tau_committed == per_step
            assert torch.equal(r.tokens, greedy_generate(target, PROMPT, n))
            if per_step == 1:  # one fewer lands exactly again
                continue
            # one token fewer: the last step crosses max_new_tokens and is the last one
            r = speculative_generate(
                target, make(target), PROMPT, block_size=B, max_new_tokens=n - 1
            )
            assert r.acceptance_lengths == [per_step] * steps
            assert r.served_steps == steps and r.committed == n - 1  # one past, counted
            assert r.tokens.numel() == n - 1


def first_new_token_where(tokens: list[int], ok) -> tuple[int, int]:
    """The first token at an index i with ok(i) that does not occur before it, and i."""
    for i in range(1, len(tokens)):
        if ok(i) and tokens[i] not in tokens[:i]:
            return tokens[i], i
    raise AssertionError(f"no such token in {tokens}")


def test_stop_token_inside_an_accepted_block_counts_the_whole_step(target):
    full = greedy_generate(target, PROMPT, 60).tolist()
    # oracle steps commit indices 1..B, B+1..2B, ...: an EOS among a later step's drafts
    eos, k = first_new_token_where(full, lambda i: i > B and i % B != 0)
    r = speculative_generate(
        target, Oracle(target), PROMPT, block_size=B, max_new_tokens=60, eos_token_ids=(eos,)
    )
    steps = (k - 1) // B + 1
    assert r.tokens.tolist() == full[: k + 1]
    assert r.acceptance_lengths == [B] * steps and r.tau == B  # z-lab: the step's j + 1
    assert r.served_steps == steps and r.tau_served == B
    assert r.committed == k and r.tau_committed == k / steps  # only the output tokens
    # FirstK(2): steps commit d1 d2 + bonus (indices 3s-2, 3s-1 | 3s); an EOS at a draft
    eos, k = first_new_token_where(full, lambda i: i % 3 != 0)
    r = speculative_generate(
        target, FirstK(target, 2), PROMPT, block_size=B, max_new_tokens=60, eos_token_ids=(eos,)
    )
    assert r.tokens.tolist() == full[: k + 1]
    assert r.acceptance_lengths == [3] * ((k - 1) // 3 + 1) and r.committed == k


def test_stop_token_as_the_bonus_token(target):
    full = greedy_generate(target, PROMPT, 60).tolist()
    eos, k = first_new_token_where(full, lambda i: i % 3 == 0)  # FirstK(2)'s bonus tokens
    r = speculative_generate(
        target, FirstK(target, 2), PROMPT, block_size=B, max_new_tokens=60, eos_token_ids=(eos,)
    )
    assert r.tokens.tolist() == full[: k + 1]
    assert r.acceptance_lengths == [3] * (k // 3) and r.served_steps == k // 3
    assert r.committed == k and r.tau == r.tau_served == r.tau_committed == 3
    eos, k = first_new_token_where(full, lambda i: i % B == 0)  # the oracle's
    r = speculative_generate(
        target, Oracle(target), PROMPT, block_size=B, max_new_tokens=60, eos_token_ids=(eos,)
    )
    assert r.acceptance_lengths == [B] * (k // B) and r.committed == k


def test_last_step_counts_in_full_past_max_new_tokens(target):
    r = speculative_generate(target, Oracle(target), PROMPT, block_size=B, max_new_tokens=10)
    assert r.acceptance_lengths == [B, B] and r.committed == 2 * B and r.tokens.numel() == 10


# ---- z-lab's loop, transcribed ---------------------------------------------------------


def zlab_dflash_generate(target, proposer, prompt, block_size, max_new_tokens, stop_token_ids):
    """``dflash_generate`` of z-lab's dflash (dflash/model.py) at temperature 0, its
    ``output_ids``/``start`` bookkeeping kept line for line; the drafts come from
    ``proposer`` and the target runs without a KV cache. Returns (output ids, acceptance
    lengths)."""
    num_input_tokens = prompt.numel()
    max_length = num_input_tokens + max_new_tokens
    output_ids = torch.full((max_length + block_size,), -1, dtype=torch.long)  # -1: MASK
    output_ids[:num_input_tokens] = prompt
    output_ids[num_input_tokens] = greedy_generate(target, prompt, 1)[0]
    acceptance_lengths = []
    start = num_input_tokens
    while start < max_length:
        block_output_ids = output_ids[start : start + block_size].clone()
        ctx, _ = target.features(output_ids[None, :start])
        block_output_ids[1:] = proposer.propose(output_ids[: start + 1], ctx[0], block_size - 1)
        seq = torch.cat([output_ids[:start], block_output_ids])
        _, last = target.features(seq[None])
        posterior = target.logits(last[0, start:]).argmax(-1)
        acceptance_length = int((block_output_ids[1:] == posterior[:-1]).cumprod(0).sum())
        output_ids[start : start + acceptance_length + 1] = block_output_ids[
            : acceptance_length + 1
        ]
        output_ids[start + acceptance_length + 1] = posterior[acceptance_length]
        start += acceptance_length + 1
        acceptance_lengths.append(acceptance_length + 1)
        if stop_token_ids is not None and any(
            s in output_ids[num_input_tokens:] for s in stop_token_ids
        ):
            break
    output_ids = output_ids[: min(start + 1, max_length)]
    if stop_token_ids is not None:
        stops = torch.isin(output_ids[num_input_tokens:], torch.tensor(stop_token_ids))
        hits = stops.nonzero()
        if hits.numel():
            output_ids = output_ids[: num_input_tokens + int(hits[0, 0]) + 1]
    return output_ids[num_input_tokens:], acceptance_lengths


class Memo:
    """``proposer``'s drafts, each computed once: the loops below ask for the drafts of the
    same committed tokens and context again and again (both loops, each ``max_new`` and
    stop token), and every proposer here is deterministic. Keyed on the exact tokens, the
    context's bytes and ``num``, so a loop passing other inputs still gets its own drafts."""

    def __init__(self, proposer) -> None:
        self.proposer, self.drafts = proposer, {}

    def propose(self, committed, ctx, num):
        key = (tuple(committed.tolist()), ctx.shape, ctx.dtype, ctx.numpy().tobytes(), num)
        if key not in self.drafts:
            self.drafts[key] = self.proposer.propose(committed, ctx, num).clone()
        return self.drafts[key].clone()


@pytest.mark.parametrize(
    "make", [Oracle, Wrong, lambda t: FirstK(t, 1), lambda t: FirstK(t, 3), drafter_proposer]
)
def test_steps_and_acceptance_lengths_are_zlabs(target, make):
    full = greedy_generate(target, PROMPT, 40).tolist()
    eos_choices = [None, (full[0],)]  # none, and the prefill's own token
    for k in (3, 6, 7, 12, 13):  # a few positions, inside blocks and at their ends
        eos_choices.append((first_new_token_where(full, lambda i, k=k: i >= k)[0],))
    proposer = Memo(make(target))
    for max_new in (1, 2, 6, 7, 12, 13, 19, 25):
        for eos in eos_choices:
            ref_tokens, ref_lengths = zlab_dflash_generate(
                target, proposer, PROMPT, B, max_new, eos
            )
            r = speculative_generate(
                target,
                proposer,
                PROMPT,
                block_size=B,
                max_new_tokens=max_new,
                eos_token_ids=eos or (),
            )
            assert r.acceptance_lengths == ref_lengths, (max_new, eos)
            assert torch.equal(r.tokens, ref_tokens), (max_new, eos)
            assert r.steps - 1 <= r.served_steps <= r.steps


# ---- the statistics --------------------------------------------------------------------


class OracleOrWrong(Oracle):
    """The oracle on prompts starting with ``PROMPT[0]``, always wrong on the others."""

    def propose(self, committed, ctx, num):
        good = super().propose(committed, ctx, num)
        if committed[0] != PROMPT[0]:
            good[0] = (good[0] + 1) % self.target.vocab_size
        return good


def test_per_prompt_mean_and_pooled_tau(target):
    other = torch.tensor([1, 2, 3])
    # PROMPT: 4 oracle steps of B tokens (tau B); other: 24 wrong steps of 1 token (tau 1),
    # the 24th z-lab's extra one (23 land it exactly on max_new_tokens)
    rep = evaluate_tau(
        target, OracleOrWrong(target), [PROMPT, other], block_size=B, max_new_tokens=4 * B
    )
    assert (rep.accepted, rep.steps) == (4 * B + 4 * B, 4 + 4 * B)
    assert (rep.prompt_tau_sum, rep.prompts) == (B + 1.0, 2)
    assert (rep.served_accepted, rep.served_steps, rep.committed) == (47, 27, 47)
    assert rep.tau == (B + 1) / 2  # 3.5: the reference statistic, every prompt weighs the same
    assert rep.tau_pooled == pytest.approx(8 * B / (4 + 4 * B))  # 48/28: dominated by `other`
    assert rep.tau_served == rep.tau_committed == pytest.approx(47 / 27)
    assert rep.tau != pytest.approx(rep.tau_pooled)
    assert rep.metrics() == {
        "tau": rep.tau,
        "tau_pooled": rep.tau_pooled,
        "tau_served": rep.tau_served,
        "tau_committed": rep.tau_committed,
    }

    # always right / always wrong: the statistics agree
    rep = evaluate_tau(target, Oracle(target), [PROMPT, other], block_size=B, max_new_tokens=13)
    assert rep.tau == rep.tau_pooled == rep.tau_served == B
    assert rep.steps == 6 and rep.served_steps == 4  # 13 = 1 + 2 B: one more step each
    rep = evaluate_tau(target, Wrong(target), [PROMPT, other], block_size=B, max_new_tokens=13)
    assert rep.tau == rep.tau_pooled == rep.tau_served == 1.0
    assert rep.steps == 26 and rep.served_steps == 24


def test_prefill_eos_prompt_counts_zlabs_step_only(target):
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
    assert rep == TauReport(
        accepted=14,
        steps=14,
        prompt_tau_sum=2.0,
        prompts=2,
        served_accepted=12,
        served_steps=12,
        committed=12,
    )
    assert rep.tau == rep.tau_pooled == rep.tau_served == 1.0
    assert TauReport.from_sums(rep.sums()) == rep
    assert all(v == 0 for v in TauReport().metrics().values())


def test_eos_ids_from_config(target):
    assert eos_ids(target.config) == ()  # the tiny target has none
    assert eos_ids(SimpleNamespace(eos_token_id=7)) == (7,)
    assert eos_ids(SimpleNamespace(eos_token_id=[151645, 151643, 151645])) == (151645, 151643)
    assert eos_ids(SimpleNamespace(eos_token_id=None)) == ()
    assert eos_ids(SimpleNamespace()) == ()
