"""The DFlash training objective on one micro-batch, in memory bounded by a chunk size.

1. The frozen target runs once over the batch (padded rows, or one packed row split per
   document by its position ids) and yields the chosen-layer features of every position.
2. The micro-batch's blocks are planned (``trainer.model.blocks``: documents kept, anchors
   drawn and capped, labels and weights).
3. Each anchor opens a block ``[x_a, MASK x (B-1)]`` that sees its document's features at
   positions ``< a`` and its own block only (``trainer.model.attention``). Block offset ``k``
   predicts ``x_{a+k}`` (k = 1..B-1), weighted ``exp(-(k-1)/gamma)`` (and by ``loss_mask`` at
   ``a+k``): early offsets matter most because a draft is only accepted up to its first miss.
   With ``weighting="dpace"`` the weights are D-PACE's instead (``dpace_weights``), computed
   from each slot's own cross-entropy after the head, without gradient.

``draft_loss`` returns the micro-batch's weighted CE *sum* and its total weight; the loop
divides a step's summed CE by the step's summed weight over every micro-batch and rank
(``trainer.train.loop``), so the objective does not depend on how the step was cut.

Memory. The drafter drafts blocks in chunks of ``chunk_size // B`` blocks under activation
checkpointing and returns hidden states only for supervised slots; the frozen LM head and
the weighted cross-entropy then run ``chunk_size`` slots at a time in one fused pass
(``head_loss``) that computes the gradient of the hidden states as it goes, so
full-vocabulary logits exist for one chunk only and the head costs the same two matrix
products as the unchunked path (the head is frozen: no weight gradient). At a 151,936-token
vocabulary one fp32 logit row is 0.58 MB; the unchunked path (``chunk_size=0``) keeps about
3 such copies per supervised slot, up to ``15 * anchors`` slots per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch.autograd.function import BackwardCFunction
from torch.utils.checkpoint import checkpoint

from client.batch import Batch
from trainer.model.blocks import AnchorDraw, BlockPlan, LossConfig, draft_blocks, plan_blocks
from trainer.model.dflash2 import CandidateSelector, softcap_logits, training_candidates
from trainer.model.doc_view import DocView
from trainer.model.drafter import DFlashDrafter, DraftBlocks
from trainer.model.phases import phase
from trainer.model.target import Target

DEFAULT_CHUNK_SIZE = 1024


@dataclass
class LossOutput:
    """One micro-batch's loss and the sums that metrics aggregate across micro-batches/ranks.

    ``weighted`` is what a step sums over all its micro-batches and ranks and divides by
    the sum of their ``divisor`` (``LossConfig.normalization`` "step"); ``loss`` is the
    micro-batch's own, ``weighted / divisor`` (the old normalization). The divisor is
    ``LossConfig.divisor``'s: the weights' sum, the supervised slots, or the documents
    (each document's weights then divided by their sum)."""

    loss: torch.Tensor | None  # weighted mean CE (None when the batch has no block)
    weighted: torch.Tensor | None  # weighted CE sum, differentiable (None: no block)
    weighted_ce_sum: torch.Tensor  # detached scalars, on the model's device (no host sync)
    divisor: torch.Tensor
    correct: torch.Tensor  # float64 [B-1]: argmax hits per block offset k = 1..B-1
    count: torch.Tensor  # float64 [B-1]: supervised slots per offset
    num_blocks: int  # anchors trained on (after the per-micro-batch cap)
    num_tokens: int  # real tokens in the micro-batch (throughput)
    capped_blocks: int = 0  # anchors drawn but dropped by the per-micro-batch cap


@dataclass(frozen=True)
class LogitRule:
    """How the head's logits are read: ``softcap(multiplier * h @ W.T)`` (DFlash2's
    ``output_multiplier`` and ``final_logit_softcapping``), and how many of the top
    candidates (``top_k``, DFlash2's selector) the head returns with their logits."""

    multiplier: float = 1.0
    cap: float | None = None
    top_k: int = 0

    @property
    def plain(self) -> bool:
        return self.multiplier == 1.0 and not self.cap


@dataclass
class HeadOutput:
    """Each row's CE ``[N]`` (differentiable), argmax hits ``[N]``, and with ``top_k``: the
    training candidates ``[N, K]`` (the label put last where the top-K misses it,
    ``dflash2.training_candidates``), their logits ``[N, K]`` (differentiable), the
    label's place ``[N]`` and whether the top-K held it ``[N]``."""

    ce: torch.Tensor
    hits: torch.Tensor
    candidates: torch.Tensor
    candidate_logits: torch.Tensor
    place: torch.Tensor
    found: torch.Tensor


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-row CE of ``rule(h @ W.T)`` chunk by chunk, with ``d/dh`` computed in the same
    pass, and (``rule.top_k``) the logits of the top candidates as a second output.

    Frozen ``W`` only (the LM head): no weight gradient. Saves ``grad_h`` (``[N, H]``, each
    row the gradient of its own CE), never logits; backward scales each row by the incoming
    gradient of its CE (the loss weights, which may depend on the CE itself: D-PACE) and
    adds the candidates' share (``[N, K]`` slopes times their ``W`` rows, chunk by chunk).
    """

    @staticmethod
    def forward(
        ctx: BackwardCFunction,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        rule: LogitRule,
    ) -> tuple[torch.Tensor, ...]:
        n, k = h.shape[0], rule.top_k
        ce = torch.empty(n, dtype=_logit_dtype(h), device=h.device)
        hits = torch.empty(n, dtype=torch.bool, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        cands = torch.empty(n, k, dtype=torch.long, device=h.device)
        cand_logits = torch.empty(n, k, dtype=ce.dtype, device=h.device)
        slopes = torch.empty(n, k, dtype=ce.dtype, device=h.device)
        place = torch.empty(n, dtype=torch.long, device=h.device)
        found = torch.empty(n, dtype=torch.bool, device=h.device)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            # One function call per chunk: its logits are freed before the next chunk's exist.
            row_ce, hit, grad, extra = _chunk_ce(
                h[lo:hi], weight, labels[lo:hi], grad_h is not None, rule
            )
            ce[lo:hi] = row_ce
            hits[lo:hi] = hit
            if grad is not None:
                assert grad_h is not None  # a gradient comes back only when asked for
                grad_h[lo:hi] = grad
            for dst, src in zip((cands, cand_logits, slopes, place, found), extra, strict=False):
                dst[lo:hi] = src
        ctx.chunk = chunk  # type: ignore[attr-defined]
        ctx.save_for_backward(
            grad_h if grad_h is not None else h.new_empty(0), weight, cands, slopes
        )
        ctx.mark_non_differentiable(hits, cands, place, found)
        return ce, hits, cands, cand_logits, place, found

    @staticmethod
    def backward(
        ctx: BackwardCFunction, grad_ce: torch.Tensor, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        grad_h, weight, cands, slopes = cast(tuple[torch.Tensor, ...], ctx.saved_tensors)
        out = grad_h * grad_ce.to(grad_h.dtype)[:, None]
        grad_logits = grads[2]
        if grad_logits is not None and cands.shape[1]:
            g = grad_logits * slopes  # d(candidate logit) / d(raw logit)
            chunk = int(ctx.chunk)  # type: ignore[attr-defined]
            for lo in range(0, out.shape[0], chunk):
                hi = min(lo + chunk, out.shape[0])
                rows = weight[cands[lo:hi]].to(g.dtype)  # [n, K, H]
                out[lo:hi] += torch.einsum("nk,nkh->nh", g[lo:hi], rows).to(out.dtype)
        return out, None, None, None, None


def _logit_dtype(h: torch.Tensor) -> torch.dtype:
    """Logits and cross-entropy in fp32 at least (fp64 stays fp64: exactness tests)."""
    return torch.promote_types(h.dtype, torch.float32)


def _chunk_ce(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    need_grad: bool,
    rule: LogitRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Per-row CE, argmax hits, ``d CE_row / dh`` (if ``need_grad``) and, with
    ``rule.top_k``, the candidates, their logits and slopes, the label's place and whether it
    was found, for one chunk of rows.

    One ``[rows, vocab]`` buffer holds the logits, then (in place) the softmax, then the
    gradient of the logits: ``logsumexp`` and ``softmax`` would each allocate another (a
    soft cap keeps one more, its slope).
    """
    logits = (h @ weight.t()).to(_logit_dtype(h))
    slope: torch.Tensor | float = rule.multiplier
    if rule.multiplier != 1.0:
        logits.mul_(rule.multiplier)
    if rule.cap:
        logits.div_(rule.cap).tanh_()
        slope = (1.0 - logits * logits).mul_(rule.multiplier)
        logits.mul_(rule.cap)
    picked = logits.gather(1, labels[:, None])[:, 0]
    hits = logits.argmax(-1) == labels
    extra: tuple[torch.Tensor, ...] = ()
    if rule.top_k:
        top = logits.topk(rule.top_k, dim=-1).indices
        cands, place, found = training_candidates(top, labels)
        cand_slope = (
            slope.gather(1, cands)
            if isinstance(slope, torch.Tensor)
            else torch.full(cands.shape, slope, dtype=logits.dtype, device=h.device)
        )
        extra = (cands, logits.gather(1, cands), cand_slope, place, found)
    top = logits.amax(-1, keepdim=True)
    probs = logits.sub_(top).exp_()  # in place: the logits are not needed any more
    total = probs.sum(-1, keepdim=True)
    ce = top[:, 0] + total[:, 0].log() - picked
    if not need_grad:
        return ce, hits, None, extra
    probs.div_(total)
    probs[torch.arange(h.shape[0], device=h.device), labels] -= 1.0
    if not rule.plain:
        probs.mul_(slope)
    return ce, hits, (probs.to(weight.dtype) @ weight).to(h.dtype), extra


def head_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    chunk_size: int,
    rule: LogitRule = LogitRule(),
) -> HeadOutput:
    """Each row's ``CE(rule(head(hidden)), labels)`` (``[N]``, differentiable: a loss
    weights them, ``(out.ce * w).sum()``) and what ``rule`` asks for.

    ``chunk_size > 0``: logits for at most ``chunk_size`` rows exist at once (fused pass,
    frozen head). ``0``: the plain path (all logits, autograd), kept as the reference.
    """
    if chunk_size <= 0:
        logits = softcap_logits(head(hidden).to(_logit_dtype(hidden)), rule.multiplier, rule.cap)
        ce = F.cross_entropy(logits, labels, reduction="none")
        hits = logits.argmax(-1) == labels
        if not rule.top_k:
            empty = labels.new_empty(labels.shape[0], 0)
            return HeadOutput(ce, hits, empty, empty.float(), labels.new_empty(0), hits[:0])
        cands, place, found = training_candidates(logits.topk(rule.top_k).indices, labels)
        return HeadOutput(ce, hits, cands, logits.gather(1, cands), place, found)
    weight = head.weight
    if weight.requires_grad:
        raise ValueError("the chunked LM head needs a frozen head (no weight gradient)")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked LM head supports a head without bias only")
    out = _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, rule)
    return HeadOutput(*out)


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's loss weights ``[N, B-1]`` of block offsets 1..B-1 from their cross-entropy
    against the target's token ``ce [N, B-1]`` (no gradient flows through them).

    Confidence ``q = exp(-CE)``, smoothed ``q~ = (1 - alpha) q + alpha`` (1 at unsupervised
    slots, which pass through the products), and ``w_j = sum_{m >= j} prod_{i <= m} q~_i``
    over supervised ``m``, 0 at unsupervised ``j``: the gradient of the expected accepted
    length with respect to each slot's log-confidence, so a slot weighs what its acceptance
    would still buy (arXiv 2605.18810; speculators' ``dpace_loss_decay``, SpecForge's
    ``dpace``)."""
    with torch.no_grad():
        mask = supervised.to(ce.dtype)
        smooth = torch.where(supervised, (1.0 - alpha) * torch.exp(-ce) + alpha, 1.0)
        prefix = torch.cumprod(smooth, dim=-1) * mask
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return suffix * mask


def selector_loss(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    predecessors: torch.Tensor,
    head: HeadOutput,
    weights: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's K-way selector CE summed with ``weights``, and whether its teacher-forced
    choice is the label ``[N]``; ``chunk_size`` rows at a time (their ``[n, K, rank]``
    gathers recomputed in backward), all at once with 0."""
    n = hidden.shape[0]
    step = chunk_size if chunk_size > 0 else max(n, 1)

    def part(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        trans = selector.transitions(hidden[lo:hi], predecessors[lo:hi], head.candidates[lo:hi])
        scores = head.candidate_logits[lo:hi] + trans
        ce = F.cross_entropy(scores, head.place[lo:hi], reduction="none")
        return (ce * weights[lo:hi].to(ce.dtype)).sum(), scores.argmax(-1) == head.place[lo:hi]

    total = hidden.new_zeros((), dtype=_logit_dtype(hidden))
    hits: list[torch.Tensor] = []
    many = n > step and torch.is_grad_enabled()
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        if many:
            ce, hit = checkpoint(part, lo, hi, use_reentrant=False)
        else:
            ce, hit = part(lo, hi)
        total, hits = total + ce, [*hits, hit]
    return total, (torch.cat(hits) if hits else head.found) & head.found


def draft_loss(
    target: Target,
    drafter: torch.nn.Module,
    batch: Batch,
    cfg: LossConfig,
    draw: AnchorDraw,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attention: str = "sdpa",
    host_batch: Batch | None = None,
    on_chunks: Callable[[int], object] | None = None,
) -> LossOutput:
    """The weighted block cross-entropy of ``drafter`` (possibly DDP-wrapped) on ``batch``.

    ``draw``: where the anchors come from (``trainer.model.blocks``). ``chunk_size``:
    supervised slots per LM-head chunk, and ``chunk_size // B`` blocks per drafter chunk (0:
    unchunked, the reference path). ``attention``: ``sdpa`` or ``flex``. ``host_batch``:
    the same batch in host memory (the loader's ring), where anchors are planned without
    copying ids and mask back from the GPU (default: ``batch``).
    ``on_chunks``: called with the number of drafter chunks before the drafter runs (the
    trainer fits its host allocator to it: ``trainer.train.hostmem``).
    """
    core = cast(DFlashDrafter, getattr(drafter, "module", drafter))
    b = cfg.block_size
    if core.config.block_size != b:
        raise ValueError(f"drafter block size {core.config.block_size} != loss block size {b}")
    host = batch if host_batch is None else host_batch
    num_tokens = int(DocView.of(host).length.sum())
    with phase("plan"):
        plan = plan_blocks(host, cfg, draw)
    if plan is None:
        target.keep_pace()  # a sharded target's ranks all run this micro-batch's forward
        return _empty(b, num_tokens, target.device)
    with phase("target"):
        feats = target.batch_features(batch, attention)
    device = feats.device
    with phase("blocks"):
        blocks = draft_blocks(plan, feats, chunk_size, b)
    if on_chunks is not None:
        on_chunks(len(blocks.chunks))
    with phase("drafter"):
        hidden = drafter(target.embed_tokens, blocks, attention)
    sel = plan.weights > 0
    with phase("head"):
        weighted, hits, divisor = _head(target, core, hidden, plan, blocks, cfg, chunk_size)
    k_idx = torch.arange(b - 1).expand_as(sel)[sel].to(device, non_blocking=True)
    return LossOutput(
        loss=weighted / divisor.to(weighted.dtype),
        weighted=weighted,
        weighted_ce_sum=weighted.detach().double(),
        divisor=divisor,
        correct=torch.bincount(k_idx, weights=hits.double(), minlength=b - 1),
        count=torch.bincount(k_idx, minlength=b - 1).double(),
        num_blocks=len(plan.blk_doc),
        num_tokens=num_tokens,
        capped_blocks=plan.capped,
    )


def _head(
    target: Target, core: DFlashDrafter, hidden: torch.Tensor, plan: BlockPlan,
    blocks: DraftBlocks, cfg: LossConfig, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The LM head over the supervised slots: the weighted CE sum (DFlash2: plus its
    selector's), each slot's hit (the served choice) and the divisor's share (float64) of
    this micro-batch. The weights: the position decay, or D-PACE's from the slots' own CE;
    under the per-sequence divisor each divided by its document's sum."""
    device = hidden.device
    sel = plan.weights > 0
    labels = plan.labels[sel].to(device, non_blocking=True)
    selector = core.candidate_selector
    out = head_loss(hidden, target.lm_head, labels, chunk_size, logit_rule(core))
    sel_dev = sel.to(device, non_blocking=True)
    if cfg.weighting == "dpace":
        ce = torch.zeros(sel.shape, dtype=out.ce.dtype, device=device)
        ce[sel_dev] = out.ce.detach()
        weights = dpace_weights(ce, sel_dev, cfg.dpace_alpha)[sel_dev]
    else:
        weights = plan.weights[sel].to(device, out.ce.dtype, non_blocking=True)
    # each supervised slot's document, only where the divisor asks (per sequence)
    doc = plan.blk_doc[:, None].expand_as(sel)[sel] if cfg.divisor == "sequence" else None
    weights, divisor = divided(weights, doc, cfg.divisor)
    weighted, hits = (out.ce * weights).sum(), out.hits
    if selector is not None:  # DFlash2: its served choice is the selector's
        # The teacher-forced predecessor of offset k: the true token at k-1 (the anchor).
        full = plan.labels.to(device, non_blocking=True)
        prev = torch.cat([blocks.anchor_ids[:, None], full[:, :-1]], 1)[sel_dev]
        sel_ce, hits = selector_loss(selector, hidden, prev, out, weights, chunk_size)
        weighted = weighted + cfg.selector_alpha * sel_ce
    return weighted, hits, divisor


def divided(
    weights: torch.Tensor, doc: torch.Tensor | None, divisor: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The supervised slots' ``weights`` (``doc``: each one's document, CPU, for
    ``sequence``) as the divisor wants them, and the micro-batch's share of the divisor
    (float64, summed over a step):
    ``weight``, the weights and their sum; ``slots``, the weights and their number;
    ``sequence``, each weight over its document's sum, and the number of documents (with a
    supervised slot). Without gradient: the weights are constants of the step."""
    if divisor == "weight":
        return weights, weights.sum(dtype=torch.float64)
    if divisor == "slots":  # a fill on the device: no host-to-device copy, no sync
        return weights, weights.new_full((), float(weights.numel()), dtype=torch.float64)
    if divisor != "sequence" or doc is None:
        raise ValueError(f"unknown loss divisor {divisor!r}, or no documents for 'sequence'")
    kept, doc = torch.unique(doc, return_inverse=True)  # on the host: no device sync
    doc = doc.to(weights.device, non_blocking=True)
    per_doc = weights.new_zeros(kept.numel(), dtype=torch.float64)
    per_doc.index_add_(0, doc, weights.double())
    # A document whose weights all rounded to 0 (D-PACE with --dpace-alpha 0 after a huge
    # CE) trains nothing and is not counted, as it adds nothing to the weights' sum.
    has = per_doc > 0
    scaled = torch.where(has[doc], weights.double() / per_doc.clamp_min(1e-300)[doc], 0.0)
    return scaled.to(weights.dtype), has.sum(dtype=torch.float64)


def _empty(block_size: int, num_tokens: int, device: torch.device) -> LossOutput:
    zero = torch.zeros((), dtype=torch.float64, device=device)
    zeros = torch.zeros(block_size - 1, dtype=torch.float64, device=device)
    return LossOutput(None, None, zero, zero.clone(), zeros, zeros.clone(), 0, num_tokens)


def zero_loss(target: Target, drafter: torch.nn.Module) -> torch.Tensor:
    """A loss of exactly 0 that still runs ``drafter`` (possibly DDP-wrapped) over one dummy
    block without context, so every parameter gets a (zero) gradient and DDP's all-reduce
    stays in step with the other ranks when a micro-batch has no block to train on."""
    core = cast(DFlashDrafter, getattr(drafter, "module", drafter))
    device = core.fc.weight.device
    feats = torch.zeros(1, 1, core.fc.in_features, device=device)  # anchor 0 sees none of it
    blocks = DraftBlocks.one_document(feats, [0], torch.zeros(1, dtype=torch.long))
    zero = drafter(target.embed_tokens, blocks, "sdpa").sum() * 0.0
    if core.candidate_selector is not None:  # used outside forward: touch it too
        zero = zero + sum(p.sum() for p in core.candidate_selector.parameters()) * 0.0
    return zero


def logit_rule(drafter: DFlashDrafter) -> LogitRule:
    """How ``drafter``'s head reads its logits (DFlash2: multiplier, cap, top-K)."""
    cfg = drafter.config
    if drafter.candidate_selector is None:
        return LogitRule()
    return LogitRule(cfg.output_multiplier, cfg.final_logit_softcapping, cfg.selector_top_k)
