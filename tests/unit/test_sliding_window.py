"""Sliding-window drafter layers: the attention rule written out key by key, both kernels
against it, the drafter's chunked path against one chunk, and the config's checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.model.attention import FULL, BlockChunk, LayerRule, block_attention
from trainer.model.drafter import DFlashDrafter, DraftBlocks, DrafterConfig, plan_chunks


def slow_mask(chunk: BlockChunk, rule: LayerRule) -> torch.Tensor:
    """The rule one query and one key at a time, as SGLang/vLLM state it: the query of slot
    i of a block at anchor a sits at position a + i; a context key at position p of the same
    document is seen iff p < a (full) and, sliding, (a + i) - p <= w - 1; a block key j of
    the same block iff (sliding) j <= i and i - j <= w - 1, else always."""
    b, w, causal = chunk.block_size, rule.window, rule.causal
    n, span = int(chunk.blk_doc.numel()), int(chunk.ctx_doc.numel())
    out = torch.zeros(n * b, span + n * b, dtype=torch.bool)
    for q in range(n * b):
        blk, i = divmod(q, b)
        doc, a = int(chunk.blk_doc[blk]), int(chunk.blk_anchor[blk])
        for c in range(span):
            p = int(chunk.ctx_pos[c])
            seen = int(chunk.ctx_doc[c]) == doc and p < a
            out[q, c] = seen and (w is None or (a + i) - p <= w - 1)
        for j in range(b):
            if w is None:
                out[q, span + blk * b + j] = True
            elif causal:
                out[q, span + blk * b + j] = j <= i and i - j <= w - 1
            else:  # vLLM's non-causal window: w - 1 positions on either side
                out[q, span + blk * b + j] = abs(i - j) <= w - 1
    return out


def packed_chunk(doc_lens: list[int], blocks: list[tuple[int, int]], b: int) -> BlockChunk:
    """Documents packed one after another; ``blocks`` are (document, anchor) pairs."""
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(doc_lens)])
    pos = torch.cat([torch.arange(n) for n in doc_lens])
    blk_doc = torch.tensor([d for d, _ in blocks])
    blk_anchor = torch.tensor([a for _, a in blocks])
    return BlockChunk(docs, pos, blk_doc, blk_anchor, b)


def test_bidirectional_sliding_mask_hand_checked():
    # The same block as below, bidirectional: every slot sees the whole block (B <= w).
    m = packed_chunk([6], [(0, 4)], 3).dense_mask(LayerRule(window=3, causal=False))
    assert m.int().tolist() == [
        [0, 0, 1, 1, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]


def test_sliding_mask_hand_checked():
    # One document of 6 positions, a block of 3 at anchor 4, window 3.
    m = packed_chunk([6], [(0, 4)], 3).dense_mask(LayerRule(window=3))
    assert m.int().tolist() == [
        # ctx p0..p5        | block slots 0 1 2
        [0, 0, 1, 1, 0, 0, 1, 0, 0],  # slot 0 (position 4): p2, p3 and itself
        [0, 0, 0, 1, 0, 0, 1, 1, 0],  # slot 1 (position 5): p3, slots 0-1
        [0, 0, 0, 0, 0, 0, 1, 1, 1],  # slot 2 (position 6): slots 0-2, no context
    ]


@st.composite
def chunks(draw):
    b = draw(st.integers(2, 5))
    doc_lens = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    blocks = sorted(
        draw(
            st.lists(
                st.integers(0, len(doc_lens) - 1).flatmap(
                    lambda d: st.tuples(st.just(d), st.integers(0, doc_lens[d] - 1))
                ),
                min_size=1,
                max_size=4,
            )
        )
    )
    window = draw(st.one_of(st.none(), st.integers(1, 14)))
    causal = window is None or draw(st.booleans())
    return packed_chunk(doc_lens, blocks, b), LayerRule(window=window, causal=causal)


@settings(max_examples=80, deadline=None)
@given(chunks())
def test_every_mask_of_the_rule_is_the_rule_written_out(case):
    chunk, rule = case
    want = slow_mask(chunk, rule)
    assert torch.equal(chunk.dense_mask(rule), want)
    # The per-document regrouping (SDPA's) selects the same keys for every query.
    idx = chunk.per_document(rule)
    for slot in range(chunk.num_queries):
        d, row = int(idx.slot_doc[slot]), int(idx.slot_row[slot])
        seen = idx.k_index[d][idx.mask[d, row]]  # chunk key indices: context, then blocks
        assert sorted(seen.tolist()) == torch.nonzero(want[slot]).flatten().tolist()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 7, 64])
def test_sdpa_and_flex_equal_the_dense_mask_with_a_window(window, causal):
    pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(window)
    chunk = packed_chunk(
        [40, 30, 20], [(0, 5), (0, 17), (0, 39), (1, 0), (1, 12), (1, 29), (2, 3)], 4
    )
    rule = LayerRule(window=window, causal=causal)
    q = torch.randn(1, 4, chunk.num_queries, 16, generator=g)
    k = torch.randn(1, 2, chunk.num_keys, 16, generator=g)
    v = torch.randn(1, 2, chunk.num_keys, 16, generator=g)
    per_doc = block_attention(q, k, v, chunk, "sdpa", rule)
    flex = block_attention(q, k, v, chunk, "flex", rule)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    mask = chunk.dense_mask(rule)[None, None]
    dense = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    assert torch.allclose(per_doc, dense, atol=1e-5)
    assert torch.allclose(flex, dense, atol=1e-5)
    # A full layer on the same chunk is another rule, cached apart (the same one when the
    # window holds every document and the block is bidirectional).
    full = block_attention(q, k, v, chunk, "sdpa", FULL)
    assert torch.allclose(full, per_doc, atol=1e-5) == (not causal and window >= 40)


def small_config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
        num_target_layers=2, num_layers=3, block_size=4, mask_token_id=5,
    )  # fmt: skip
    return DrafterConfig(**{**base, **kw})


def test_a_mixed_drafter_drafts_alike_in_chunks_and_in_one():
    """Chunked and checkpointed (several chunks) or not, every slot's hidden state is the
    same: the sliding rule travels with each layer, not with the chunk."""
    torch.manual_seed(0)
    cfg = small_config(
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=5,
    )
    drafter = DFlashDrafter(cfg)
    assert [layer.rule for layer in drafter.layers] == [LayerRule(5), FULL, LayerRule(5)]
    embed = torch.nn.Embedding(16, 32)
    n = 30
    feats = torch.randn(1, n, 64)
    anchors = [0, 3, 9, 14, 20, 25]
    one = DraftBlocks.one_document(feats, anchors, torch.tensor([1, 2, 3, 4, 5, 6]))
    whole = drafter(embed, one)
    for chunk_blocks in (1, 2, 4):
        pieces = DraftBlocks(
            **{**one.__dict__, "chunks": plan_chunks([0] * 6, anchors, [0], chunk_blocks)}
        )
        with torch.no_grad():
            assert torch.allclose(drafter(embed, pieces), whole, atol=1e-5)
    full = DFlashDrafter(small_config())
    full.load_state_dict(drafter.state_dict())
    assert not torch.allclose(full(embed, one), whole, atol=1e-3)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"layer_types": ("sliding_attention",) * 3}, "need a sliding_window"),
        ({"sliding_window": 8}, "no layer is sliding_attention"),
        ({"layer_types": ("full_attention",) * 2}, "2 entries for 3 drafter layers"),
        ({"layer_types": ("full_attention", "swa", "full_attention")}, "'swa'"),
        ({"layer_types": ("sliding_attention",) * 3, "sliding_window": 0}, ">= 1, got 0"),
        ({"sliding_causal": False}, "no layer is sliding"),
    ],
)
def test_config_refuses_what_it_cannot_mean(kw, message):
    with pytest.raises(ValueError, match=message):
        small_config(**kw)


def test_layer_types_from_json_are_the_same_config():
    a = small_config(layer_types=["sliding_attention"] * 3, sliding_window=4)
    assert a == small_config(layer_types=("sliding_attention",) * 3, sliding_window=4)
    assert a.to_dict()["layer_types"] == ("sliding_attention",) * 3


def test_all_full_layer_types_is_the_plain_config():
    assert small_config(layer_types=["full_attention"] * 3) == small_config()
    with pytest.raises(ValueError, match="a sequence of names"):
        small_config(layer_types="sliding_attention")
