"""The DFlash training objective on one micro-batch, in memory bounded by a chunk size.

1. The frozen target runs once over the batch (padded rows, or one packed row split per
   document by its position ids) and yields the chosen-layer features of every position.
2. Documents with fewer than ``2*B`` supervised tokens are skipped. In each remaining
   document up to ``num_anchors`` anchors are drawn without replacement from the positions
   ``a`` with ``loss_mask[a] == 1`` and room for a full block (``a + B <= length``); then at
   most ``max_anchors`` are kept for the whole micro-batch, round-robin over its documents
   in random order (``cap_anchors``), so a micro-batch of many short documents cannot
   multiply memory and time. The draws use a generator seeded by the caller (the trainer
   keys it on the seed, rank and loader position): anchors change every step, and a resumed
   run draws the same ones.
3. Each anchor opens a block ``[x_a, MASK x (B-1)]`` that sees its document's features at
   positions ``< a`` and its own block only (``trainer.attention``). Block offset ``k``
   predicts ``x_{a+k}`` (k = 1..B-1), weighted ``exp(-(k-1)/gamma)`` (and by ``loss_mask`` at
   ``a+k``): early offsets matter most because a draft is only accepted up to its first miss.

Memory. The drafter drafts blocks in chunks of ``chunk_size // B`` blocks under activation
checkpointing and returns hidden states only for supervised slots; the frozen LM head and
the weighted cross-entropy then run ``chunk_size`` slots at a time in one fused pass
(``linear_cross_entropy``) that computes the gradient of the hidden states as it goes, so
full-vocabulary logits exist for one chunk only and the head costs the same two matrix
products as the unchunked path (the head is frozen: no weight gradient). At a 151,936-token
vocabulary one fp32 logit row is 0.58 MB; the unchunked path (``chunk_size=0``) keeps about
3 such copies per supervised slot, up to ``15 * anchors`` slots per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer import hostmem
from trainer.batches import DocView
from trainer.drafter import DFlashDrafter, DraftBlocks, plan_chunks
from trainer.target import Target

DEFAULT_CHUNK_SIZE = 1024


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Block size, anchors per document and per micro-batch, and the position decay of the
    loss weights: everything that decides the objective (checkpoints must agree on it)."""

    block_size: int = 16
    num_anchors: int = 512
    max_anchors: int = 2048  # per micro-batch; 0: no cap
    gamma: float = 7.0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.max_anchors < 0:
            raise ValueError(f"max_anchors must be >= 0 (0: no cap), got {self.max_anchors}")
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


@dataclass
class LossOutput:
    """One micro-batch's loss and the sums that metrics aggregate across micro-batches/ranks."""

    loss: torch.Tensor | None  # weighted mean CE (None when the batch has no block)
    weighted_ce_sum: torch.Tensor  # detached scalars, on the model's device (no host sync)
    weight_sum: torch.Tensor
    correct: torch.Tensor  # float64 [B-1]: argmax hits per block offset k = 1..B-1
    count: torch.Tensor  # float64 [B-1]: supervised slots per offset
    num_blocks: int  # anchors trained on (after the per-micro-batch cap)
    num_tokens: int  # real tokens in the micro-batch (throughput)
    capped_blocks: int = 0  # anchors drawn but dropped by the per-micro-batch cap


class _LinearCrossEntropy(torch.autograd.Function):
    """Weighted CE of ``h @ W.T`` chunk by chunk, with ``d/dh`` computed in the same pass.

    Frozen ``W`` only (the LM head): no weight gradient. Saves ``grad_h`` (``[N, H]``), never
    logits; backward scales it by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, h, weight, labels, weights, chunk: int):  # type: ignore[override]
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        hits = torch.empty(n, dtype=torch.bool, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            # One function call per chunk: its logits are freed before the next chunk's exist.
            ce, hits[lo:hi], grad = _chunk_ce(
                h[lo:hi], weight, labels[lo:hi], weights[lo:hi], grad_h is not None
            )
            total += ce
            if grad is not None:
                grad_h[lo:hi] = grad
        ctx.save_for_backward(grad_h if grad_h is not None else h.new_empty(0))
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, grad_hits):  # type: ignore[override]
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_total.to(grad_h.dtype), None, None, None, None


def _chunk_ce(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Weighted CE sum, argmax hits and (if ``need_grad``) ``d/dh`` for one chunk of rows.

    One ``[rows, vocab]`` fp32 buffer holds the logits, then (in place) the softmax, then the
    gradient of the logits: ``logsumexp`` and ``softmax`` would each allocate another.
    """
    logits = (h @ weight.t()).float()
    w = weights.float()
    picked = logits.gather(1, labels[:, None])[:, 0]
    hits = logits.argmax(-1) == labels
    top = logits.amax(-1, keepdim=True)
    probs = logits.sub_(top).exp_()  # in place: the logits are not needed any more
    total = probs.sum(-1, keepdim=True)
    ce = ((top[:, 0] + total[:, 0].log() - picked) * w).sum()
    if not need_grad:
        return ce, hits, None
    probs.div_(total)
    probs[torch.arange(h.shape[0], device=h.device), labels] -= 1.0
    probs.mul_(w[:, None])
    return ce, hits, (probs.to(weight.dtype) @ weight).to(h.dtype)


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of weights * CE(head(hidden), labels), argmax hits [N])``.

    ``chunk_size > 0``: logits for at most ``chunk_size`` rows exist at once (fused pass,
    frozen head). ``0``: the plain path (all logits, autograd), kept as the reference.
    """
    if chunk_size <= 0:
        logits = head(hidden).float()
        ce = F.cross_entropy(logits, labels, reduction="none")
        return (ce * weights).sum(), logits.argmax(-1) == labels
    weight = head.weight
    if weight.requires_grad:
        raise ValueError("the chunked LM head needs a frozen head (no weight gradient)")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked LM head supports a head without bias only")
    return _LinearCrossEntropy.apply(hidden, weight, labels, weights, chunk_size)


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


def plan_blocks(batch: object, cfg: LossConfig, generator: torch.Generator) -> BlockPlan | None:
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
        lm, docs.length, num_anchors=cfg.num_anchors, block_size=b, generator=generator
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


def draft_loss(
    target: Target,
    drafter: torch.nn.Module,
    batch: object,
    cfg: LossConfig,
    generator: torch.Generator,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attention: str = "sdpa",
    host_batch: object | None = None,
) -> LossOutput:
    """The weighted block cross-entropy of ``drafter`` (possibly DDP-wrapped) on ``batch``.

    ``chunk_size``: supervised slots per LM-head chunk, and ``chunk_size // B`` blocks per
    drafter chunk (0: unchunked, the reference path). ``attention``: ``sdpa`` or ``flex``.
    ``host_batch``: the same batch in host memory (the loader's ring), where anchors are
    planned without copying ids and mask back from the GPU (default: ``batch``).
    """
    core: DFlashDrafter = getattr(drafter, "module", drafter)
    b = cfg.block_size
    if core.config.block_size != b:
        raise ValueError(f"drafter block size {core.config.block_size} != loss block size {b}")
    host = batch if host_batch is None else host_batch
    num_tokens = int(DocView.of(host).length.sum())
    plan = plan_blocks(host, cfg, generator)
    if plan is None:
        return _empty(b, num_tokens, target.device)
    packed = batch.layout == "packed"
    feats = target.train_features(batch.input_ids, batch.position_ids if packed else None)
    device = feats.device
    blocks = draft_blocks(plan, feats, chunk_size, b)
    if device.type == "cpu":
        hostmem.fit_chunks(len(blocks.chunks))
    hidden = drafter(target.embed_tokens, blocks, attention)
    sel = plan.weights > 0
    labels = plan.labels[sel].to(device, non_blocking=True)
    weights = plan.weights[sel].to(device, non_blocking=True)
    weighted, hits = linear_cross_entropy(hidden, target.lm_head, labels, weights, chunk_size)
    weight_sum = weights.sum()
    k_idx = torch.arange(b - 1).expand_as(sel)[sel].to(device, non_blocking=True)
    return LossOutput(
        loss=weighted / weight_sum,
        weighted_ce_sum=weighted.detach().double(),
        weight_sum=weight_sum.double(),
        correct=torch.bincount(k_idx, weights=hits.double(), minlength=b - 1),
        count=torch.bincount(k_idx, minlength=b - 1).double(),
        num_blocks=len(plan.blk_doc),
        num_tokens=num_tokens,
        capped_blocks=plan.capped,
    )


def _empty(block_size: int, num_tokens: int, device: torch.device) -> LossOutput:
    zero = torch.zeros((), dtype=torch.float64, device=device)
    zeros = torch.zeros(block_size - 1, dtype=torch.float64, device=device)
    return LossOutput(None, zero, zero.clone(), zeros, zeros.clone(), 0, num_tokens)


def zero_loss(target: Target, drafter: torch.nn.Module) -> torch.Tensor:
    """A loss of exactly 0 that still runs ``drafter`` (possibly DDP-wrapped) over one dummy
    block without context, so every parameter gets a (zero) gradient and DDP's all-reduce
    stays in step with the other ranks when a micro-batch has no block to train on."""
    core: DFlashDrafter = getattr(drafter, "module", drafter)
    device = core.fc.weight.device
    feats = torch.zeros(1, 1, core.fc.in_features, device=device)  # anchor 0 sees none of it
    blocks = DraftBlocks.one_document(feats, [0], torch.zeros(1, dtype=torch.long))
    return drafter(target.embed_tokens, blocks, "sdpa").sum() * 0.0
