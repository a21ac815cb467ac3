"""One objective, however the loader cut the step.

The loader decides how a step is cut (rows, micro-batches, ranks); the loss an optimizer
step follows must not depend on that cut. Under ``LossConfig.normalization`` "step" (the
default) each micro-batch backpropagates its weighted block cross-entropy *sum*
(``micro_loss``); once the step's micro-batches are done, one scalar all-reduce gives the
step's total divisor over every rank, and the gradients (DDP's average over ranks) are
multiplied by ``world_size / total`` before clipping (``normalize_gradients``). The step's
gradient is then that of

    (sum of weighted block CE over every micro-batch of every rank)
    / (sum of the divisor over the same),

the divisor (``LossConfig.divisor``, ``--loss-divisor``) being the weights (the default: a
weighted mean), the supervised slots, or the documents (each document's weights first
divided by their sum: the mean over documents of each one's weighted mean). A document
lies in one micro-batch, so each of them is a sum over the step's documents too.

whatever ``world_size``, ``grad_accum``, layout and rank assignment, and the logged
``loss`` is that quotient (``trainer.train.step.step_record``). With a document's anchors a
function of the document (``trainer.model.blocks.DocumentDraw``), the step's objective is a
function of the step's documents alone (tested across cuts: docs/TRAINER.md, "One
objective, however a step is cut").

The old normalization ("micro-batch": each micro-batch's mean divided by ``grad_accum``,
then averaged over ranks by DDP, as speculators, DeepSpec and ModelOpt train) weighs a
block by how few blocks share its micro-batch: padded micro-batches of long documents hold
few blocks, so their blocks weighed several times those of short ones. It stays, one flag
away (``--loss-normalization micro-batch``), for comparisons.

The same scheme as Hugging Face Transformers' ``num_items_in_batch``, torchtitan's global
valid-token count and SpecForge's gradient rescale before clipping. No host sync: the scale
stays a device tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trainer.model.loss import LossOutput
from trainer.train.distributed import DistEnv, all_reduce


def micro_loss(out: LossOutput, normalization: str, grad_accum: int) -> torch.Tensor | None:
    """What a micro-batch backpropagates: its weighted CE sum (the step normalizes later),
    or under the old normalization its mean over ``grad_accum``; None for a micro-batch
    without blocks (the caller runs the drafter for a zero loss: DDP stays in step)."""
    if out.weighted is None or out.loss is None:
        return None
    if normalization == "step":
        return out.weighted
    return out.loss / grad_accum


def normalize_gradients(
    params: Iterable[torch.nn.Parameter], divisor: torch.Tensor, env: DistEnv
) -> None:
    """Divide the accumulated gradients (of weighted CE sums, averaged over ranks by DDP) by
    the step's total divisor over every rank (``divisor``: this rank's), times
    ``world_size`` to undo DDP's average. One scalar all-reduce. A step without any has
    zero gradients and keeps them."""
    total = all_reduce(divisor.detach().clone(), env)
    scale = torch.where(total > 0, env.world_size / total, torch.zeros_like(total))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
