"""One anchor rule on both sides: the planner's cost model counts the anchors (and so the
block slots) the trainer draws. The planner sees lengths only, so it states the rule for
documents supervised everywhere; with a loss mask the trainer draws from the supervised
positions, never more than the planner counted. And a document's anchors under the default
draw are its own: the same whatever shares its micro-batch, wherever it lands."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loader_server.planning import cost
from loader_server.wire.spec import AnchorRule
from trainer.model.blocks import DocumentDraw, LossConfig, plan_blocks, sample_anchors
from trainer.train.batches import pack_batch, pad_batch


def _padded(lengths: np.ndarray, masks: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.uint8)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.from_numpy(m)
    return mask, torch.from_numpy(lengths)


def _rule(rng: np.random.Generator, block: int) -> AnchorRule:
    return AnchorRule(block, int(rng.integers(1, 80)), int(rng.integers(1, 40)), 0)


@pytest.mark.parametrize("seed", range(20))
def test_trainer_draws_as_many_anchors_as_the_cost_model_counts(seed):
    rng = np.random.default_rng(seed)
    rule = _rule(rng, int(rng.integers(2, 17)))
    block = rule.block_size
    lengths = rng.integers(1, 6 * block + 140, size=int(rng.integers(1, 12)))
    mask, lens = _padded(lengths, [np.ones(n, np.uint8) for n in lengths])
    gen = torch.Generator().manual_seed(seed)
    _, valid = sample_anchors(mask, lens, gen, rule=rule)
    assert valid.sum(1).tolist() == cost.doc_anchors(rule, lengths).tolist()
    # The same count under the per-document draw.
    keys = DocumentDraw(seed, 0).keys(torch.arange(len(lengths)), int(lengths.max()))
    _, valid = sample_anchors(mask, lens, keys, rule=rule)
    assert valid.sum(1).tolist() == cost.doc_anchors(rule, lengths).tolist()


@pytest.mark.parametrize("seed", range(20))
def test_with_a_loss_mask_the_trainer_draws_from_supervised_positions_only(seed):
    rng = np.random.default_rng(100 + seed)
    rule = _rule(rng, int(rng.integers(2, 9)))
    block = rule.block_size
    lengths = rng.integers(1, 8 * block + 30, size=int(rng.integers(1, 10)))
    masks = [(rng.random(n) < rng.random()).astype(np.uint8) for n in lengths]
    mask, lens = _padded(lengths, masks)
    keys = DocumentDraw(seed, 3).keys(torch.arange(len(lengths)), int(lengths.max()))
    pos, valid = sample_anchors(mask, lens, keys, rule=rule)
    for d, (n, m) in enumerate(zip(lengths, masks, strict=True)):
        candidates = np.flatnonzero(m[: max(n - block + 1, 0)])
        want = -(-candidates.size // rule.tokens_per_anchor)
        want = min(rule.anchors_per_doc, want) if m.sum() >= 2 * block else 0
        assert int(valid[d].sum()) == want
        assert set(pos[d][valid[d]].tolist()) <= set(candidates.tolist())
    assert (valid.sum(1).numpy() <= cost.doc_anchors(rule, lengths)).all()


@pytest.mark.parametrize("seed", range(10))
def test_block_slots_of_a_micro_batch_are_the_cost_models(seed):
    rng = np.random.default_rng(200 + seed)
    cap = int(rng.integers(0, 60))  # 0: no cap; a cap only with the old per-micro-batch draw
    cfg = LossConfig(
        block_size=int(rng.integers(2, 9)),
        anchors_per_doc=int(rng.integers(1, 30)),
        tokens_per_anchor=int(rng.integers(1, 9)),
        max_anchors=cap,
        anchor_draw="micro-batch" if cap else "document",
    )
    lengths = rng.integers(1, 8 * cfg.block_size + 30, size=int(rng.integers(1, 10)))
    batch = pad_batch([(list(range(1, n + 1)), [1] * n) for n in lengths])
    draw = torch.Generator().manual_seed(seed) if cap else DocumentDraw(seed, 0)
    plan = plan_blocks(batch, cfg, draw)
    slots = cost.features(lengths, np.zeros(1, np.int64), layout="padded", rule=cfg.anchor_rule)
    blocks = 0 if plan is None else len(plan.blk_doc)
    assert blocks * cfg.block_size == slots[0, 3]


def _anchors_by_sample(batch, cfg, draw) -> dict[int, list[int]]:
    """Each sample's anchor positions in its document."""
    plan = plan_blocks(batch, cfg, draw)
    assert plan is not None
    out: dict[int, list[int]] = {int(s): [] for s in plan.sample_ids}
    for d, a in zip(plan.blk_doc.tolist(), plan.blk_anchor.tolist(), strict=True):
        out[int(plan.sample_ids[d])].append(a)
    return out


def test_a_documents_anchors_do_not_depend_on_its_micro_batch_or_layout():
    rng = np.random.default_rng(7)
    cfg = LossConfig(block_size=4, anchors_per_doc=6, tokens_per_anchor=3)
    docs = []
    for n in rng.integers(10, 60, size=9):
        mask = (rng.random(n) < 0.8).astype(int).tolist()
        docs.append((rng.integers(1, 100, size=n).tolist(), mask))
    ids = list(range(100, 109))
    draw = DocumentDraw(seed=5, epoch=2)
    alone = {}
    for i, d in zip(ids, docs, strict=True):  # each document in a micro-batch of its own
        alone.update(_anchors_by_sample(pad_batch([d], sample_ids=[i]), cfg, draw))
    together = _anchors_by_sample(pad_batch(docs, sample_ids=ids), cfg, draw)
    packed = _anchors_by_sample(pack_batch(docs[::-1], sample_ids=ids[::-1]), cfg, draw)
    split = {
        **_anchors_by_sample(pack_batch(docs[:4], sample_ids=ids[:4]), cfg, draw),
        **_anchors_by_sample(pad_batch(docs[4:], sample_ids=ids[4:]), cfg, draw),
    }
    assert together == alone == packed == split
    assert sum(map(len, together.values())) > 20
    # Another epoch or seed draws other anchors for the same documents.
    other = _anchors_by_sample(pad_batch(docs, sample_ids=ids), cfg, DocumentDraw(5, 3))
    assert other != together
    reseeded = _anchors_by_sample(pad_batch(docs, sample_ids=ids), cfg, DocumentDraw(6, 2))
    assert reseeded != together


def test_document_keys_are_uniform_and_independent_of_the_width():
    draw = DocumentDraw(seed=0, epoch=0)
    keys = draw.keys(torch.arange(2000), 64)
    assert keys.dtype == torch.float64 and keys.shape == (2000, 64)
    assert float(keys.min()) >= 0.0 and float(keys.max()) < 1.0
    assert abs(float(keys.mean()) - 0.5) < 0.005
    # Deciles hold a tenth each (a 128,000-key sample: within 1%).
    counts = torch.histc(keys.float(), bins=10, min=0, max=1) / keys.numel()
    assert torch.allclose(counts, torch.full((10,), 0.1), atol=0.01)
    assert torch.equal(draw.keys(torch.arange(2000), 200)[:, :64], keys)
    assert torch.equal(draw.keys(torch.tensor([17]), 64)[0], keys[17])


def test_a_cap_on_micro_batches_is_refused_with_the_per_document_draw():
    with pytest.raises(ValueError, match="max_anchors 64 caps the anchors of a micro-batch"):
        LossConfig(max_anchors=64)
    LossConfig(max_anchors=64, anchor_draw="micro-batch")  # the old draw keeps it
