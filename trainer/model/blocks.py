"""What one micro-batch trains on: its documents, anchors, labels and weights.

Documents with fewer than ``2*B`` supervised tokens are skipped. A remaining document's
candidates are the positions ``a`` with ``loss_mask[a] == 1`` and room for a full block
(``a + B <= length``); it draws ``min(anchors_per_doc, ceil(candidates / tokens_per_anchor))``
of them without replacement: the anchor rule the planner's cost model states for
all-supervised documents (``loader_server.wire.spec.AnchorRule``; a unit test holds the
two equal). The default, one anchor per 32 candidates and at most 512 per document, trains
as many blocks per token as the old per-micro-batch cap did at the default token budget
(2048 per 65,536-token micro-batch); ``tokens_per_anchor`` 1 is the reference recipe (up to
512 per sequence).

Which anchors (``DocumentDraw``, the default): the candidates with the smallest keys, a key
being a hash of ``(seed, epoch, sample id, position)``. So a document's blocks are a
function of the document, the seed and the epoch alone: the same on any rank, in any
micro-batch, beside any neighbours, before and after a resume or a shape change; they
change every epoch. A micro-batch's anchors then count ``tokens / tokens_per_anchor`` at
most (plus one per document): the per-document rule is what bounds memory and time, and the
loss of an optimizer step does not depend on how the loader cut it (docs/TRAINER.md, "One
objective, however a step is cut").

The old draw (``anchor_draw="micro-batch"``, ``--anchor-draw micro-batch``, kept for
comparisons): keys from a generator keyed on the seed, rank and loader position
(``anchor_generator``), and at most ``max_anchors`` per micro-batch, kept round-robin over
its documents in random order (``cap_anchors``): which blocks a document gets depends on
where it lands and what shares its micro-batch.

Block offset ``k`` predicts ``x_{a+k}`` (k = 1..B-1), weighted ``exp(-(k-1)/gamma)`` (and by
``loss_mask`` at ``a+k``; ``weighting="dpace"`` replaces the decay after the head,
``trainer.model.loss``). ``draft_blocks`` lays the kept documents out as the drafter's
packed context and cuts the blocks into chunks.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from client.batch import Batch
from loader_server.wire.spec import AnchorRule
from trainer.model.doc_view import DocView
from trainer.model.drafter import DraftBlocks, plan_chunks

if TYPE_CHECKING:
    from trainer.sections import LossSection

#: How a step's loss is normalized: over the whole step (every micro-batch of every rank),
#: or each micro-batch's mean alike (how speculators, DeepSpec and ModelOpt train).
NORMALIZATIONS = ("step", "micro-batch")
#: What the weighted CE sum is divided by: the weights' sum (a weighted mean), the number of
#: supervised slots (speculators'), or each document's weights (a weighted mean per
#: document, then the mean over documents: the reference's and SpecForge's per sequence).
DIVISORS = ("weight", "slots", "sequence")
#: Where anchors come from: per document (seed, epoch, sample id), or the old per-micro-batch
#: generator and cap.
ANCHOR_DRAWS = ("document", "micro-batch")
#: The loss weight of block offset k: ``exp(-(k-1)/gamma)``, or D-PACE (confidence-weighted).
WEIGHTINGS = ("decay", "dpace")
#: What a loss config saved before these fields existed means: the objective of that time.
LEGACY_LOSS_FIELDS = {"tokens_per_anchor": 1, "weighting": "decay", "dpace_alpha": 0.5,
                      "normalization": "micro-batch", "anchor_draw": "micro-batch",
                      "divisor": "weight"}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Block size, the anchor rule, the loss weighting and how a step's loss is normalized:
    everything that decides the objective (checkpoints must agree on it)."""

    block_size: int = 16
    anchors_per_doc: int = 512
    tokens_per_anchor: int = 32  # a document draws one anchor per this many candidates
    max_anchors: int = 0  # per micro-batch; 0: no cap (the old draw only)
    gamma: float = 7.0
    # DFlash2: weight of the selector's K-way cross-entropy next to the unary one.
    selector_alpha: float = 1.0
    weighting: str = "dpace"
    dpace_alpha: float = 0.5  # D-PACE's confidence smoothing: q~ = (1 - a) q + a
    normalization: str = "step"
    divisor: str = "weight"
    anchor_draw: str = "document"

    def __post_init__(self) -> None:
        for name, low in (("block_size", 2), ("anchors_per_doc", 1), ("tokens_per_anchor", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.max_anchors < 0:
            raise ValueError(f"max_anchors must be >= 0 (0: no cap), got {self.max_anchors}")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"gamma must be a positive number, got {self.gamma}")
        if not (math.isfinite(self.selector_alpha) and self.selector_alpha >= 0):
            raise ValueError(f"selector_alpha must be a number >= 0, got {self.selector_alpha}")
        if not (math.isfinite(self.dpace_alpha) and 0 <= self.dpace_alpha <= 1):
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        self._check_underflow()
        for name, allowed in (("weighting", WEIGHTINGS), ("normalization", NORMALIZATIONS),
                              ("divisor", DIVISORS), ("anchor_draw", ANCHOR_DRAWS)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got "
                                 f"{getattr(self, name)!r}")  # fmt: skip
        if self.max_anchors and self.anchor_draw == "document":
            raise ValueError(
                f"max_anchors {self.max_anchors} caps the anchors of a micro-batch, which makes "
                "a document's blocks depend on what shares its micro-batch: it is only taken "
                "with anchor_draw 'micro-batch' (--anchor-draw micro-batch); per document, "
                "tokens_per_anchor bounds a micro-batch's anchors (about tokens / "
                "tokens_per_anchor)"
            )

    def _check_underflow(self) -> None:
        """A supervised slot's weight must not round to 0 in float32 (the loss's dtype): its
        token would be dropped from the objective without a word. The smallest weights are
        the last offset's: ``exp(-(B-2)/gamma)`` under the decay, and ``alpha^(B-1)`` under
        D-PACE (every confidence 0: ``q~ = alpha``). Each bound applies to its weighting
        only (the other's option has no effect)."""
        tiny, last = float(torch.finfo(torch.float32).tiny), self.block_size - 1
        if self.weighting == "decay" and self.gamma < (last - 1) / -math.log(tiny):
            low = (last - 1) / -math.log(tiny)
            raise ValueError(
                f"--gamma {self.gamma:g} makes the weight of block offset {last}, "
                f"exp(-{last - 1}/gamma), round to 0 in float32: its tokens would not count; "
                f"with blocks of {self.block_size} use a gamma of at least {low:.3g}"
            )
        if self.weighting == "dpace" and self.dpace_alpha < tiny ** (1 / last):
            raise ValueError(
                f"--dpace-alpha {self.dpace_alpha:g} lets a slot's D-PACE weight round to 0 in "
                f"float32 (q~ = (1 - a) exp(-CE) + a, a product of up to {last} of them: a "
                "confident miss weighs nothing): with blocks of "
                f"{self.block_size} use at least {tiny ** (1 / last):.3g} (the default 0.5 "
                "holds for blocks of up to 127), smaller blocks, or --loss-weighting decay"
            )

    @classmethod
    def from_options(cls, opts: LossSection, block_size: int | None) -> LossConfig:
        """The loss config of a run's options (``trainer.sections.LossSection``; the block
        size is the drafter's, resolved by ``trainer.run.resolve_init_drafter``)."""
        if block_size is None:
            raise ValueError("block_size is unresolved (trainer.run.resolve_init_drafter)")
        return cls(
            block_size=block_size,
            anchors_per_doc=opts.anchors_per_doc,
            tokens_per_anchor=opts.tokens_per_anchor,
            max_anchors=opts.max_anchors,
            gamma=opts.gamma,
            selector_alpha=1.0 if opts.selector_alpha is None else opts.selector_alpha,
            weighting=opts.loss_weighting,
            dpace_alpha=opts.dpace_alpha,
            normalization=opts.loss_normalization,
            divisor=opts.loss_divisor,
            anchor_draw=opts.anchor_draw,
        )

    def options(self) -> dict[str, Any]:
        """The run options (``trainer.sections.RunOptions`` fields) that make this config:
        ``from_options``' inverse, the block size included."""
        out = {
            "block_size": self.block_size, "anchors_per_doc": self.anchors_per_doc,
            "tokens_per_anchor": self.tokens_per_anchor, "max_anchors": self.max_anchors,
            "gamma": self.gamma, "loss_weighting": self.weighting,
            "dpace_alpha": self.dpace_alpha, "loss_normalization": self.normalization,
            "loss_divisor": self.divisor, "anchor_draw": self.anchor_draw,
        }  # fmt: skip
        if self.selector_alpha != 1.0:  # DFlash2's; the option is unset for a dflash drafter
            out["selector_alpha"] = self.selector_alpha
        return out

    @property
    def anchor_rule(self) -> AnchorRule:
        """The rule the loader's cost model counts block slots by."""
        return AnchorRule(
            self.block_size, self.anchors_per_doc, self.tokens_per_anchor, self.max_anchors
        )


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``exp(-(k-1)/gamma)`` for block offsets ``k = 1..B-1`` (float32 ``[B-1]``)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): a bijection whose output
    bits all depend on every input bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class DocumentDraw:
    """Anchor keys as a function of ``(seed, epoch, sample id, position)`` alone."""

    seed: int
    epoch: int

    def keys(self, sample_ids: torch.Tensor, width: int) -> torch.Tensor:
        """Uniform keys in [0, 1) ``[D, width]`` (float64) for the documents ``sample_ids``
        at positions ``0..width-1``; vectorized, no generator state."""
        digest = hashlib.blake2b(struct.pack("<qq", self.seed, self.epoch), digest_size=8)
        base = np.uint64(int.from_bytes(digest.digest(), "little"))
        ids = sample_ids.to("cpu", torch.int64).numpy().astype(np.uint64)
        doc = _mix(base ^ _mix(ids + _GOLDEN))
        pos = np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN
        z = _mix(doc[:, None] + pos[None, :])
        return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


#: Where a micro-batch's anchors come from: per document, or (the old draw) a generator.
AnchorDraw = DocumentDraw | torch.Generator


def anchor_counts(
    supervised: torch.Tensor, candidates: torch.Tensor, rule: AnchorRule
) -> torch.Tensor:
    """Anchors each document draws (int64 ``[D]``), from its supervised tokens and its
    candidate positions: ``min(anchors_per_doc, ceil(candidates / tokens_per_anchor))``,
    none below ``2 * block_size`` supervised tokens."""
    n = torch.clamp(-(-candidates // rule.tokens_per_anchor), max=rule.anchors_per_doc)
    return torch.where(supervised >= 2 * rule.block_size, n, torch.zeros_like(n))


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    keys: torch.Tensor | torch.Generator,
    *,
    rule: AnchorRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions ``[D, A]`` (ascending) and their validity ``[D, A]`` (CPU tensors).

    ``loss_mask [D, L]`` and ``lengths [D]`` describe right-padded documents; ``keys``
    ``[D, >= L]`` rank each document's candidates (the smallest win), or a generator to draw
    them from (the old draw). ``A = min(anchors_per_doc, L)``; invalid slots hold 0.
    """
    lm = loss_mask.to("cpu").bool()
    lengths = lengths.to("cpu", torch.int64)
    d, width = lm.shape
    t = torch.arange(width)
    cand = lm & (t[None, :] + rule.block_size <= lengths[:, None])
    counts = anchor_counts(lm.sum(1), cand.sum(1), rule)
    if isinstance(keys, torch.Generator):
        keys = torch.rand(d, width, generator=keys)
    keys = keys[:, :width]
    keys = torch.where(cand & (counts > 0)[:, None], keys, torch.full_like(keys, 2.0))
    a = min(rule.anchors_per_doc, width)
    val, idx = torch.topk(keys, a, dim=1, largest=False, sorted=True)
    valid = (val < 1.0) & (torch.arange(a)[None, :] < counts[:, None])
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
    weights: torch.Tensor  # [N, B-1] float32, 0 where unsupervised (D-PACE: 1 elsewhere)
    capped: int  # anchors dropped by the cap
    ids: torch.Tensor  # the batch's input_ids on the host
    sample_ids: torch.Tensor  # [D] the kept documents' sample ids


def plan_blocks(batch: Batch, cfg: LossConfig, draw: AnchorDraw) -> BlockPlan | None:
    """Draw the micro-batch's anchors and their targets (None: nothing to train on).
    ``draw``: a ``DocumentDraw``, or the old draw's generator (the cap draws from it too)."""
    b = cfg.block_size
    docs = DocView.of(batch)
    ids_cpu, lm_cpu = batch.input_ids.cpu(), batch.loss_mask.cpu()
    lm = docs.gather(lm_cpu)
    keep = lm.sum(1) >= 2 * b
    if not bool(keep.any()):
        return None
    docs, lm = docs.select(keep), lm[keep]
    sample_ids = batch.sample_ids.cpu()[keep]
    width = lm.shape[1]
    keys = draw if isinstance(draw, torch.Generator) else draw.keys(sample_ids, width)
    pos, valid = sample_anchors(lm, docs.length, keys, rule=cfg.anchor_rule)
    drawn = int(valid.sum())
    if cfg.max_anchors:
        if not isinstance(draw, torch.Generator):
            raise ValueError("max_anchors caps the old per-micro-batch draw only (a generator)")
        valid = cap_anchors(valid, cfg.max_anchors, draw)
    if drawn == 0:
        return None
    blk_doc, slot = valid.nonzero(as_tuple=True)  # document-major, anchors ascending
    blk_anchor = pos[blk_doc, slot]
    offsets = torch.arange(1, b)
    cols = (docs.start[blk_doc] + blk_anchor)[:, None] + offsets
    rows = docs.row[blk_doc][:, None].expand_as(cols)
    labels = ids_cpu[rows, cols].long()
    supervised = lm_cpu[rows, cols].bool()
    if not bool(supervised.any()):
        return None  # anchors whose blocks predict no supervised token: nothing to train
    # Under D-PACE the weights come after the head (``trainer.model.loss``): here they only
    # say which slots count, and gamma has no say in that.
    decay = position_weights(b, cfg.gamma) if cfg.weighting == "decay" else torch.ones(b - 1)
    weights = decay * supervised
    capped = drawn - int(valid.sum())
    return BlockPlan(docs, blk_doc, blk_anchor, labels, weights, capped, ids_cpu, sample_ids)


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


def anchor_draw(cfg: LossConfig, seed: int, rank: int, batch: Batch) -> AnchorDraw:
    """Where ``batch``'s anchors come from in a run seeded ``seed``: per document (the
    default), or the old draw's generator keyed on this rank's loader position."""
    if cfg.anchor_draw == "document":
        return DocumentDraw(seed, int(batch.epoch))
    return anchor_generator(seed, rank, batch.epoch, batch.step, batch.micro, batch.leg)


def anchor_generator(
    seed: int, rank: int, epoch: int, step: int, micro: int, leg: int = 0
) -> torch.Generator:
    """A CPU generator keyed on the position, identical in an uninterrupted and a resumed run.
    ``leg``: the shape changes before this part of the epoch (its steps count from 0 again)."""
    fields = (seed, rank, epoch, step, micro) + ((leg,) if leg else ())
    key = hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") >> 1)
