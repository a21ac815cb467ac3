"""Who a drafter block may attend to, without a dense mask for the whole micro-batch.

The rule (the reference DFlash training mask): a query of block ``j`` (document ``d_j``,
anchor ``a_j``) sees the context keys of its own document at positions ``< a_j``, and the
``B`` keys of its own block, in both directions; nothing else. A *sliding* layer
(``LayerRule(window=w)``, ``layer_types`` "sliding_attention" in the exported config) is
what SGLang and vLLM serve for one: the query of slot ``i`` (position ``a_j + i``) sees
context keys at positions ``>= a_j + i - w + 1`` only (``w`` positions, itself included)
and the block's keys causally (slots ``<= i``, also within the window); a bidirectional
sliding layer (``causal=False``: ``is_causal: false``) sees every block slot within ``w``
of its own. Training runs blocks in
*chunks* (``BlockChunk``): the keys of a chunk are the packed context of the documents its
blocks belong to (a contiguous slice of the micro-batch's packed context, since blocks are
ordered document-major) followed by the chunk's own block keys. A chunk's mask is
``[c*B, span + c*B]``, bounded by the chunk size, never ``[A*B, T + A*B]`` for all anchors.

Two kernels apply the same rule:

- ``sdpa``: ``scaled_dot_product_attention`` with a dense boolean mask, the chunk regrouped
  as one padded row per document (each document's queries against its own context up to
  its last anchor and its own blocks), so short documents do not pay for each other's
  context (CPU, and the CUDA fallback);
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the rule
  (``mask_mod``), which lets the fused kernel skip the empty tiles (every tile of another
  document, every tile past the chunk's last anchor). Compiled on CUDA; eager elsewhere
  (correct but unfused: only tests use that).

Verification uses the same object with one block whose context is the whole prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # flex_attention is imported when used: older torch builds lack it
    from torch.nn.attention.flex_attention import BlockMask

log = logging.getLogger(__name__)

_T = TypeVar("_T")

BACKENDS = ("auto", "sdpa", "flex")


@dataclass(frozen=True)
class LayerRule:
    """Which keys a layer's block queries see: ``window`` None is full attention (context
    before the anchor, the whole block in both directions), ``window`` w a sliding layer
    (the last w positions up to the query's own, causal inside the block)."""

    window: int | None = None
    # Sliding layers only: causal inside the block (the engines' default for a sliding
    # layer), or bidirectional within the window (``is_causal: false``, as DFlash2's
    # reference checkpoint sets; vLLM's window is then w - 1 positions on either side).
    causal: bool = True

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    @property
    def key(self) -> str:
        if self.window is None:
            return "full"
        return f"sliding{self.window}" + ("" if self.causal else "-bidirectional")

    def in_block(self, back: torch.Tensor) -> torch.Tensor:
        """Whether a sliding layer's query sees the block key ``back`` slots before it
        (negative: after it)."""
        assert self.window is not None
        if self.causal:
            return (back >= 0) & (back < self.window)
        return back.abs() < self.window


FULL = LayerRule()


@dataclass(frozen=True)
class BlockChunk:
    """A chunk of ``n`` blocks and the context keys they may draw on.

    ``ctx_doc``/``ctx_pos`` ``[S]``: document and in-document position of each context key
    (the slice of the packed context the chunk's documents occupy); ``blk_doc``/``blk_anchor``
    ``[n]``: each block's document and anchor position. All int64, on the model's device.
    """

    ctx_doc: torch.Tensor
    ctx_pos: torch.Tensor
    blk_doc: torch.Tensor
    blk_anchor: torch.Tensor
    block_size: int

    def _once(self, key: str, build: Callable[[], _T]) -> _T:
        """``build()``, computed once per chunk (every layer of the drafter reuses it)."""
        if key not in self.__dict__:
            object.__setattr__(self, key, build())
        return self.__dict__[key]

    @property
    def num_queries(self) -> int:
        return int(self.blk_doc.numel()) * self.block_size

    @property
    def num_keys(self) -> int:
        return int(self.ctx_doc.numel()) + self.num_queries

    def query_rule(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query slot: its block index, document and anchor (``[n*B]`` each)."""
        b = self.block_size
        q_blk = torch.arange(self.num_queries, device=self.blk_doc.device) // b
        return q_blk, self.blk_doc[q_blk], self.blk_anchor[q_blk]

    def dense_mask(self, rule: LayerRule = FULL) -> torch.Tensor:
        """``[n*B, S + n*B]`` bool, True where a query may attend (built once per chunk and
        rule)."""
        return self._once(f"_dense_{rule.key}", lambda: self._dense_mask(rule))

    def _dense_mask(self, rule: LayerRule) -> torch.Tensor:
        q_blk, q_doc, q_anchor = self.query_rule()
        ctx_ok = (self.ctx_doc[None, :] == q_doc[:, None]) & (
            self.ctx_pos[None, :] < q_anchor[:, None]
        )
        own = q_blk[:, None] == q_blk[None, :]
        if rule.window is not None:
            slot = torch.arange(self.num_queries, device=q_blk.device) % self.block_size
            lowest = q_anchor + slot - rule.window + 1  # [n*B]: the window's first position
            ctx_ok &= self.ctx_pos[None, :] >= lowest[:, None]
            own &= rule.in_block(slot[:, None] - slot[None, :])
        return torch.cat([ctx_ok, own], dim=1)

    def per_document(self, rule: LayerRule = FULL) -> PerDocument:
        """The chunk regrouped by document for SDPA (built once per chunk and rule)."""
        return self._once(f"_per_document_{rule.key}", lambda: _per_document(self, rule))

    def block_mask(self, rule: LayerRule = FULL) -> BlockMask:
        """The flex-attention ``BlockMask`` of the rule, built once per chunk and rule (every
        layer of the drafter with that rule reuses it); compiled on CUDA, where building it
        eagerly costs more than the attention itself."""
        device = self.blk_doc.device
        build = _mask_builder(device.type)
        return self._once(
            f"_block_mask_{rule.key}",
            lambda: build(self.mask_mod(rule), None, None, self.num_queries, self.num_keys, device),
        )

    def mask_mod(self, rule: LayerRule = FULL) -> Callable[..., torch.Tensor]:
        """The rule as a flex-attention ``mask_mod(b, h, q_idx, kv_idx)``."""
        q_blk, q_doc, q_anchor = self.query_rule()
        span, b = int(self.ctx_doc.numel()), self.block_size
        # One sentinel entry so block keys (kv_idx >= span) index safely.
        ctx_doc = torch.cat([self.ctx_doc, self.ctx_doc.new_full((1,), -1)])
        ctx_pos = torch.cat([self.ctx_pos, self.ctx_pos.new_zeros(1)])
        window = rule.window

        def full(
            bi: torch.Tensor, hi: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            is_ctx = kv_idx < span
            c = torch.clamp(kv_idx, max=span)
            ctx_ok = is_ctx & (ctx_doc[c] == q_doc[q_idx]) & (ctx_pos[c] < q_anchor[q_idx])
            own = (~is_ctx) & ((kv_idx - span) // b == q_blk[q_idx])
            return ctx_ok | own

        if window is None:
            return full

        def sliding(
            bi: torch.Tensor, hi: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            c = torch.clamp(kv_idx, max=span)
            slot = q_idx % b
            in_ctx_window = ctx_pos[c] >= q_anchor[q_idx] + slot - window + 1
            in_block_window = rule.in_block(slot - (kv_idx - span) % b)
            is_ctx = kv_idx < span
            return full(bi, hi, q_idx, kv_idx) & torch.where(is_ctx, in_ctx_window, in_block_window)

        return sliding


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` means ``flex`` on CUDA when this torch has it, else ``sdpa``."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    return "flex" if device.type == "cuda" and _flex_available() else "sdpa"


def packed_attention(backend: str) -> str:
    """What a packed row's attention computes under a resolved backend, as the loader's
    cost model names it (``BatchSpec.packed_attention``): ``documents`` under both, flex's
    block mask skipping the tiles between documents and SDPA running each document apart
    (the drafter's chunks and the target's forwards). The loader still plans ``row`` (the
    row's length squared, whatever its documents) for a profile calibrated when SDPA
    attended over the whole row under a dense mask."""
    if backend not in ("sdpa", "flex"):
        raise ValueError(f"attention must be 'sdpa' or 'flex', got {backend!r}")
    return "documents"


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: BlockChunk,
    backend: str,
    rule: LayerRule = FULL,
) -> torch.Tensor:
    """Attention of ``q [1, h, n*B, d]`` over ``k, v [1, kv_h, S + n*B, d]`` under the rule."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # autocast may leave normed q/k and plain v apart
    if backend == "flex":
        return _flex(q, k, v, chunk, rule)
    return _sdpa_per_document(q, k, v, chunk, rule)


def _sdpa_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: BlockChunk, rule: LayerRule
) -> torch.Tensor:
    """SDPA with a dense mask, one padded row per document of the chunk.

    A chunk spanning many short documents would otherwise pay for every document's
    context with every query; per document the work is its own queries x (its context up
    to its last anchor + its own block keys), as a padded batch in one call.
    """
    idx = chunk.per_document(rule)
    qd = q[0][:, idx.q_index].transpose(0, 1)  # [D, h, maxQ, d]
    kd = k[0][:, idx.k_index].transpose(0, 1)  # [D, kv_h, maxK, d]
    vd = v[0][:, idx.k_index].transpose(0, 1)
    if kd.shape[1] != qd.shape[1]:
        kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], dim=1)
        vd = vd.repeat_interleave(qd.shape[1] // vd.shape[1], dim=1)
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=idx.mask[:, None])
    return out.transpose(0, 1)[:, idx.slot_doc, idx.slot_row][None]


@dataclass(frozen=True)
class PerDocument:
    """A chunk regrouped by document: ``q_index [D, maxQ]`` and ``k_index [D, maxK]`` pick
    each document's queries and keys (context, then its blocks) out of the chunk's,
    ``mask [D, maxQ, maxK]`` is the rule (padding excluded; padded query rows see one key so
    that no softmax row is empty), and query slot ``i`` of the chunk is row
    ``slot_row[i]`` of document ``slot_doc[i]``."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor
    slot_doc: torch.Tensor
    slot_row: torch.Tensor


def _per_document(chunk: BlockChunk, rule: LayerRule) -> PerDocument:
    b, dev = chunk.block_size, chunk.blk_doc.device
    n, span = int(chunk.blk_doc.numel()), int(chunk.ctx_doc.numel())
    docs, blk_j = torch.unique_consecutive(chunk.blk_doc, return_inverse=True)
    d = int(docs.numel())
    nblk = torch.bincount(blk_j, minlength=d)
    first_blk = torch.cumsum(nblk, 0) - nblk
    # Each document's context: a contiguous run of the chunk's context slice.
    on = chunk.ctx_doc[None, :] == docs[:, None]  # [D, S]
    ctx_len = on.sum(1)
    ctx_first = on.float().argmax(1) if span else torch.zeros_like(ctx_len)
    max_q, max_c = int(nblk.max()) * b, int(ctx_len.max()) if span else 0
    rows = torch.arange(max_q, device=dev)
    q_valid = rows[None, :] < nblk[:, None] * b  # [D, maxQ]
    q_index = torch.where(q_valid, first_blk[:, None] * b + rows[None, :], 0)
    cols = torch.arange(max_c, device=dev)
    c_valid = cols[None, :] < ctx_len[:, None]
    c_index = torch.where(c_valid, ctx_first[:, None] + cols[None, :], 0)
    k_index = torch.cat([c_index, span + q_index], dim=1)
    # Rule: context key c of document j iff its position < the query's anchor; block keys of
    # the query's own block.
    q_blk = torch.where(q_valid, first_blk[:, None] + rows[None, :] // b, 0)
    q_anchor = chunk.blk_anchor[q_blk]  # [D, maxQ]
    c_pos = chunk.ctx_pos[c_index] if span else c_index  # [D, maxC]
    ctx_ok = c_valid[:, None, :] & (c_pos[:, None, :] < q_anchor[:, :, None])
    own = (rows[None, :, None] // b == rows[None, None, :] // b) & q_valid[:, None, :]
    if rule.window is not None:
        slot = rows % b  # [maxQ]: each query's slot in its block
        lowest = q_anchor + slot[None, :] - rule.window + 1  # [D, maxQ]
        ctx_ok &= c_pos[:, None, :] >= lowest[:, :, None]
        own &= rule.in_block(slot[:, None] - slot[None, :])[None]
    mask = torch.cat([ctx_ok, own], dim=2) & q_valid[:, :, None]
    mask[:, :, max_c] |= ~q_valid  # padded query rows: one (block) key, output unused
    slots = torch.arange(n * b, device=dev)
    slot_doc = blk_j[slots // b]
    slot_row = slots - first_blk[slot_doc] * b
    return PerDocument(q_index, k_index, mask, slot_doc, slot_row)


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: BlockChunk, rule: LayerRule
) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    mask = chunk.block_mask(rule)
    return _flex_kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=gqa)


@cache
def _mask_builder(device_type: str) -> Callable[..., BlockMask]:
    from torch.nn.attention.flex_attention import create_block_mask

    if device_type != "cuda":
        return create_block_mask
    return torch.compile(create_block_mask, dynamic=True)


@cache
def _flex_kernel(device_type: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention  # eager: the unfused reference implementation
    return torch.compile(flex_attention, dynamic=True)
