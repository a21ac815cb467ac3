"""DFlash2's forward, head and walk against slow re-expressions written out here, row by row
and edge by edge (not through the trainer's helpers), on the tiny Qwen3 target.

* the block convolution: a loop over rows and taps, channel groups spelled with
  ``repeat_interleave`` instead of views;
* the drafter: a dense reference (one attention call per layer over an explicit mask) with
  that convolution around attention and MLP, against the chunked forward;
* a fresh DFlash2 drafter computes DFlash's hidden states (identity convolutions);
* the selector's edges and the greedy walk: explicit sums over the rank, step by step;
* the head: fused chunks against the plain autograd path (loss, every gradient), and the
  selector CE against a per-row formula with the label injected at rank K.
"""

from __future__ import annotations

import math

import pytest
import torch
from drafters import dense_attention, dense_layout, random_docs

from trainer.model.blocks import LossConfig, anchor_generator
from trainer.model.dflash2 import CandidateSelector, grouped_conv, training_candidates, walk
from trainer.model.drafter import (
    DFlashDrafter,
    DraftBlocks,
    DrafterConfig,
)
from trainer.model.loss import LogitRule, draft_loss, head_loss, selector_loss, zero_loss
from trainer.model.verifier import DrafterProposer, greedy_generate, speculative_generate
from trainer.train.batches import pack_batch, pad_batch

B, MASK = 4, 511


def slow_conv(x, delta, base, block):
    """``out[r] = sum_t (base[t] + delta[r, t, group(ch)]) * x[r - t]`` for ``r - t`` in
    ``r``'s block, one row and one tap at a time."""
    rows, hidden = x.shape
    groups = delta.shape[-1]
    out = torch.zeros_like(x)
    for r in range(rows):
        for t in range(base.shape[0]):
            if r % block >= t:
                per_channel = delta[r, t].repeat_interleave(hidden // groups)
                out[r] += (base[t] + per_channel) * x[r - t]
    return out


def config(target, **kw) -> DrafterConfig:
    values = dict(variant="dflash2", selector_rank=8, selector_top_k=5, conv_group_size=32)
    values.update(kw)
    return DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=2, block_size=B, mask_token_id=MASK,
        **values,
    )  # fmt: skip


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    """A DFlash2 drafter with every weight moved off its initialisation (the convolutions'
    identity, too), so that a wrong tap or group could not hide."""
    torch.manual_seed(0)
    d = DFlashDrafter(config(target, conv_kernel_size=3))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return d.eval()


def test_grouped_conv_equals_the_row_by_row_sum():
    g = torch.Generator().manual_seed(1)
    for taps, block in ((1, 4), (2, 4), (3, 5), (4, 4)):
        x = torch.randn(3 * block, 12, generator=g)
        delta, base = (
            torch.randn(3 * block, taps, 3, generator=g),
            torch.randn(taps, 12, generator=g),
        )
        got = grouped_conv(x, delta, base, block)
        assert torch.allclose(got, slow_conv(x, delta, base, block), atol=1e-6), (taps, block)


def reference_hidden(drafter, target, feats, ids, anchors) -> torch.Tensor:
    """The DFlash2 drafter written out for one document: a dense mask (context before the
    anchor, the whole own block), one SDPA call per layer, ``slow_conv`` around attention
    and MLP. ``[A, B, H]``."""
    cfg = drafter.config
    mask, ctx, rope_q, rope_k = dense_layout(drafter, feats, anchors, B)
    h = target.embed_tokens(torch.tensor([[int(ids[0, x])] + [MASK] * (B - 1) for x in anchors]))
    h = h.view(-1, cfg.hidden_size) * cfg.input_embedding_scale

    def conv(module, x, side, coefficients):
        return slow_conv(x, coefficients[:, side], module.base_kernel[side], B)

    for layer in drafter.layers:
        x = layer.input_layernorm(h)
        c = layer.attention_conv.kernel_projection(x).view(x.shape[0], 2, cfg.conv_kernel_size, -1)
        o = dense_attention(layer.self_attn, conv(layer.attention_conv, x, 0, c), ctx, mask,
                            rope_q, rope_k)  # fmt: skip
        h = h + conv(layer.attention_conv, o, 1, c)
        x = layer.post_attention_layernorm(h)
        c = layer.mlp_conv.kernel_projection(x).view(x.shape[0], 2, cfg.conv_kernel_size, -1)
        h = h + conv(layer.mlp_conv, layer.mlp(conv(layer.mlp_conv, x, 0, c)), 1, c)
    return drafter.norm(h).view(len(anchors), B, -1)


def test_chunked_forward_equals_the_written_out_drafter(target, drafter):
    ids = torch.tensor(random_docs(1, seed=4)[0][0])[None]
    feats = target.train_features(ids)
    anchors = [3, 7, 8, 12, 16]
    with torch.no_grad():
        ref = reference_hidden(drafter, target, feats, ids, anchors)
        got = drafter(
            target.embed_tokens, DraftBlocks.one_document(feats, anchors, ids[0, anchors])
        )
    assert torch.allclose(got.view(5, B, -1), ref, atol=1e-5)


def test_a_fresh_dflash2_drafter_computes_dflash(target):
    """Identity convolutions: with DFlash's weights a new DFlash2 drafter's hidden states
    are DFlash's, so DFlash2 starts where DFlash would (and ``--init-drafter`` of a DFlash
    folder's shape means the same model)."""
    v1 = DFlashDrafter(config(target, variant="dflash", vocab_size=None, **_V1)).eval()
    v2 = DFlashDrafter(config(target)).eval()
    missing = v2.load_state_dict(v1.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or k.startswith("candidate_selector") for k in missing)
    ids = torch.tensor(random_docs(1, seed=5)[0][0])[None]
    feats = target.train_features(ids)
    blocks = DraftBlocks.one_document(feats, [4, 9, 13], ids[0, [4, 9, 13]])
    with torch.no_grad():
        a, b = v1(target.embed_tokens, blocks), v2(target.embed_tokens, blocks)
    assert torch.allclose(a, b, atol=1e-6)


# The DFlash2 fields at their defaults, for a DFlash config built by the same helper.
_V1 = dict(selector_rank=256, selector_top_k=16, conv_group_size=16)


@torch.no_grad()
def test_edges_and_walk_equal_the_step_by_step_selector():
    torch.manual_seed(2)
    v, h, r, k, slots = 40, 16, 6, 5, 7
    sel = CandidateSelector(v, h, r, k)
    hidden, unary = torch.randn(slots, h), torch.randn(slots, k)
    cands = torch.stack([torch.randperm(v)[:k] for _ in range(slots)])
    anchor = 11
    edges = sel.edges(hidden, unary, cands, anchor)
    proj = hidden @ sel.hidden_projection.weight.t()
    for slot in range(slots):
        for p in range(k):
            prev = anchor if slot == 0 else int(cands[slot - 1, p])
            for c in range(k):
                want = float(unary[slot, c]) + sum(
                    float(sel.predecessor_codebook[prev, j] * proj[slot, j]
                          * sel.successor_codebook[cands[slot, c], j])
                    for j in range(r)
                )  # fmt: skip
                assert float(edges[slot, p, c]) == pytest.approx(want, abs=1e-5)
    # The walk: at each slot the best edge from the token taken before.
    taken, prev_tok = [], anchor
    for slot in range(slots):
        scores = [
            float(unary[slot, c]) + float((sel.predecessor_codebook[prev_tok] * proj[slot]
                                          * sel.successor_codebook[cands[slot, c]]).sum())
            for c in range(k)
        ]  # fmt: skip
        prev_tok = int(cands[slot, max(range(k), key=scores.__getitem__)])
        taken.append(prev_tok)
    assert walk(edges, cands).tolist() == taken


def test_training_candidates_put_a_missing_label_last():
    cands = torch.tensor([[5, 3, 9], [1, 2, 4], [7, 8, 6]])
    labels = torch.tensor([3, 0, 6])
    got, place, found = training_candidates(cands, labels)
    assert got.tolist() == [[5, 3, 9], [1, 2, 0], [7, 8, 6]]
    assert place.tolist() == [1, 2, 2] and found.tolist() == [True, False, True]


@pytest.mark.parametrize("rule", [LogitRule(1.0, None, 5), LogitRule(0.7, 4.0, 5)])
def test_the_selector_head_equals_its_per_row_formula(target, rule):
    """Unary CE of ``softcap(m * z)`` plus the K-way CE of unary + transition scores, per
    row, against ``head_loss`` + ``selector_loss`` (fused chunks and the plain path)."""
    torch.manual_seed(3)
    n, hsz = 29, target.config.hidden_size
    hidden = torch.randn(n, hsz)
    labels, prev = torch.randint(0, 512, (n,)), torch.randint(0, 512, (n,))
    weights = torch.rand(n)
    sel = CandidateSelector(512, hsz, 8, 5)
    want = 0.0
    for i in range(n):
        z = target.lm_head(hidden[i]).float() * rule.multiplier
        z = torch.tanh(z / rule.cap) * rule.cap if rule.cap else z
        unary = -torch.log_softmax(z, -1)[labels[i]]
        top = z.topk(5).indices.tolist()
        if int(labels[i]) not in top:
            top[-1] = int(labels[i])
        ctx = sel.predecessor_codebook[prev[i]] * (sel.hidden_projection.weight @ hidden[i])
        scores = torch.stack([z[c] + (ctx * sel.successor_codebook[c]).sum() for c in top])
        choice = -torch.log_softmax(scores, -1)[top.index(int(labels[i]))]
        want += float(weights[i] * (unary + choice).detach())
    for chunk in (0, 4, 64):
        out = head_loss(hidden, target.lm_head, labels, chunk, rule)
        ce, _ = selector_loss(sel, hidden, prev, out, weights, chunk)
        total = (out.ce * weights).sum() + ce
        assert float(total.detach()) == pytest.approx(want, rel=1e-5), chunk


def _loss_and_grads(target, drafter, batch, chunk_size):
    drafter.zero_grad(set_to_none=True)
    cfg = LossConfig(block_size=B, anchors_per_doc=7, tokens_per_anchor=1, selector_alpha=0.5)
    out = draft_loss(
        target, drafter, batch, cfg, anchor_generator(0, 0, 0, 0, 0), chunk_size=chunk_size
    )
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("make", [pad_batch, pack_batch])
def test_chunked_dflash2_loss_and_gradients_equal_unchunked(target, make):
    """The fused head's candidate logits carry their gradient back (through the soft cap
    and the multiplier) exactly as autograd does, for every parameter."""
    torch.manual_seed(4)
    drafter = DFlashDrafter(config(target, output_multiplier=0.9, final_logit_softcapping=5.0))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = make(random_docs(4, seed=2))
    ref, ref_grads = _loss_and_grads(target, drafter, batch, 0)
    for chunk in (2, B - 1, 3 * B + 1, 1000):
        out, grads = _loss_and_grads(target, drafter, batch, chunk)
        assert torch.allclose(out.loss, ref.loss, rtol=1e-5), chunk
        assert torch.equal(out.correct, ref.correct)
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), (chunk, name)
    assert ref_grads["candidate_selector.successor_codebook"].abs().sum() > 0
    assert ref_grads["layers.1.mlp_conv.kernel_projection.weight"].abs().sum() > 0


def test_zero_loss_touches_the_selector(target):
    drafter = DFlashDrafter(config(target))
    loss = zero_loss(target, drafter)
    loss.backward()
    assert float(loss.detach()) == 0.0
    for name, p in drafter.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_dflash2_drafts_losslessly_and_tau_counts_the_walk(target, drafter):
    """Speculative output equals plain greedy; the proposer's tokens are the walk's, which
    can differ from the unary argmax (the selector reranks)."""
    proposer = DrafterProposer(target, drafter)
    differ = 0
    for ids, _ in random_docs(3, seed=7):
        prompt = torch.tensor(ids[:10])
        res = speculative_generate(target, proposer, prompt, block_size=B, max_new_tokens=24)
        assert res.tokens[:24].tolist() == greedy_generate(target, prompt, 24)[:24].tolist()
        ctx = target.train_features(prompt[None])[0, :-1]
        drafted = proposer.propose(prompt, ctx, B - 1)
        differ += int(not torch.equal(drafted, proposer.logits(prompt, ctx).argmax(-1)))
        assert math.isfinite(res.tau) and 1.0 <= res.tau <= B
    assert differ > 0  # random selector weights rerank at least one block
