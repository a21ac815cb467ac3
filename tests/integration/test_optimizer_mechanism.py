"""Why Muon's drafter accepts more than AdamW's (docs/EXPERIMENT.md, Part 8), in the code:
each weight's change over training, measured by its stable rank (``||dW||_F^2 /
||dW||_2^2``: the number of directions it moves along), on the real objective
(``draft_loss``, D-PACE) of a one-layer drafter over the tiny target.

* The first layer's queries come from the block's supervised slots only, and those are all
  the one frozen MASK row (the anchor's slot is never supervised, and at one layer its query
  reaches no loss): ``q_proj``'s gradient is ``(sum of the slots' query gradients) x
  norm(MASK)``, rank one whatever the data. AdamW's elementwise step keeps a sum of such
  matrices rank one, so its ``q_proj`` moves along one direction for the whole run (the
  experiment measured 1.0 in every run).
* Every other matrix's gradient has a few dominant directions; AdamW's change follows them,
  Muon orthogonalizes each step (its singular values all near one), so it moves every
  matrix along many directions (the experiment: 4.7 against 44.5, medians).
"""

from __future__ import annotations

import pytest
import torch
from drafters import random_docs

from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.loss import draft_loss
from trainer.train.batches import pack_batch
from trainer.train.optimizers import make_optimizer

B = 8
LOSS = LossConfig(block_size=B, anchors_per_doc=7, tokens_per_anchor=1, weighting="dpace")


def stable_rank(m: torch.Tensor) -> float:
    s = torch.linalg.svdvals(m.double())
    return float((s**2).sum() / s[0] ** 2)


def drafter(target, layers: int) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511, num_layers=layers
    )
    torch.manual_seed(0)
    return DFlashDrafter(cfg)


def backward(target, d: DFlashDrafter, seed: int) -> None:
    batch = pack_batch(random_docs(6, seed=seed))
    draft_loss(target, d, batch, LOSS, torch.Generator().manual_seed(seed)).loss.backward()


@pytest.mark.parametrize("layers", [1, 2])
def test_the_first_layer_s_query_gradient_is_rank_one_at_one_layer(target, layers):
    """At two layers the anchor's slot reaches the loss through the second layer's keys, so
    the first layer's queries see the anchors' embeddings too: the rank-one gradient is the
    one-layer drafter's (the default), not an accident of the data."""
    d = drafter(target, layers)
    backward(target, d, seed=2)
    s = torch.linalg.svdvals(d.layers[0].self_attn.q_proj.weight.grad.double())
    if layers == 1:
        assert s[1] / s[0] < 1e-5, s[:3]
    else:
        assert s[1] / s[0] > 1e-2, s[:3]
    k = torch.linalg.svdvals(d.layers[0].self_attn.k_proj.weight.grad.double())
    assert k[1] / k[0] > 1e-2  # the keys see the context: no such collapse


def test_adamw_moves_the_queries_along_one_direction_and_muon_every_matrix_along_many(target):
    changes = {}
    for kind, lr in (("adamw", 1e-3), ("muon", 1e-2)):  # each at its best rate (Part 8)
        d = drafter(target, 1)
        start = {n: p.detach().clone() for n, p in d.named_parameters() if p.ndim == 2}
        opt = make_optimizer(kind, d.named_parameters(), lr=lr, weight_decay=0.01)
        for step in range(6):
            opt.zero_grad()
            backward(target, d, seed=step)
            opt.step()
        changes[kind] = {
            n: stable_rank(p.detach() - start[n]) for n, p in d.named_parameters() if n in start
        }
    adamw, muon = changes["adamw"], changes["muon"]
    q = "layers.0.self_attn.q_proj.weight"
    assert adamw[q] < 1.001, adamw  # rank one, up to the weight decay's small full-rank pull
    others = [n for n in adamw if n != q]
    assert len(others) == 7  # fc, k, v, o, gate, up, down
    for name in others:
        assert muon[name] > 4 * adamw[name], (name, adamw[name], muon[name])
