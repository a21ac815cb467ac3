"""What one micro-batch trains on: its documents, anchors, labels and weights.

Documents with fewer than ``2*B`` supervised tokens are skipped. In each remaining document
up to ``anchors_per_doc`` anchors are drawn without replacement from the positions ``a`` with
``loss_mask[a] == 1`` and room for a full block (``a + B <= length``): the anchor rule the
planner's cost model states for all-supervised documents
(``loader_server.planning.cost.doc_anchors``; a unit test holds the two equal). Then at most
``max_anchors`` are kept for the whole micro-batch, round-robin over its documents in random
order (``cap_anchors``), so a micro-batch of many short documents cannot multiply memory and
time. The draws use a generator keyed on the seed, rank and loader position
(``anchor_generator``): anchors change every step, and a resumed run draws the same ones.

Block offset ``k`` predicts ``x_{a+k}`` (k = 1..B-1), weighted ``exp(-(k-1)/gamma)`` (and by
``loss_mask`` at ``a+k``). ``draft_blocks`` lays the kept documents out as the drafter's
packed context and cuts the blocks into chunks.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from client.batch import Batch
from trainer.model.docs import DocView
from trainer.model.drafter import DraftBlocks, plan_chunks


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Block size, anchors per document and per micro-batch, and the position decay of the
    loss weights: everything that decides the objective (checkpoints must agree on it)."""

    block_size: int = 16
    anchors_per_doc: int = 512
    max_anchors: int = 2048  # per micro-batch; 0: no cap
    gamma: float = 7.0
    # DFlash2: weight of the selector's K-way cross-entropy next to the unary one.
    selector_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.anchors_per_doc < 1:
            raise ValueError(f"anchors_per_doc must be >= 1, got {self.anchors_per_doc}")
        if self.max_anchors < 0:
            raise ValueError(f"max_anchors must be >= 0 (0: no cap), got {self.max_anchors}")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"gamma must be a positive number, got {self.gamma}")
        if not (math.isfinite(self.selector_alpha) and self.selector_alpha >= 0):
            raise ValueError(f"selector_alpha must be a number >= 0, got {self.selector_alpha}")


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``exp(-(k-1)/gamma)`` for block offsets ``k = 1..B-1`` (float32 ``[B-1]``)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    anchors_per_doc: int,
    block_size: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions ``[D, A]`` (ascending) and their validity ``[D, A]`` (CPU tensors).

    ``loss_mask [D, L]`` and ``lengths [D]`` describe right-padded documents. Candidates are
    supervised positions with ``a + block_size <= length`` in documents with at least
    ``2*block_size`` supervised tokens; ``A = min(anchors_per_doc, L)``; invalid slots hold 0.
    """
    lm = loss_mask.to("cpu").bool()
    lengths = lengths.to("cpu", torch.int64)
    d, width = lm.shape
    t = torch.arange(width)
    eligible = lm.sum(1) >= 2 * block_size
    cand = lm & (t[None, :] + block_size <= lengths[:, None]) & eligible[:, None]
    keys = torch.rand(d, width, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))
    a = min(anchors_per_doc, width)
    val, idx = torch.topk(keys, a, dim=1, largest=False, sorted=True)
    valid = val < 1.0
    # Order each document's anchors by position (invalid slots last) for readable debugging.
    order = torch.where(valid, idx, torch.full_like(idx, width)).argsort(dim=1)
    idx, valid = idx.gather(1, order), valid.gather(1, order)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def cap_anchors(valid: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Keep at most ``max_anchors`` of the valid anchors ``[D, A]``, fairly across documents.

    Each document's anchors are ranked in random order; the cap takes every document's
    first-ranked anchor, then every second, and so on, with the documents of the last
    round in a random order of their own (independent of how many anchors each has). A
    document with few anchors keeps all of them and leaves its share to the others. Draws
    from ``generator`` only when the cap binds.
    """
    if max_anchors <= 0 or int(valid.sum()) <= max_anchors:
        return valid
    keys = torch.rand(valid.shape, generator=generator)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    rank = keys.argsort(dim=1).argsort(dim=1).to(keys.dtype)
    tie = torch.rand(valid.shape[0], 1, generator=generator) / 2  # document order per round
    order = torch.where(valid, rank + tie, torch.full_like(keys, math.inf))
    chosen = torch.topk(order.flatten(), max_anchors, largest=False).indices
    out = torch.zeros(valid.numel(), dtype=torch.bool)
    out[chosen] = True
    return out.view_as(valid)


@dataclass(frozen=True)
class BlockPlan:
    """The micro-batch's blocks (CPU tensors): documents kept, anchors, labels and weights."""

    docs: DocView  # documents with >= 2B supervised tokens
    blk_doc: torch.Tensor  # [N] index into docs
    blk_anchor: torch.Tensor  # [N] position in the document
    labels: torch.Tensor  # [N, B-1] token at anchor + k
    weights: torch.Tensor  # [N, B-1] float32, 0 where unsupervised
    capped: int  # anchors dropped by the cap
    ids: torch.Tensor  # the batch's input_ids on the host


def plan_blocks(batch: Batch, cfg: LossConfig, generator: torch.Generator) -> BlockPlan | None:
    """Draw the micro-batch's anchors and their targets (None: nothing to train on)."""
    b = cfg.block_size
    docs = DocView.of(batch)
    ids_cpu, lm_cpu = batch.input_ids.cpu(), batch.loss_mask.cpu()
    lm = docs.gather(lm_cpu)
    keep = lm.sum(1) >= 2 * b
    if not bool(keep.any()):
        return None
    docs, lm = docs.select(keep), lm[keep]
    pos, valid = sample_anchors(
        lm, docs.length, anchors_per_doc=cfg.anchors_per_doc, block_size=b, generator=generator
    )
    drawn = int(valid.sum())
    valid = cap_anchors(valid, cfg.max_anchors, generator)
    if drawn == 0:
        return None
    blk_doc, slot = valid.nonzero(as_tuple=True)  # document-major, anchors ascending
    blk_anchor = pos[blk_doc, slot]
    offsets = torch.arange(1, b)
    cols = (docs.start[blk_doc] + blk_anchor)[:, None] + offsets
    rows = docs.row[blk_doc][:, None].expand_as(cols)
    labels = ids_cpu[rows, cols].long()
    supervised = lm_cpu[rows, cols].bool()
    weights = position_weights(b, cfg.gamma) * supervised
    return BlockPlan(docs, blk_doc, blk_anchor, labels, weights, drawn - int(valid.sum()), ids_cpu)


def draft_blocks(plan: BlockPlan, feats: torch.Tensor, chunk_size: int, b: int) -> DraftBlocks:
    """The drafter's input for ``plan``: packed context of the kept documents, blocks, the
    supervised slots to return, and the chunks (``chunk_size // B`` blocks each)."""
    docs, device = plan.docs, feats.device
    doc_ids = torch.arange(len(docs))
    ctx_doc = doc_ids.repeat_interleave(docs.length)
    doc_start = torch.zeros(len(docs), dtype=torch.int64)
    doc_start[1:] = docs.length.cumsum(0)[:-1]
    ctx_pos = torch.arange(int(docs.length.sum())) - doc_start[ctx_doc]
    keep = torch.cat([torch.zeros(len(plan.blk_doc), 1, dtype=torch.bool), plan.weights > 0], 1)
    chunk_blocks = max(1, chunk_size // b) if chunk_size > 0 else 0
    chunks = plan_chunks(
        plan.blk_doc.tolist(), plan.blk_anchor.tolist(), doc_start.tolist(), chunk_blocks
    )
    anchor_cols = docs.start[plan.blk_doc] + plan.blk_anchor
    anchor_ids = plan.ids[docs.row[plan.blk_doc], anchor_cols]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return DraftBlocks(
        feats=feats,
        ctx_row=dev(docs.row[ctx_doc]),
        ctx_col=dev(docs.start[ctx_doc] + ctx_pos),
        ctx_doc=dev(ctx_doc),
        ctx_pos=dev(ctx_pos),
        blk_doc=dev(plan.blk_doc),
        blk_anchor=dev(plan.blk_anchor),
        anchor_ids=dev(anchor_ids.long()),
        chunks=chunks,
        keep=dev(keep),
    )


def anchor_generator(
    seed: int, rank: int, epoch: int, step: int, micro: int, leg: int = 0
) -> torch.Generator:
    """A CPU generator keyed on the position, identical in an uninterrupted and a resumed run.
    ``leg``: the shape changes before this part of the epoch (its steps count from 0 again)."""
    fields = (seed, rank, epoch, step, micro) + ((leg,) if leg else ())
    key = hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") >> 1)
