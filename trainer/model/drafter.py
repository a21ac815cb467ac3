"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass.

A block is ``[anchor, MASK x (B-1)]`` placed at positions ``anchor .. anchor+B-1``. Queries
come only from the block's B tokens. Keys and values are the block's own tokens plus the
*context*: the target's hidden states at the chosen layers for every position before the
anchor, concatenated (``n*H``), projected to ``H`` (no bias) and RMS-normalized once, then
fed through each layer's own ``k_proj``/``v_proj`` (so every layer sees the target, not only
the first). Attention is bidirectional inside a block; which context keys a block may see
is ``trainer.model.attention``'s rule. A layer marked "sliding_attention" in ``layer_types``
sees only the last ``sliding_window`` positions, causally inside the block (the rule SGLang
and vLLM serve for z-lab's sliding-window drafters).

The drafter has no embedding or LM head of its own: block tokens are embedded with the
target's frozen ``embed_tokens`` and scored with its frozen ``lm_head`` by the caller. The
MASK slot is, as in the reference model and every serving engine, the frozen embedding row
of ``mask_token_id``; a learned MASK vector (``mask_token_id=None``) remains as an explicit
opt-in that serving engines cannot load.

Memory: one ``forward`` drafts every block of a micro-batch, but in chunks of
``chunk_blocks`` blocks. The context's keys and values are computed once per layer; each
chunk (its layers, attention and the slots it returns) runs under activation checkpointing,
so what stays alive across chunks is the context and the returned hidden states, not the
chunk's activations, and attention masks exist per chunk only. Peak memory then follows
the chunk size, not the number of anchors. A micro-batch of at most ``KEEP_CHUNKS`` chunks
keeps its activations instead (no recompute; still bounded by the chunk size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.model.attention import FULL, BlockChunk, LayerRule, block_attention
from trainer.model.dflash2 import VARIANTS, CandidateSelector, GroupedConv
from trainer.model.rope import check_scaling, rotary, scaling_from_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


FULL_ATTENTION, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING)


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Drafter shape. ``from_target`` copies the width and attention shape of the target."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_target_layers: int
    num_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The target's RoPE scaling (``trainer.model.rope``: rope_type, factor,
    # original_max_position_embeddings, ...); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    # None: a learned MASK vector (opt-in; serving engines embed mask_token_id instead).
    mask_token_id: int | None = None
    # Per layer "full_attention" or "sliding_attention" (None: all full); a sliding layer
    # sees the last ``sliding_window`` positions, causally inside the block (LayerRule).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # Sliding layers causal inside the block (the engines' default), or bidirectional
    # within the window (``is_causal: false``).
    sliding_causal: bool = True
    # "dflash2": grouped convolutions around each sublayer and a candidate selector
    # (``trainer.model.dflash2``); its fields below keep their defaults for "dflash".
    variant: str = "dflash"
    vocab_size: int | None = None  # the target's (the selector's codebooks); dflash2 only
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        self._check_layer_types()
        check_scaling(self.rope_scaling)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_target_layers",
            "num_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide by num_kv_heads {self.num_kv_heads}"
            )
        sliding = self.layer_types is not None
        if sliding and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.sliding_window is not None and not sliding:
            raise ValueError(
                f"sliding_window {self.sliding_window} is set but no layer is sliding_attention"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not self.sliding_causal and not sliding:
            raise ValueError("sliding_causal False (bidirectional) but no layer is sliding")
        self._check_variant()

    def _check_variant(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant != "dflash2":
            if self.vocab_size is not None:
                raise ValueError("vocab_size is a dflash2 field (its selector's codebooks)")
            return
        if self.vocab_size is None or self.vocab_size < 1:
            raise ValueError(f"a dflash2 drafter needs the target's vocab_size ({self.vocab_size})")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"selector_top_k {self.selector_top_k} exceeds the vocabulary ({self.vocab_size})"
            )
        if not self.output_multiplier > 0:
            raise ValueError(f"output_multiplier must be > 0, got {self.output_multiplier}")
        cap = self.final_logit_softcapping
        if cap is not None and not cap > 0:
            raise ValueError(f"final_logit_softcapping must be > 0 (or unset), got {cap}")

    def _check_layer_types(self) -> None:
        """``layer_types`` checked, as a tuple; all full is None (one spelling per config)."""
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, str):
            raise ValueError(f"layer_types must be a sequence of names, got {self.layer_types!r}")
        kinds = tuple(self.layer_types)
        if len(kinds) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(kinds)} entries for {self.num_layers} drafter layers"
            )
        unknown = sorted(set(kinds) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown}: each must be one of {LAYER_TYPES}")
        object.__setattr__(self, "layer_types", kinds if SLIDING in kinds else None)

    def layer_rule(self, index: int) -> LayerRule:
        """The attention rule of drafter layer ``index``."""
        if self.layer_types is not None and self.layer_types[index] == SLIDING:
            return LayerRule(window=self.sliding_window, causal=self.sliding_causal)
        return FULL

    @staticmethod
    def from_target(
        config: PretrainedConfig, *, num_target_layers: int, **overrides: object
    ) -> DrafterConfig:
        """Width, heads and MLP size of a Hugging Face (Qwen3-like) target config."""
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        rope = getattr(config, "rope_parameters", None) or {}
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(config.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rope_scaling=scaling_from_config(config),
        )
        if overrides.get("variant") == "dflash2":
            values["vocab_size"] = int(config.vocab_size)
        values.update(overrides)
        return DrafterConfig(**values)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, d]`` by ``cos/sin [S, d]`` (the half-split convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 (fp64 stays fp64) and returned in the input's dtype, as Qwen3's
        # norm does: under CUDA autocast rms_norm would otherwise turn bf16 activations into
        # fp32 ones.
        dtype = torch.promote_types(x.dtype, torch.float32)
        out = F.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), self.eps)
        return out.to(x.dtype)


class DrafterAttention(nn.Module):
    """Block queries over ``[context keys ; block keys]`` (Qwen3 style: q/k RMS-norm, RoPE)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[S, heads*d]`` -> ``[1, heads, S, d]``."""
        return x.view(1, x.shape[0], heads, self.head_dim).transpose(1, 2)

    def keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values ``[1, kv_heads, S, d]`` of inputs ``x [S, H]``."""
        k = apply_rotary(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), *rope)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        chunk: BlockChunk,
        backend: str,
        rule: LayerRule = FULL,
    ) -> torch.Tensor:
        """Block inputs ``x [n*B, H]`` attend to ``ctx_kv`` (this chunk's context) and their
        own blocks under ``rule``; returns ``[n*B, H]``."""
        q = apply_rotary(self.q_norm(self._split(self.q_proj(x), self.heads)), *rope)
        k_blk, v_blk = self.keys_values(x, rope)
        k = torch.cat([ctx_kv[0].to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_kv[1].to(v_blk.dtype), v_blk], dim=2)
        out = block_attention(q, k, v, chunk, backend, rule)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int = 0) -> None:
        super().__init__()
        self.rule = cfg.layer_rule(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)
        if cfg.variant == "dflash2":
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            self.attention_conv: GroupedConv | None = GroupedConv(*conv)
            self.mlp_conv: GroupedConv | None = GroupedConv(*conv)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(
        self,
        h: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        chunk: BlockChunk,
        backend: str,
    ) -> torch.Tensor:
        if self.attention_conv is None or self.mlp_conv is None:
            h = h + self.self_attn(self.input_layernorm(h), ctx_kv, rope, chunk, backend, self.rule)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, out_side = self.attention_conv.prepare(self.input_layernorm(h))
        x = self.self_attn(x, ctx_kv, rope, chunk, backend, self.rule)
        h = h + self.attention_conv.finish(x, out_side)
        x, out_side = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), out_side)


@dataclass(frozen=True)
class DraftBlocks:
    """Every block of a micro-batch (document-major, anchors ascending) and its context.

    ``feats [R, L, n*H]``: the target features of the micro-batch's rows; the packed context
    is ``feats[ctx_row, ctx_col]`` with ``ctx_doc``/``ctx_pos`` its document and position
    (``[S]`` each, documents contiguous). ``blk_doc``/``blk_anchor``/``anchor_ids`` ``[N]``:
    each block's document, anchor position and anchor token. ``keep [N, B]`` (optional):
    the slots whose hidden states ``forward`` returns (default: all). ``chunks``: the
    ``(block_lo, block_hi, ctx_lo, ctx_hi)`` ranges drafted together (``plan_chunks``).
    """

    feats: torch.Tensor
    ctx_row: torch.Tensor
    ctx_col: torch.Tensor
    ctx_doc: torch.Tensor
    ctx_pos: torch.Tensor
    blk_doc: torch.Tensor
    blk_anchor: torch.Tensor
    anchor_ids: torch.Tensor
    chunks: tuple[tuple[int, int, int, int], ...]
    keep: torch.Tensor | None = None

    @staticmethod
    def one_document(
        feats: torch.Tensor, anchors: list[int], anchor_ids: torch.Tensor
    ) -> DraftBlocks:
        """Every slot of blocks at ``anchors`` over one document whose features are
        ``feats [1, n, n*H]`` (verification, the dummy block, tests): one chunk."""
        device, n = feats.device, feats.shape[1]
        zeros = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.arange(n, device=device)
        return DraftBlocks(
            feats=feats,
            ctx_row=zeros,
            ctx_col=positions,
            ctx_doc=zeros,
            ctx_pos=positions,
            blk_doc=torch.zeros(len(anchors), dtype=torch.long, device=device),
            blk_anchor=torch.tensor(anchors, dtype=torch.long, device=device),
            anchor_ids=anchor_ids.reshape(-1).long().to(device),
            chunks=plan_chunks([0] * len(anchors), anchors, [0], 0),
        )


def plan_chunks(
    blk_doc: list[int], blk_anchor: list[int], doc_start: list[int], chunk_blocks: int
) -> tuple[tuple[int, int, int, int], ...]:
    """Cut ``N`` blocks into runs of ``chunk_blocks`` (0: one run) with the packed-context
    range each run needs: from the start of its first document to the furthest anchor of
    its blocks (a block sees only positions before its anchor). Document-major blocks keep
    that range tight; any order stays correct."""
    n = len(blk_doc)
    step = chunk_blocks if chunk_blocks > 0 else max(n, 1)
    out = []
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        docs, anchors = blk_doc[lo:hi], blk_anchor[lo:hi]
        ctx_lo = min(doc_start[d] for d in docs)
        ctx_hi = max(doc_start[d] + a for d, a in zip(docs, anchors, strict=True))
        out.append((lo, hi, ctx_lo, ctx_hi))
    return tuple(out)


KEEP_CHUNKS = 2  # chunks per micro-batch drafted without activation checkpointing


#: Per drafter layer, the context's keys and values ``[1, kv_heads, S, d]``.
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


#: Standard deviation of the drafter's projections at initialisation: Transformers'
#: ``initializer_range`` of Qwen3, Llama and GPT-OSS, which the reference drafter and
#: speculators' start from. PyTorch's default (``1/sqrt(3 fan_in)``: 0.036 for a 256-wide
#: layer) trained drafters that accepted less (docs/TRAINER.md, "Initialisation").
INIT_STD = 0.02


class DFlashDrafter(nn.Module):
    """Projection of target features, K decoder layers, final norm (and, opt-in, a learned
    MASK vector). A dflash2 drafter also holds its ``candidate_selector``, which the head
    (``trainer.model.loss``) and the verifier use on what ``forward`` returns."""

    def __init__(self, cfg: DrafterConfig, *, init_std: float | None = None) -> None:
        """``init_std``: the projections' start (None: ``INIT_STD``; 0: PyTorch's default,
        drawn as each ``nn.Linear`` is made)."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Learned MASK (opt-in, not servable); set from the target's mean embedding by the
        # caller. With a mask_token_id the MASK is the target's frozen embedding row.
        self.mask_embedding = nn.Parameter(torch.zeros(h)) if cfg.mask_token_id is None else None
        self.candidate_selector = (
            CandidateSelector(cast(int, cfg.vocab_size), h, cfg.selector_rank, cfg.selector_top_k)
            if cfg.variant == "dflash2"
            else None
        )
        std = INIT_STD if init_std is None else init_std
        if std < 0:
            raise ValueError(f"init_std must be >= 0, got {std}")
        if std > 0:
            self._init_projections(std)

    def _init_projections(self, std: float) -> None:
        """Every projection of ``fc`` and the layers' attention and MLP drawn from N(0,
        ``std``), in module order; the norms start at 1, and DFlash2's own parts
        (convolutions that start as the identity, the selector) keep their own start
        (docs/TRAINER.md, "Initialisation")."""
        layers = cast(list[DrafterLayer], list(self.layers))
        parts: list[nn.Module] = [m for x in layers for m in (x.self_attn, x.mlp)]
        with torch.no_grad():
            for m in (self.fc, *(x for part in parts for x in part.modules())):
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)
                    if m.bias is not None:
                        m.bias.zero_()

    def block_inputs(self, embed: nn.Module, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``[anchor, MASK x (B-1)]`` embeddings for ``anchor_ids [n]``: ``[n*B, H]``."""
        b, dtype = self.config.block_size, self.fc.weight.dtype
        n = anchor_ids.numel()
        if self.mask_embedding is None:
            mask_id = self.config.mask_token_id
            if mask_id is None:  # __init__ made a learned MASK vector for that
                raise RuntimeError("a drafter without a MASK vector needs a mask_token_id")
            ids = anchor_ids.new_full((n, b), mask_id)
            ids[:, 0] = anchor_ids
            x = embed(ids.view(-1)).to(dtype)
        else:
            first = embed(anchor_ids).to(dtype)
            masks = self.mask_embedding.to(dtype).expand(n, b - 1, -1)
            x = torch.cat([first[:, None], masks], dim=1).reshape(n * b, -1)
        scale = self.config.input_embedding_scale
        return x * scale if scale != 1.0 else x

    def _project(self, feats: torch.Tensor) -> torch.Tensor:
        """The context's drafter inputs: the normed projection of target features ``[..., F]``
        (under autocast the projection casts; else the features match the weights)."""
        if not torch.is_autocast_enabled(feats.device.type):
            feats = feats.to(self.fc.weight.dtype)
        return cast(torch.Tensor, self.hidden_norm(self.fc(feats)))

    def _keys_values(self, ctx: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        cfg = self.config
        rope = rotary(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return [cast(DrafterLayer, layer).self_attn.keys_values(ctx, rope) for layer in self.layers]

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's context keys and values ``[1, kv_heads, S, d]`` for target features
        ``feats [S, F]`` at ``positions [S]``: a function of each position alone, so a
        verifier caches them and computes only the newly committed positions' each step."""
        return self._keys_values(self._project(feats), positions)

    def forward(
        self,
        embed: nn.Module,
        blocks: DraftBlocks,
        backend: str = "sdpa",
        ctx_kv: ContextKV | None = None,
    ) -> torch.Tensor:
        """Hidden states (after the final norm) of every block slot, ``[N*B, H]``, or of the
        slots ``blocks.keep`` selects, in block-major order.

        ``embed`` is the target's frozen embedding. ``ctx_kv``: the packed context's keys
        and values (``context_kv``) when the caller has them; ``blocks.feats`` is then not
        read. Chunks run under activation checkpointing when there are more than
        ``KEEP_CHUNKS`` (recomputed in backward).
        """
        if ctx_kv is None:
            ctx = self._project(blocks.feats)[blocks.ctx_row, blocks.ctx_col]
            ctx_kv = self._keys_values(ctx, blocks.ctx_pos)
        # Up to KEEP_CHUNKS chunks keep their activations (memory still bounded by the chunk
        # size); more are recomputed in backward.
        checkpointed = len(blocks.chunks) > KEEP_CHUNKS and torch.is_grad_enabled()
        outs = []
        for chunk in blocks.chunks:
            args = (embed, blocks, ctx_kv, chunk, backend)
            if checkpointed:  # nothing random inside: no RNG state to keep
                outs.append(
                    checkpoint(self._chunk, *args, use_reentrant=False, preserve_rng_state=False)
                )
            else:
                outs.append(self._chunk(*args))
        return torch.cat(outs) if len(outs) != 1 else outs[0]

    def _chunk(
        self,
        embed: nn.Module,
        blocks: DraftBlocks,
        ctx_kv: ContextKV,
        chunk: tuple[int, int, int, int],
        backend: str,
    ) -> torch.Tensor:
        lo, hi, c_lo, c_hi = chunk
        cfg, b = self.config, self.config.block_size
        anchors = blocks.blk_anchor[lo:hi]
        rules = BlockChunk(
            ctx_doc=blocks.ctx_doc[c_lo:c_hi],
            ctx_pos=blocks.ctx_pos[c_lo:c_hi],
            blk_doc=blocks.blk_doc[lo:hi],
            blk_anchor=anchors,
            block_size=b,
        )
        pos = (anchors[:, None] + torch.arange(b, device=anchors.device)).view(-1)
        rope = rotary(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        h = self.block_inputs(embed, blocks.anchor_ids[lo:hi])
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            h = layer(h, (k[:, :, c_lo:c_hi], v[:, :, c_lo:c_hi]), rope, rules, backend)
        h = self.norm(h)
        if blocks.keep is not None:
            h = h[blocks.keep[lo:hi].reshape(-1)]
        return h
