"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass.

A block is ``[anchor, MASK x (B-1)]`` placed at positions ``anchor_pos .. anchor_pos+B-1``.
Queries come only from the block's B tokens. Keys and values are the block's own tokens
plus the *context*: the target's hidden states at the chosen layers for every position
before the anchor, concatenated (``n*H``), projected to ``H`` (no bias) and RMS-normalized
once, then fed through each layer's own ``k_proj``/``v_proj`` (so every layer sees the
target, not only the first). Attention is bidirectional inside a block; which context
positions a block may see is entirely the mask's business (``block_attention_mask``).

The drafter has no embedding or LM head of its own: the caller embeds the anchor with the
target's frozen ``embed_tokens`` and scores the output with the target's frozen ``lm_head``.
Keeping them outside this module keeps DDP from broadcasting and checkpointing frozen
target weights. The MASK token is one learned vector (``mask_embedding``, initialized to the
mean target embedding) rather than a row of the target's vocabulary, because a target need
not have a spare token id and its embedding is frozen.

Training packs many blocks per document into one call: ``A`` anchors give ``A*B`` queries
against ``T`` context keys plus the ``A*B`` block keys; the mask keeps every block to its own
``B`` keys and to the context strictly before its own anchor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    def __post_init__(self) -> None:
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
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide by num_kv_heads {self.num_kv_heads}"
            )

    @staticmethod
    def from_target(
        config: object, *, num_target_layers: int, **overrides: object
    ) -> DrafterConfig:
        """Width, heads and MLP size of a Hugging Face (Qwen3-like) target config."""
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        rope = getattr(config, "rope_parameters", None) or {}
        values: dict[str, object] = dict(
            hidden_size=hidden,
            intermediate_size=int(config.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        )
        values.update(overrides)
        return DrafterConfig(**values)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` of shape ``[..., head_dim]`` for integer ``positions [...]``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [R, heads, S, d]`` by ``cos/sin [R, S, d]`` (the half-split convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].to(x.dtype) + rot * sin[:, None].to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


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
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        k = self.k_norm(self._split(self.k_proj(kv_in), self.kv_heads))
        v = self._split(self.v_proj(kv_in), self.kv_heads)
        q, k = apply_rotary(q, *rope_q), apply_rotary(k, *rope_k)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, rope_q, rope_k, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, mask)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDrafter(nn.Module):
    """Projection of target features, K decoder layers, final norm and the MASK vector."""

    def __init__(self, cfg: DrafterConfig, mask_init: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        init = torch.zeros(h) if mask_init is None else mask_init.detach().float().clone()
        self.mask_embedding = nn.Parameter(init)

    def block_inputs(self, anchor_embeds: torch.Tensor) -> torch.Tensor:
        """``[anchor, MASK x (B-1)]`` inputs for ``anchor_embeds [R, A, H]``: ``[R, A*B, H]``."""
        r, a, h = anchor_embeds.shape
        b = self.config.block_size
        x = anchor_embeds.to(self.mask_embedding.dtype)
        masks = self.mask_embedding.expand(r, a, b - 1, h)
        return torch.cat([x[:, :, None], masks], dim=2).reshape(r, a * b, h)

    def forward(
        self,
        anchor_embeds: torch.Tensor,
        target_feats: torch.Tensor,
        block_pos: torch.Tensor,
        ctx_pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states ``[R, A*B, H]`` of the block tokens (after the final norm).

        Args:
            anchor_embeds: ``[R, A, H]`` target embeddings of the ``A`` anchor tokens.
            target_feats: ``[R, T, n*H]`` concatenated target hidden states of the context.
            block_pos, ctx_pos: ``[R, A*B]`` and ``[R, T]`` RoPE positions.
            mask: ``[R, A*B, T + A*B]`` bool, True where a query may attend
                (``block_attention_mask``).
        """
        ctx = self.hidden_norm(self.fc(target_feats.to(self.fc.weight.dtype)))
        d, theta = self.config.head_dim, self.config.rope_theta
        rope_q = rotary(block_pos, d, theta)
        rope_k = rotary(torch.cat([ctx_pos, block_pos], dim=1), d, theta)
        h = self.block_inputs(anchor_embeds)
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_k, mask)
        return self.norm(h)


def block_attention_mask(
    anchor_pos: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int
) -> torch.Tensor:
    """Who may attend to whom, for ``A`` blocks per row: ``[R, A*B, ctx_len + A*B]`` bool.

    Query ``j*B + k`` (block ``j``, offset ``k``) sees context key ``t`` iff block ``j`` is
    valid and ``t < anchor_pos[j]`` (strictly before its anchor), and block key ``i*B + m``
    iff ``i == j`` (its own block, in both directions). Every query sees at least its own
    block, so no softmax row is empty.
    """
    r, a = anchor_pos.shape
    t = torch.arange(ctx_len, device=anchor_pos.device)
    ctx_ok = (t[None, None, :] < anchor_pos[:, :, None]) & valid[:, :, None]
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=1)
    blk = torch.arange(a * block_size, device=anchor_pos.device) // block_size
    same = (blk[:, None] == blk[None, :]).expand(r, -1, -1)
    return torch.cat([ctx_ok, same], dim=-1)
