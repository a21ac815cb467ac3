"""The batched verifier (``trainer.model.speculate``): prompt for prompt the same output,
acceptance lengths and served steps as the one-prompt reference, greedy, for a trained and a
DFlash2 drafter, at EOS and at max_new_tokens; sampled decoding lossless in distribution
(chi-square against the target's exact distribution, and the test's power shown on a rule
that is not lossless); seeded draws independent of the batch."""

from __future__ import annotations

import itertools

import pytest
import torch
from drafters import greedy_samples, train_run, trained_drafter

import trainer.model.speculate as speculate
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.speculate import BatchedVerifier, Sampling, accept, probabilities
from trainer.model.target import Target, TinyTargetSpec, build_tiny_model
from trainer.model.verifier import DrafterProposer, speculative_generate

pytestmark = pytest.mark.integration

B = 6
MASK = 511


@pytest.fixture(scope="module")
def samples(target):
    return greedy_samples(target, MASK)


@pytest.fixture(scope="module")
def drafter(target, samples, tmp_path_factory) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=MASK
    )
    torch.manual_seed(0)
    run = train_run(target, samples, tmp_path_factory.mktemp("run"), DFlashDrafter(cfg),
                    LossConfig(block_size=B, anchors_per_doc=8), 40)  # fmt: skip
    return trained_drafter(run)


def prompts(samples) -> list[torch.Tensor]:
    """Prompts of 1 to 30 tokens: the training prompts (high acceptance), their longer and
    shorter cuts, and random ids (low acceptance)."""
    g = torch.Generator().manual_seed(1)
    seen = [torch.tensor(ids[:n]) for (ids, _), n in zip(samples, itertools.cycle([8, 13, 3]))]
    rand = [torch.randint(1, 500, (n,), generator=g) for n in (1, 5, 30, 17)]
    return seen + rand


def reference(target, drafter, ps, max_new, eos):
    proposer = DrafterProposer(target, drafter)
    b = drafter.config.block_size
    run = speculative_generate
    return [run(target, proposer, p, block_size=b, max_new_tokens=max_new, eos_token_ids=eos)
            for p in ps]  # fmt: skip


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.tokens, w.tokens)
        assert g.acceptance_lengths == w.acceptance_lengths
        assert (g.served_steps, g.committed) == (w.served_steps, w.committed)


@pytest.mark.parametrize("max_new", [1, 7, 24])
def test_batched_greedy_equals_the_reference_prompt_for_prompt(target, drafter, samples, max_new):
    ps = prompts(samples)
    want = reference(target, drafter, ps, max_new, ())
    got = BatchedVerifier(target, drafter, max_new_tokens=max_new).generate(ps)
    assert_same(got, want)
    if max_new == 24:  # the trained drafter is really accepted on the prompts it saw
        assert max(r.tau for r in got[:8]) > 2.0


def test_batched_stops_at_eos_like_the_reference(target, drafter, samples):
    ps = prompts(samples)
    outs = BatchedVerifier(target, drafter, max_new_tokens=24).generate(ps)
    # stop tokens the target really produces: inside accepted blocks, bonus tokens, the
    # prefill's own token
    eos = (int(outs[0].tokens[5]), int(outs[3].tokens[0]), int(outs[9].tokens[11]))
    want = reference(target, drafter, ps, 24, eos)
    got = BatchedVerifier(target, drafter, max_new_tokens=24, eos_token_ids=eos).generate(ps)
    assert_same(got, want)
    assert any(r.tokens.numel() < 24 for r in got)


def test_squeezing_the_cache_every_step_changes_nothing(target, drafter, samples, monkeypatch):
    ps = prompts(samples)
    want = BatchedVerifier(target, drafter, max_new_tokens=24).generate(ps)
    monkeypatch.setattr(speculate, "HOLES_SHARE", -1.0)  # squeeze at every step
    assert_same(BatchedVerifier(target, drafter, max_new_tokens=24).generate(ps), want)


def test_a_dflash2_drafter_batched_equals_the_reference(target, samples):
    cfg = DrafterConfig.from_target(target.config, num_target_layers=3, block_size=B,
                                    mask_token_id=MASK, variant="dflash2")  # fmt: skip
    torch.manual_seed(0)
    d2 = DFlashDrafter(cfg).eval()
    ps = prompts(samples)
    assert_same(BatchedVerifier(target, d2, max_new_tokens=12).generate(ps),
                reference(target, d2, ps, 12, ()))  # fmt: skip


def test_probabilities_apply_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = probabilities(logits, Sampling(temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    top2 = probabilities(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4)
    # top-p 0.7: the first token holds 0.644 < 0.7, so the second is kept too, not the third
    nucleus = probabilities(logits, Sampling(temperature=1.0, top_p=0.7))
    assert torch.allclose(nucleus, top2, atol=1e-4)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


# ---- sampled decoding: lossless in distribution --------------------------------------------

V = 8  # a vocabulary small enough to enumerate three tokens (512 cells)
ROWS = 3000
LEVEL = 1e-3  # the chi-square test's level


@pytest.fixture(scope="module")
def small():
    """A random 8-token target, sharpened so drafts are accepted often (and rejected often),
    and a random block-4 drafter for it."""
    model = build_tiny_model(TinyTargetSpec(vocab_size=V, hidden_size=32, num_layers=2,
                                            num_heads=2, num_kv_heads=1, intermediate_size=64,
                                            seed=3))  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    target = Target(model, layer_ids=[0, 1])
    cfg = DrafterConfig.from_target(target.config, num_target_layers=2, block_size=4,
                                    mask_token_id=V - 1)  # fmt: skip
    torch.manual_seed(5)
    return target, DFlashDrafter(cfg).eval()


def exact_joint(target, prompt, s: Sampling) -> torch.Tensor:
    """P(t1, t2, t3) ``[V**3]`` of plain sampling from the target after ``prompt [1, P]``,
    by enumeration: one forward over the prompt followed by every (t1, t2)."""
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # row t1 * V + t2
    _, last = target.features(torch.cat([prompt.expand(len(pairs), -1), pairs], 1))
    p = probabilities(target.logits(last), s)
    k = prompt.shape[1] - 1
    p1 = p[0, k]  # P(t1)
    p2 = p[:, k + 1].view(V, V, V)[:, 0]  # P(t2 | t1): causal, so any t2 of the row
    p3 = p[:, k + 2].view(V, V, V)  # P(t3 | t1, t2)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's test of ``counts`` against ``probs`` (cells expecting fewer
    than 5 pooled into one)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def sampled_counts(small, s: Sampling) -> tuple[torch.Tensor, torch.Tensor, list]:
    target, drafter = small
    prompt = torch.tensor([1, 2, 3, 4])
    out = BatchedVerifier(target, drafter, max_new_tokens=3, sampling=s).generate([prompt] * ROWS)
    firsts = torch.stack([r.tokens[:3] for r in out])
    cell = (firsts * torch.tensor([V * V, V, 1])).sum(1)
    return torch.bincount(cell, minlength=V**3), exact_joint(target, prompt[None], s), out


@pytest.mark.parametrize("s", [Sampling(temperature=1.0, seed=0),
                               Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=1)])  # fmt: skip
def test_speculative_sampling_is_distributed_as_plain_sampling(small, s):
    counts, probs, out = sampled_counts(small, s)
    p = chi_square_p(counts, probs)
    assert p > LEVEL, f"chi-square p = {p:.2e}: the output is not the target's distribution"
    lengths = [n for r in out for n in r.acceptance_lengths]
    assert 1 in lengths and max(lengths) >= 3  # drafts rejected and accepted, both exercised


def test_the_chi_square_test_sees_a_rule_that_is_not_lossless(small, monkeypatch):
    # Accepting every draft is fast and wrong: the test must refuse it.
    def accept_all(drafts, logits, s, u=None):
        j = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return j, logits[:, -1].argmax(-1)

    monkeypatch.setattr(speculate, "accept", accept_all)
    counts, probs, _ = sampled_counts(small, Sampling(temperature=1.0, seed=0))
    assert chi_square_p(counts, probs) < LEVEL


def test_a_prompt_s_draws_do_not_depend_on_its_batch(small):
    target, drafter = small
    ps = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 1, 2, 3, 4])]
    s = Sampling(temperature=1.0, seed=7)
    v = BatchedVerifier(target, drafter, max_new_tokens=10, sampling=s)
    together = v.generate(ps, keys=[10, 11, 12])
    alone = v.generate(ps[1:2], keys=[11])
    assert torch.equal(together[1].tokens, alone[0].tokens)
    assert together[1].acceptance_lengths == alone[0].acceptance_lengths
    again = v.generate(ps, keys=[10, 11, 12])
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(together, again, strict=True))
    s8 = Sampling(temperature=1.0, seed=8)
    other = BatchedVerifier(target, drafter, max_new_tokens=10, sampling=s8).generate(
        ps, keys=[10, 11, 12]
    )
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(together, other, strict=True))


def test_accept_greedy_by_hand():
    logits = torch.full((2, 4, 5), -10.0)
    for r, best in enumerate([[1, 2, 3, 4], [1, 0, 3, 4]]):
        for k, t in enumerate(best):
            logits[r, k, t] = 10.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    j, nxt = accept(drafts, logits, Sampling())
    assert j.tolist() == [3, 1] and nxt.tolist() == [4, 0]
