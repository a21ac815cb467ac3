"""The DFlash training objective on one micro-batch.

1. The frozen target runs once over the batch (padded rows, or one packed row split per
   document by its position ids) and yields the chosen-layer features of every position.
2. Documents with fewer than ``2*B`` supervised tokens are skipped. In each remaining
   document up to ``num_anchors`` anchors are drawn without replacement from the positions
   ``a`` with ``loss_mask[a] == 1`` and room for a full block (``a + B <= length``). The
   draw uses a generator seeded by the caller (the trainer keys it on the seed, rank and
   loader position), so anchors change every step and a resumed run draws the same ones.
3. Each anchor opens a block ``[x_a, MASK x (B-1)]`` that sees the document's features at
   positions ``< a`` and its own block only. Block offset ``k`` predicts ``x_{a+k}``
   (k = 1..B-1), weighted ``exp(-(k-1)/gamma)`` (and by ``loss_mask`` at ``a+k``): early
   offsets matter most because a draft is only accepted up to its first miss.

The drafter works on a per-document view (``DocView.gather``), so a block can never see
another document, packed or not, and the attention cost is ``A*B x (L + A*B)`` per
document rather than per packed row. Logits are computed only at supervised block slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.batches import DocView
from trainer.drafter import DFlashDrafter, block_attention_mask
from trainer.target import Target


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Block size, anchors per document and the position decay of the loss weights."""

    block_size: int = 16
    num_anchors: int = 512
    gamma: float = 7.0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"gamma must be a positive number, got {self.gamma}")


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``exp(-(k-1)/gamma)`` for block offsets ``k = 1..B-1`` (float32 ``[B-1]``)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions ``[D, A]`` (ascending) and their validity ``[D, A]`` (CPU tensors).

    ``loss_mask [D, L]`` and ``lengths [D]`` describe right-padded documents. Candidates are
    supervised positions with ``a + block_size <= length`` in documents with at least
    ``2*block_size`` supervised tokens; ``A = min(num_anchors, L)``; invalid slots hold 0.
    """
    lm = loss_mask.to("cpu").bool()
    lengths = lengths.to("cpu", torch.int64)
    d, width = lm.shape
    t = torch.arange(width)
    eligible = lm.sum(1) >= 2 * block_size
    cand = lm & (t[None, :] + block_size <= lengths[:, None]) & eligible[:, None]
    keys = torch.rand(d, width, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))
    a = min(num_anchors, width)
    val, idx = torch.topk(keys, a, dim=1, largest=False, sorted=True)
    valid = val < 1.0
    # Order each document's anchors by position (invalid slots last) for readable debugging.
    order = torch.where(valid, idx, torch.full_like(idx, width)).argsort(dim=1)
    idx, valid = idx.gather(1, order), valid.gather(1, order)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


@dataclass
class LossOutput:
    """One micro-batch's loss and the sums that metrics aggregate across micro-batches/ranks."""

    loss: torch.Tensor | None  # weighted mean CE (None when the batch has no block)
    weighted_ce_sum: torch.Tensor  # detached scalars, on the model's device (no host sync)
    weight_sum: torch.Tensor
    correct: torch.Tensor  # float64 [B-1]: argmax hits per block offset k = 1..B-1
    count: torch.Tensor  # float64 [B-1]: supervised slots per offset
    num_blocks: int
    num_tokens: int  # real tokens in the micro-batch (throughput)


def block_hidden(
    target: Target,
    drafter: torch.nn.Module,
    feats: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Drafter outputs ``[D, A, B, H]`` for anchors ``pos [D, A]`` of documents ``ids [D, L]``
    with target features ``feats [D, L, n*H]`` (each block sees ``feats[:, :anchor]``)."""
    n_doc, width = ids.shape
    a, b = pos.shape[1], block_size
    anchor_embeds = target.embed_tokens(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(b, device=pos.device)).reshape(n_doc, a * b)
    ctx_pos = torch.arange(width, device=pos.device).expand(n_doc, width)
    mask = block_attention_mask(pos, valid, width, b)
    hidden = drafter(anchor_embeds, feats, block_pos, ctx_pos, mask)
    return hidden.view(n_doc, a, b, -1)


def block_targets(
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights ``[D, A, B-1]`` of block offsets ``k = 1..B-1``: the label is
    ``ids[anchor + k]``, the weight ``exp(-(k-1)/gamma)`` where the anchor is valid and
    ``loss_mask[anchor + k] == 1``, else 0."""
    n_doc, width = ids.shape
    a = pos.shape[1]
    offsets = torch.arange(1, block_size, device=pos.device)
    label_pos = (pos[:, :, None] + offsets).clamp(max=width - 1).flatten(1)
    labels = ids.gather(1, label_pos).view(n_doc, a, block_size - 1)
    supervised = loss_mask.bool().gather(1, label_pos).view(n_doc, a, block_size - 1)
    supervised = supervised & valid[:, :, None]
    decay = position_weights(block_size, gamma).to(pos.device)
    return labels, decay * supervised


def draft_loss(
    target: Target,
    drafter: torch.nn.Module,
    batch: object,
    cfg: LossConfig,
    generator: torch.Generator,
) -> LossOutput:
    """The weighted block cross-entropy of ``drafter`` (possibly DDP-wrapped) on ``batch``."""
    core: DFlashDrafter = getattr(drafter, "module", drafter)
    b = cfg.block_size
    if core.config.block_size != b:
        raise ValueError(f"drafter block size {core.config.block_size} != loss block size {b}")
    docs = DocView.of(batch)
    num_tokens = int(docs.length.sum())
    lm_all = docs.gather(batch.loss_mask)
    keep = lm_all.to("cpu").sum(1) >= 2 * b
    if not bool(keep.any()):
        return _empty(b, num_tokens, lm_all.device)
    docs, lm = docs.select(keep), lm_all[keep.to(lm_all.device)]
    pos, valid = sample_anchors(
        lm, docs.length, num_anchors=cfg.num_anchors, block_size=b, generator=generator
    )
    if not bool(valid.any()):
        return _empty(b, num_tokens, lm_all.device)

    packed = batch.layout == "packed"
    feats, _ = target.features(batch.input_ids, batch.position_ids if packed else None)
    device = feats.device
    feats = docs.gather(feats)
    ids = docs.gather(batch.input_ids).long()
    pos, valid, lm = pos.to(device), valid.to(device), lm.to(device)
    hidden = block_hidden(target, drafter, feats, ids, pos, valid, b)[:, :, 1:]
    labels, weights = block_targets(ids, lm, pos, valid, b, cfg.gamma)
    sel = weights > 0
    weights = weights[sel]
    logits = target.lm_head(hidden[sel]).float()
    target_ids = labels[sel]
    ce = F.cross_entropy(logits, target_ids, reduction="none")
    weighted = (ce * weights).sum()
    loss = weighted / weights.sum()

    k_idx = torch.arange(b - 1, device=device).expand_as(sel)[sel]
    hits = (logits.argmax(-1) == target_ids).double()
    correct = torch.bincount(k_idx, weights=hits, minlength=b - 1)
    count = torch.bincount(k_idx, minlength=b - 1).double()
    return LossOutput(
        loss=loss,
        weighted_ce_sum=weighted.detach().double(),
        weight_sum=weights.sum().double(),
        correct=correct,
        count=count,
        num_blocks=int(valid.sum()),
        num_tokens=num_tokens,
    )


def _empty(block_size: int, num_tokens: int, device: torch.device) -> LossOutput:
    zero = torch.zeros((), dtype=torch.float64, device=device)
    zeros = torch.zeros(block_size - 1, dtype=torch.float64, device=device)
    return LossOutput(None, zero, zero.clone(), zeros, zeros.clone(), 0, num_tokens)


def zero_loss(target: Target, drafter: torch.nn.Module) -> torch.Tensor:
    """A loss of exactly 0 that still runs ``drafter`` (possibly DDP-wrapped) over one dummy
    block, so every parameter gets a (zero) gradient and DDP's all-reduce stays in step with
    the other ranks when a micro-batch has no block to train on."""
    core: DFlashDrafter = getattr(drafter, "module", drafter)
    device = core.mask_embedding.device
    b, h = core.config.block_size, core.config.hidden_size
    feats = torch.zeros(1, 1, core.config.num_target_layers * h, device=device)
    anchor = torch.zeros(1, 1, h, device=device)
    block_pos = torch.arange(b, device=device)[None]
    mask = torch.ones(1, b, 1 + b, dtype=torch.bool, device=device)
    ctx_pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    hidden = drafter(anchor, feats, block_pos, ctx_pos, mask)
    return hidden.sum() * 0.0
