"""Target, drafter, mask, anchors and loss: hand-checked cases and leak properties."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.batches import DocView, pack_batch, pad_batch
from trainer.drafter import DFlashDrafter, DrafterConfig, block_attention_mask
from trainer.loss import (
    LossConfig,
    block_hidden,
    block_targets,
    draft_loss,
    position_weights,
    sample_anchors,
)
from trainer.target import Target, TinyTargetSpec, build_tiny_model, default_layer_ids, load_target
from trainer.verifier import DrafterProposer

B = 4


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(target.config, num_target_layers=3, block_size=B)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg, target.embed_tokens.weight.mean(0))
    # Random (not freshly initialized) norms so that leaks could not hide behind symmetry.
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return d.eval()


# ---- mask ---------------------------------------------------------------------------------


def test_mask_hand_checked():
    # Context of 5 positions, blocks of 2 at anchors 1 and 3.
    m = block_attention_mask(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), 5, 2)
    expected = torch.tensor(
        [
            # ctx t0..t4   | block keys b0 b1 (block 0) b2 b3 (block 1)
            [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0, anchor slot: sees t0 only (< 1)
            [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0, mask slot: same, bidirectional in block
            [1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1: t0..t2 (< 3), not block 0
            [1, 1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[0], expected)


def test_mask_invalid_block_sees_only_itself():
    m = block_attention_mask(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), 3, 2)
    assert torch.equal(m[0, 2:], torch.tensor([[0, 0, 0, 0, 0, 1, 1]] * 2, dtype=torch.bool))
    assert torch.equal(m[0, :2, :3], torch.tensor([[1, 1, 0]] * 2, dtype=torch.bool))


def test_mask_anchor_zero_sees_no_context():
    m = block_attention_mask(torch.tensor([[0]]), torch.tensor([[True]]), 4, 3)
    assert not m[0, :, :4].any() and m[0, :, 4:].all()


# ---- anchors ------------------------------------------------------------------------------


def test_anchors_hand_checked():
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    pos, valid = sample_anchors(
        lm, torch.tensor([10]), num_anchors=100, block_size=2, generator=torch.Generator()
    )
    # Supervised from 3; a block of 2 needs a + 2 <= 10: anchors 3..8, all of them.
    assert pos[0][valid[0]].tolist() == [3, 4, 5, 6, 7, 8]


def test_anchors_skip_docs_with_few_supervised_tokens():
    lm = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    # B=4 needs 8 supervised tokens: doc 0 has 7, doc 1 has 6 -> nothing.
    _, valid = sample_anchors(
        lm, torch.tensor([8, 8]), num_anchors=4, block_size=4, generator=torch.Generator()
    )
    assert not valid.any()


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n_docs=st.integers(1, 4),
    block=st.integers(2, 5),
    num_anchors=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_anchor_properties(data, n_docs, block, num_anchors, seed):
    lengths = [data.draw(st.integers(1, 30)) for _ in range(n_docs)]
    width = max(lengths)
    lm = torch.zeros(n_docs, width, dtype=torch.uint8)
    for d, n in enumerate(lengths):
        bits = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        lm[d, :n] = torch.tensor(bits, dtype=torch.uint8)
    pos, valid = sample_anchors(
        lm,
        torch.tensor(lengths),
        num_anchors=num_anchors,
        block_size=block,
        generator=torch.Generator().manual_seed(seed),
    )
    for d, n in enumerate(lengths):
        chosen = pos[d][valid[d]].tolist()
        cands = [a for a in range(n) if lm[d, a] == 1 and a + block <= n]
        assert len(chosen) == len(set(chosen)) <= num_anchors
        if int(lm[d].sum()) < 2 * block:
            assert chosen == []
            continue
        assert set(chosen) <= set(cands)
        assert len(chosen) == min(num_anchors, len(cands))


def test_anchors_resampled_per_generator():
    lm = torch.ones(1, 200, dtype=torch.uint8)
    draw = [
        sample_anchors(
            lm,
            torch.tensor([200]),
            num_anchors=8,
            block_size=4,
            generator=torch.Generator().manual_seed(s),
        )[0]
        for s in (1, 1, 2)
    ]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])


# ---- loss targets and weights ------------------------------------------------------------


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)]))


def test_block_targets_hand_checked():
    ids = torch.arange(100, 110)[None]
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]])
    labels, w = block_targets(ids, lm, torch.tensor([[3, 0]]), torch.tensor([[True, False]]), 4, 2)
    # Anchor 3: offsets k = 1, 2, 3 predict tokens 4, 5, 6 (ids 104, 105, 106).
    assert labels[0, 0].tolist() == [104, 105, 106]
    e = math.exp(-0.5)
    assert torch.allclose(w[0, 0], torch.tensor([1.0, e, e * e]))
    assert not w[0, 1].any()  # invalid anchor
    labels, w = block_targets(ids, lm, torch.tensor([[5]]), torch.tensor([[True]]), 4, 2)
    assert w[0, 0, 1] == 0 and w[0, 0, 0] > 0  # loss_mask[7] == 0 drops offset 2


def _samples(n_docs: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_docs):
        n = 20 + 7 * d
        ids = torch.randint(1, 512, (n,), generator=g).tolist()
        out.append((ids, [0] * 5 + [1] * (n - 5)))
    return out


def test_loss_is_position_weighted_mean(target, drafter):
    batch = pad_batch(_samples(3))
    cfg = LossConfig(block_size=B, num_anchors=3, gamma=2.0)
    out = draft_loss(target, drafter, batch, cfg, torch.Generator().manual_seed(5))
    # Recompute by hand with the same anchors.
    docs = DocView.of(batch)
    lm = docs.gather(batch.loss_mask)
    pos, valid = sample_anchors(
        lm, docs.length, num_anchors=3, block_size=B, generator=torch.Generator().manual_seed(5)
    )
    ids = batch.input_ids.long()
    feats, _ = target.features(batch.input_ids)
    with torch.no_grad():
        hidden = block_hidden(target, drafter, feats, ids, pos, valid, B)
    num = den = 0.0
    for d in range(3):
        for j in range(pos.shape[1]):
            if not valid[d, j]:
                continue
            for k in range(1, B):
                logits = target.lm_head(hidden[d, j, k])
                ce = F.cross_entropy(logits[None], ids[d, pos[d, j] + k][None])
                num += math.exp(-(k - 1) / 2.0) * float(ce)
                den += math.exp(-(k - 1) / 2.0)
    assert out.num_blocks == int(valid.sum()) == 9
    assert float(out.loss.detach()) == pytest.approx(num / den, rel=1e-5)
    assert out.count.tolist() == [9.0] * (B - 1)


def test_packed_and_padded_losses_agree(target, drafter):
    samples = _samples(4)
    cfg = LossConfig(block_size=B, num_anchors=5)
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


# ---- no leaks: a block's output depends on nothing it must not see -------------------------


def test_block_sees_only_context_before_anchor_and_itself(target, drafter):
    torch.manual_seed(3)
    ids = torch.randint(1, 512, (1, 24))
    feats = torch.randn(1, 24, drafter.config.num_target_layers * drafter.config.hidden_size)
    pos = torch.tensor([[6, 11, 17]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        base = block_hidden(target, drafter, feats, ids, pos, valid, B)
        # Change context at and after anchor 11, and the anchor tokens of blocks 0 and 2.
        feats2 = feats.clone()
        feats2[:, 11:] = torch.randn_like(feats2[:, 11:])
        ids2 = ids.clone()
        ids2[0, 6], ids2[0, 17] = (ids[0, 6] + 1) % 512, (ids[0, 17] + 1) % 512
        moved = block_hidden(target, drafter, feats2, ids2, pos, valid, B)
    assert torch.allclose(base[0, 1], moved[0, 1], atol=1e-6)  # block 1 unaffected
    assert not torch.allclose(base[0, 0], moved[0, 0])  # its own anchor changed
    assert not torch.allclose(base[0, 2], moved[0, 2])  # its context changed
    # ... and it does depend on the context just before its anchor.
    feats3 = feats.clone()
    feats3[:, 10] += 1.0
    with torch.no_grad():
        touched = block_hidden(target, drafter, feats3, ids, pos, valid, B)
    assert not torch.allclose(base[0, 1], touched[0, 1])


def test_packed_documents_do_not_leak(target, drafter):
    samples = _samples(2)
    cfg = LossConfig(block_size=B, num_anchors=4)
    first = float(draft_loss(target, drafter, pack_batch(samples[:1]), cfg, _gen()).loss.detach())
    # Changing the second document changes nothing the first document's blocks see.
    other = [samples[0], ([7] * len(samples[1][0]), [0] * len(samples[1][0]))]
    both = float(draft_loss(target, drafter, pack_batch(other), cfg, _gen()).loss.detach())
    assert first == pytest.approx(both, rel=1e-5)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(9)


def test_training_and_inference_see_the_same_block(target, drafter):
    """The verifier's draft logits at an anchor equal training's: no off-by-one."""
    ids = torch.tensor(_samples(1)[0][0])[None]
    feats, _ = target.features(ids)
    a = 12
    with torch.no_grad():
        hidden = block_hidden(
            target, drafter, feats, ids, torch.tensor([[a]]), torch.ones(1, 1, dtype=bool), B
        )
        train_logits = target.lm_head(hidden[0, 0, 1:])
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
    samples = _samples(3)
    packed = pack_batch(samples)
    feats, _ = target.features(packed.input_ids, packed.position_ids)
    start = 0
    for ids, _ in samples:
        alone, _ = target.features(torch.tensor(ids)[None])
        assert torch.allclose(feats[0, start : start + len(ids)], alone[0], atol=1e-5)
        start += len(ids)


def test_target_from_directory(tmp_path, target):
    target.model.save_pretrained(tmp_path / "tiny")
    loaded = load_target(str(tmp_path / "tiny"), layer_ids=[1, 3])
    assert loaded.layer_ids == [1, 3] and loaded.feature_size == 2 * 128
    ids = torch.arange(1, 9)[None]
    assert torch.allclose(loaded.features(ids)[1], target.features(ids)[1], atol=1e-6)
    assert not any(p.requires_grad for p in loaded.model.parameters())
    with pytest.raises(ValueError, match="neither 'tiny' nor a model directory"):
        load_target(str(tmp_path / "missing"))


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(4) == [0, 1, 2]
    assert default_layer_ids(2) == [0]
    with pytest.raises(ValueError, match="out of range"):
        Target(build_tiny_model(TinyTargetSpec()), [4])
