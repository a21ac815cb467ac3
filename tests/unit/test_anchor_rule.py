"""One anchor rule on both sides: the planner's cost model counts the anchors (and so the
block slots) the trainer draws. The planner sees lengths only, so it states the rule for
documents supervised everywhere; with a loss mask the trainer draws from the supervised
positions, never more than the planner counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loader_server.planning import cost
from trainer.model.blocks import LossConfig, plan_blocks, sample_anchors
from trainer.train.batches import pad_batch


def _padded(lengths: np.ndarray, masks: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.uint8)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.from_numpy(m)
    return mask, torch.from_numpy(lengths)


@pytest.mark.parametrize("seed", range(20))
def test_trainer_draws_as_many_anchors_as_the_cost_model_counts(seed):
    rng = np.random.default_rng(seed)
    block = int(rng.integers(2, 17))
    per_doc = int(rng.integers(1, 80))
    lengths = rng.integers(1, 6 * block + 40, size=int(rng.integers(1, 12)))
    mask, lens = _padded(lengths, [np.ones(n, np.uint8) for n in lengths])
    gen = torch.Generator().manual_seed(seed)
    _, valid = sample_anchors(mask, lens, anchors_per_doc=per_doc, block_size=block, generator=gen)
    assert valid.sum(1).tolist() == cost.doc_anchors(lengths, block, per_doc).tolist()


@pytest.mark.parametrize("seed", range(20))
def test_with_a_loss_mask_the_trainer_draws_from_supervised_positions_only(seed):
    rng = np.random.default_rng(100 + seed)
    block, per_doc = int(rng.integers(2, 9)), int(rng.integers(1, 40))
    lengths = rng.integers(1, 8 * block + 30, size=int(rng.integers(1, 10)))
    masks = [(rng.random(n) < rng.random()).astype(np.uint8) for n in lengths]
    mask, lens = _padded(lengths, masks)
    gen = torch.Generator().manual_seed(seed)
    pos, valid = sample_anchors(
        mask, lens, anchors_per_doc=per_doc, block_size=block, generator=gen
    )
    for d, (n, m) in enumerate(zip(lengths, masks, strict=True)):
        candidates = np.flatnonzero(m[: max(n - block + 1, 0)])
        want = min(per_doc, candidates.size) if m.sum() >= 2 * block else 0
        assert int(valid[d].sum()) == want
        assert set(pos[d][valid[d]].tolist()) <= set(candidates.tolist())
    assert (valid.sum(1).numpy() <= cost.doc_anchors(lengths, block, per_doc)).all()


@pytest.mark.parametrize("seed", range(10))
def test_block_slots_of_a_micro_batch_are_the_cost_models(seed):
    rng = np.random.default_rng(200 + seed)
    cfg = LossConfig(
        block_size=int(rng.integers(2, 9)),
        anchors_per_doc=int(rng.integers(1, 30)),
        max_anchors=int(rng.integers(0, 60)),  # 0: no cap
    )
    lengths = rng.integers(1, 8 * cfg.block_size + 30, size=int(rng.integers(1, 10)))
    batch = pad_batch([(list(range(1, n + 1)), [1] * n) for n in lengths])
    plan = plan_blocks(batch, cfg, torch.Generator().manual_seed(seed))
    rule = (cfg.block_size, cfg.anchors_per_doc, cfg.max_anchors)
    slots = cost.features(lengths, np.zeros(1, np.int64), layout="padded", rule=rule)[0, 3]
    blocks = 0 if plan is None else len(plan.blk_doc)
    assert blocks * cfg.block_size == slots
