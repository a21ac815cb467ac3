"""Target, drafter, mask, anchors and loss: hand-checked cases and leak properties."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from drafters import dense_attention, dense_layout, random_docs

from trainer.model.blocks import (
    DIVISORS,
    DocumentDraw,
    LossConfig,
    plan_blocks,
)
from trainer.model.drafter import (
    DFlashDrafter,
    DraftBlocks,
    DrafterConfig,
    plan_chunks,
)
from trainer.model.loss import draft_loss, zero_loss
from trainer.model.target import (
    Target,
    TinyTargetSpec,
    build_tiny_model,
    load_target,
    mask_token_id,
)
from trainer.model.verifier import DrafterProposer
from trainer.train.batches import pack_batch, pad_batch

B = 4


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511
    )
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    # Random (not freshly initialized) norms so that leaks could not hide behind symmetry.
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return d.eval()


# ---- mask ---------------------------------------------------------------------------------


# ---- anchors ------------------------------------------------------------------------------


# ---- loss targets and weights ------------------------------------------------------------


def hidden_of(target, drafter, feats, ids, anchors) -> torch.Tensor:
    with torch.no_grad():
        blocks = DraftBlocks.one_document(feats, anchors, ids[0, anchors])
        h = drafter(target.embed_tokens, blocks)
    return h.view(len(anchors), B, -1)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_the_divisors_are_the_weights_the_slots_and_the_documents(target, drafter, weighting):
    """``--loss-divisor``: the same weighted CE sum over the weights' sum or over the
    supervised slots; per sequence, the mean of each document's weighted mean, each one
    measured alone (its anchors are its own: ``DocumentDraw``)."""
    docs, draw = random_docs(3), DocumentDraw(seed=1, epoch=0)
    cfg = LossConfig(block_size=B, anchors_per_doc=4, tokens_per_anchor=1, weighting=weighting)
    batch = pack_batch(docs, sample_ids=[0, 1, 2])
    with torch.no_grad():
        out = {d: draft_loss(target, drafter, batch, replace(cfg, divisor=d), draw)
               for d in DIVISORS}  # fmt: skip
        alone = [draft_loss(target, drafter, pack_batch([doc], sample_ids=[i]), cfg, draw).loss
                 for i, doc in enumerate(docs)]  # fmt: skip
    by_weight, by_slot, by_doc = out["weight"], out["slots"], out["sequence"]
    slots = float(by_weight.count.sum())
    assert float(by_slot.divisor) == slots and slots > 3 * B
    assert float(by_slot.weighted_ce_sum) == pytest.approx(float(by_weight.weighted_ce_sum))
    assert float(by_slot.loss) == pytest.approx(float(by_weight.weighted_ce_sum) / slots)
    assert float(by_doc.divisor) == 3
    assert float(by_doc.loss) == pytest.approx(sum(float(a) for a in alone) / 3, rel=1e-5)
    # the three differ: the documents' lengths differ, and so do their weighted means
    assert len({round(float(o.loss), 6) for o in out.values()}) == 3


def test_a_document_without_weight_is_no_sequence():
    """Per sequence, a document whose weights all rounded to 0 trains nothing and is not
    counted (no 0/0); the slots' divisor is a count on the weights' device."""
    from trainer.model.loss import divided

    w = torch.tensor([0.0, 0.0, 1.0, 3.0])
    scaled, docs = divided(w, torch.tensor([5, 5, 9, 9]), "sequence")
    assert scaled.tolist() == [0.0, 0.0, 0.25, 0.75] and float(docs) == 1.0
    same, slots = divided(w, torch.tensor([5, 5, 9, 9]), "slots")
    assert same is w and float(slots) == 4.0 and slots.dtype == torch.float64


def test_loss_is_position_weighted_mean(target, drafter):
    batch = pad_batch(random_docs(3))
    cfg = LossConfig(
        block_size=B, anchors_per_doc=3, tokens_per_anchor=1, gamma=2.0, weighting="decay"
    )
    out = draft_loss(target, drafter, batch, cfg, torch.Generator().manual_seed(5))
    # Recompute by hand with the same anchors, one document at a time.
    plan = plan_blocks(batch, cfg, torch.Generator().manual_seed(5))
    feats = target.train_features(batch.input_ids)
    num = den = 0.0
    for d in range(3):
        n = int(batch.lengths[d])
        ids = batch.input_ids[d : d + 1, :n].long()
        anchors = plan.blk_anchor[plan.blk_doc == d].tolist()
        hidden = hidden_of(target, drafter, feats[d : d + 1, :n], ids, anchors)
        for j, a in enumerate(anchors):
            for k in range(1, B):
                ce = F.cross_entropy(target.lm_head(hidden[j, k])[None], ids[0, a + k][None])
                num += math.exp(-(k - 1) / 2.0) * float(ce)
                den += math.exp(-(k - 1) / 2.0)
    assert out.num_blocks == 9 and len(plan.blk_doc) == 9
    assert float(out.loss.detach()) == pytest.approx(num / den, rel=1e-5)
    assert out.count.tolist() == [9.0] * (B - 1)


def reference_hidden(drafter, target, feats, ids, anchors) -> torch.Tensor:
    """Today's (pre-chunking) computation, written out: all blocks of one document in one
    attention call against a dense ``[A*B, T + A*B]`` mask. ``[A, B, H]``."""
    mask, ctx, rope_q, rope_k = dense_layout(drafter, feats, anchors, B)
    h = drafter.block_inputs(target.embed_tokens, ids[0, torch.tensor(anchors)].long())
    for layer in drafter.layers:
        x = layer.input_layernorm(h)
        h = h + dense_attention(layer.self_attn, x, ctx, mask, rope_q, rope_k)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(len(anchors), B, -1)


def test_chunked_blocks_equal_the_dense_reference(target, drafter):
    ids = torch.tensor(random_docs(1, seed=4)[0][0])[None]
    feats = target.train_features(ids)
    anchors = [3, 7, 8, 12, 16]
    with torch.no_grad():
        ref = reference_hidden(drafter, target, feats, ids, anchors)
        for chunk_blocks in (1, 2, 5):
            blocks = replace(
                DraftBlocks.one_document(feats, anchors, ids[0, anchors]),
                chunks=plan_chunks([0] * 5, anchors, [0], chunk_blocks),
            )
            got = drafter(target.embed_tokens, blocks).view(5, B, -1)
            assert torch.allclose(got, ref, atol=1e-5), chunk_blocks


def _loss_and_grads(target, drafter, batch, chunk_size, attention="sdpa", weighting="decay"):
    drafter.zero_grad(set_to_none=True)
    cfg = LossConfig(block_size=B, anchors_per_doc=7, tokens_per_anchor=1, weighting=weighting)
    out = draft_loss(
        target, drafter, batch, cfg, _gen(), chunk_size=chunk_size, attention=attention
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    return out, grads


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("make", [pad_batch, pack_batch])
def test_chunked_loss_and_gradients_equal_unchunked(target, drafter, make, weighting):
    """Chunk sizes below one block, between, and above every slot give the reference loss,
    gradients and accuracy counts (fp32), under the decay and D-PACE's weights (computed
    after the head from each slot's CE: the fused head scales its stored gradients)."""
    batch = make(random_docs(4, seed=2))
    ref, ref_grads = _loss_and_grads(target, drafter, batch, 0, weighting=weighting)
    slots = int(ref.count.sum())
    for chunk in (2, B - 1, 3 * B + 1, 10 * slots):
        out, grads = _loss_and_grads(target, drafter, batch, chunk, weighting=weighting)
        assert torch.allclose(out.loss, ref.loss, rtol=1e-5), chunk
        assert torch.equal(out.correct, ref.correct) and torch.equal(out.count, ref.count)
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), (chunk, name)
    drafter.zero_grad(set_to_none=True)


def test_packed_and_padded_losses_agree(target, drafter):
    samples = random_docs(4)
    cfg = LossConfig(block_size=B, anchors_per_doc=5)
    losses = [
        float(
            draft_loss(
                target, drafter, mk(samples), cfg, torch.Generator().manual_seed(1)
            ).loss.detach()
        )
        for mk in (pad_batch, pack_batch)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_no_supervised_blocks_gives_no_loss(target, drafter):
    batch = pad_batch([([1] * 10, [1] * 10)])  # 10 supervised >= 2B = 8: trained
    out = draft_loss(target, drafter, batch, LossConfig(block_size=B), torch.Generator())
    assert out.loss is not None
    short = pad_batch([([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])])
    out = draft_loss(target, drafter, short, LossConfig(block_size=B), torch.Generator())
    assert out.loss is None and out.num_blocks == 0


def test_zero_loss_reaches_every_parameter(target, drafter):
    drafter.zero_grad(set_to_none=True)
    zero_loss(target, drafter).backward()
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


# ---- anchor cap per micro-batch -----------------------------------------------------------


def test_draft_loss_respects_the_anchor_cap(target, drafter):
    batch = pad_batch(random_docs(4))
    cfg = LossConfig(
        block_size=B, anchors_per_doc=6, tokens_per_anchor=1, max_anchors=9,
        anchor_draw="micro-batch",
    )  # fmt: skip
    out = draft_loss(target, drafter, batch, cfg, _gen())
    assert out.num_blocks == 9 and out.capped_blocks == 4 * 6 - 9
    again = draft_loss(target, drafter, batch, cfg, _gen())
    assert float(again.loss) == float(out.loss)


# ---- MASK ----------------------------------------------------------------------------------


def test_mask_slot_is_the_targets_embedding_row(target):
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=7
    )
    d = DFlashDrafter(cfg)
    assert d.mask_embedding is None
    assert not any("mask" in n for n, _ in d.named_parameters())
    x = d.block_inputs(target.embed_tokens, torch.tensor([3, 9]))
    emb = target.embed_tokens.weight
    assert torch.equal(x[0], emb[3]) and torch.equal(x[B], emb[9])
    assert all(torch.equal(x[i], emb[7]) for i in (1, B - 1, B + 1, 2 * B - 1))


# ---- no leaks: a block's output depends on nothing it must not see -------------------------


def test_block_sees_only_context_before_anchor_and_itself(target, drafter):
    torch.manual_seed(3)
    ids = torch.randint(1, 512, (1, 24))
    feats = torch.randn(1, 24, drafter.config.num_target_layers * drafter.config.hidden_size)
    anchors = [6, 11, 17]
    base = hidden_of(target, drafter, feats, ids, anchors)
    # Change context at and after anchor 11, and the anchor tokens of blocks 0 and 2.
    feats2 = feats.clone()
    feats2[:, 11:] = torch.randn_like(feats2[:, 11:])
    ids2 = ids.clone()
    ids2[0, 6], ids2[0, 17] = (ids[0, 6] + 1) % 512, (ids[0, 17] + 1) % 512
    moved = hidden_of(target, drafter, feats2, ids2, anchors)
    assert torch.allclose(base[1], moved[1], atol=1e-6)  # block 1 unaffected
    assert not torch.allclose(base[0], moved[0])  # its own anchor changed
    assert not torch.allclose(base[2], moved[2])  # its context changed
    # ... and it does depend on the context just before its anchor.
    feats3 = feats.clone()
    feats3[:, 10] += 1.0
    touched = hidden_of(target, drafter, feats3, ids, anchors)
    assert not torch.allclose(base[1], touched[1])


def test_packed_documents_do_not_leak(target, drafter):
    samples = random_docs(2)
    cfg = LossConfig(block_size=B, anchors_per_doc=4)
    first = float(draft_loss(target, drafter, pack_batch(samples[:1]), cfg, _gen()).loss.detach())
    # Changing the second document changes nothing the first document's blocks see.
    other = [samples[0], ([7] * len(samples[1][0]), [0] * len(samples[1][0]))]
    both = float(draft_loss(target, drafter, pack_batch(other), cfg, _gen()).loss.detach())
    assert first == pytest.approx(both, rel=1e-5)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(9)


def test_training_and_inference_see_the_same_block(target, drafter):
    """The verifier's draft logits at an anchor equal training's: no off-by-one."""
    ids = torch.tensor(random_docs(1)[0][0])[None]
    feats = target.train_features(ids)
    a = 12
    hidden = hidden_of(target, drafter, feats, ids, [a])
    with torch.no_grad():
        train_logits = target.lm_head(hidden[0, 1:])
        infer_logits = DrafterProposer(target, drafter).logits(ids[0, : a + 1], feats[0, :a])
    assert torch.allclose(train_logits, infer_logits, atol=1e-5)


# ---- target -------------------------------------------------------------------------------


def test_tiny_target_is_deterministic():
    a, b = build_tiny_model(TinyTargetSpec()), build_tiny_model(TinyTargetSpec())
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    c = build_tiny_model(TinyTargetSpec(seed=1))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_packed_target_features_equal_per_document(target):
    samples = random_docs(3)
    packed = pack_batch(samples)
    feats, _ = target.features(packed.input_ids, packed.position_ids)
    start = 0
    for ids, _ in samples:
        alone, _ = target.features(torch.tensor(ids)[None])
        assert torch.allclose(feats[0, start : start + len(ids)], alone[0], atol=1e-5)
        start += len(ids)


def test_packed_target_features_under_sdpa_run_one_document_at_a_time(target):
    """Under SDPA an unsharded target runs each document of a packed row as a forward of its
    own (a document starts where the positions stop counting up by one), so no dense
    ``[T, T]`` mask is built: the forwards are the documents', and each document's
    features equal its own padded row's."""
    samples = random_docs(4)
    packed = pack_batch(samples)
    seen: list[int] = []

    def count(_module, _args, kwargs):
        seen.append(int(kwargs["input_ids"].shape[1]))

    hook = target.base.register_forward_pre_hook(count, with_kwargs=True)
    try:
        feats = target.train_features(packed.input_ids, packed.position_ids)
    finally:
        hook.remove()
    assert seen == [len(ids) for ids, _ in samples]
    start = 0
    for ids, _ in samples:
        alone = target.train_features(torch.tensor(ids)[None])
        assert torch.allclose(feats[0, start : start + len(ids)], alone[0], atol=1e-6)
        start += len(ids)


def test_a_gpt_oss_target_s_packed_documents_are_each_alone(tmp_path):
    """GPT-OSS (sliding layers, attention sinks): Transformers' dense mask over a packed row
    let the later documents' features drift from the document alone (by ~0.05 here); one
    forward per document gives each exactly its own."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, num_hidden_layers=3, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    GptOssForCausalLM(config).save_pretrained(tmp_path / "gptoss")
    gpt = load_target(str(tmp_path / "gptoss"), layer_ids=[0, 1])
    samples = random_docs(3)
    packed = pack_batch(samples)
    feats = gpt.train_features(packed.input_ids, packed.position_ids)
    start = 0
    for ids, _ in samples:
        alone = gpt.train_features(torch.tensor(ids)[None])
        assert torch.equal(feats[0, start : start + len(ids)], alone[0])
        start += len(ids)


def test_packed_target_features_under_flex_equal_per_document(target):
    """``attention="flex"``: a packed row runs block-sparse under Transformers'
    flex_attention (no dense ``[T, T]`` mask) and gives each document's own features; the
    model's SDPA is back afterwards, and padded rows never leave it."""
    samples = random_docs(4)
    packed = pack_batch(samples)
    feats = target.train_features(packed.input_ids, packed.position_ids, "flex")
    assert target.config._attn_implementation == "sdpa"
    start = 0
    for ids, _ in samples:
        alone = target.train_features(torch.tensor(ids)[None])
        assert torch.allclose(feats[0, start : start + len(ids)], alone[0], atol=1e-5)
        start += len(ids)
    ids = torch.tensor(samples[0][0])[None]
    assert torch.equal(target.train_features(ids, None, "flex"), target.train_features(ids))
    with pytest.raises(ValueError, match="'sdpa' or 'flex'"):
        target.train_features(ids, None, "flash")


def test_target_from_directory(tmp_path, target):
    target.model.save_pretrained(tmp_path / "tiny")
    loaded = load_target(str(tmp_path / "tiny"), layer_ids=[1, 3])
    assert loaded.layer_ids == [1, 3] and loaded.feature_size == 2 * 128
    ids = torch.arange(1, 9)[None]
    assert torch.allclose(loaded.features(ids)[1], target.features(ids)[1], atol=1e-6)
    assert not any(p.requires_grad for p in loaded.model.parameters())
    with pytest.raises(ValueError, match="neither 'tiny' nor a model directory"):
        load_target(str(tmp_path / "missing"))


@pytest.mark.parametrize("layer_ids", [[0, 1, 2], [1, 3], [3]])
def test_captured_features_equal_output_hidden_states(target, layer_ids):
    """Hooks capture exactly ``hidden_states[id + 1]`` (the last layer's normed, as HF
    reports it); ``train_features`` stops early and gives the same values."""
    t = Target(target.model, layer_ids)
    ids = torch.tensor(random_docs(2)[1][0])[None]
    with torch.no_grad():
        hs = target.base(input_ids=ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    assert torch.allclose(t.features(ids)[0], expected, atol=1e-6)
    assert torch.allclose(t.train_features(ids), expected, atol=1e-6)


def test_train_features_stop_after_the_deepest_layer(target):
    t = Target(target.model, [0, 1])
    ran = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
        for i, layer in enumerate(t.layers)
    ]
    try:
        t.train_features(torch.arange(1, 9)[None])
    finally:
        for h in handles:
            h.remove()
    assert ran == [0, 1]


def test_mask_token_id_from_config_tokenizer_or_none(tmp_path, target):
    assert mask_token_id(target) == TinyTargetSpec().mask_token_id == 511
    plain = Target(build_tiny_model(TinyTargetSpec()))
    plain.config.mask_token_id = None
    assert mask_token_id(plain) is None
    plain.config.dflash_config = {"mask_token_id": 42}
    assert mask_token_id(plain) == 42


# ---- packed rows need a Transformers that splits them ---------------------------------------


def test_packed_rows_are_refused_where_transformers_does_not_split_them(target, monkeypatch):
    """Transformers splits a packed row into its documents by the position ids only from
    4.54 with torch 2.6; the probe finds this install does, and an install whose mask code
    does not (its detection switched off here, as before 4.54) is refused before a packed
    row trains across documents, naming the versions and the way out."""
    import transformers.masking_utils as masking

    from trainer.model.target import packed_rows_split

    batch = pack_batch(random_docs(2))
    assert packed_rows_split()
    target.train_features(batch.input_ids, batch.position_ids)  # this install: fine
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    packed_rows_split.cache_clear()
    try:
        assert not packed_rows_split()
        with pytest.raises(ValueError, match=r"lets the documents of a packed row attend.*"
                           r"transformers 4\.54 with torch 2\.6.*--layout padded"):  # fmt: skip
            target.train_features(batch.input_ids, batch.position_ids)
        target.train_features(pad_batch(random_docs(2)).input_ids)  # padded rows train on
    finally:
        monkeypatch.undo()
        packed_rows_split.cache_clear()
    assert packed_rows_split()
