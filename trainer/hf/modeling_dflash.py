"""A DFlash draft model for Transformers (the z-lab ``DFlashDraftModel`` weight layout).

Written by dflash-loader's trainer; the math is exactly its drafter's
(``trainer/model/drafter.py``), self-contained (torch + transformers only):

* the context (the target's hidden states at ``target_layer_ids``, concatenated) goes
  through ``fc`` and ``hidden_norm`` once;
* each layer: queries from the block's B slots (``input_layernorm`` first); keys and values
  from ``[context ; block]``, keys RMS-normed per head (``k_norm``) and rotated at their
  absolute positions (RoPE, half-split, ``rope_theta``; a scaled ``rope_parameters``, YaRN,
  linear or llama3, through Transformers' own ``ROPE_INIT_FUNCTIONS``, as the target
  rotates); the block attends to all of
  it, bidirectionally; a ``sliding_attention`` layer (``layer_types``) instead lets the
  query at position q see keys at positions q - sliding_window + 1 .. q only (causal
  inside the block; with ``is_causal`` false, also the block's later slots within the
  window), as SGLang and vLLM serve it; residual; MLP (SiLU-gated); residual;
* a final ``norm``. Logits are the caller's: the target's ``lm_head`` on slots 1..B-1.

There is no embedding: slot 0 is the anchor token's target embedding, slots 1..B-1 the
target embedding of ``mask_token_id``.

Calls:

* ``model(noise_embeds=[b, B, H], context_hidden_states=[b, n, k*H], position_ids=[b, n+B])``
  returns ``last_hidden_state [b, B, H]`` (in ``noise_embeds``' dtype);
* Transformers' ``target.generate(ids, assistant_model=model, speculation_type="dflash")``
  calls it with a ``DFlashCache`` (``cache=``): the new context's keys and values are
  appended to it, the previous block's are cropped out by the caller. ``position_ids`` may be
  omitted with a cache: they then continue after its length.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_dflash import DFlashConfig

if TYPE_CHECKING:
    from transformers import Cache

# transformers 5 renamed the output's ``past_key_values`` to ``cache``.
_CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
    else "past_key_values"
)


#: Scaled RoPE types rotated as Transformers' rotary embeddings do (frequencies that change
#: with the sequence length, dynamic and longrope, are not: the trainer refuses them).
SCALED_ROPE = ("linear", "yarn", "llama3")


def rope_frequencies(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] fp32 on CPU, attention factor)``: the closed form for plain
    RoPE, else Transformers' own init function for the config's type (YaRN's factor
    multiplies cos and sin)."""
    kind, d = _rope_type(config), config.head_dim
    if kind == "default":
        theta = _rope_theta(config)
        return 1.0 / theta ** (torch.arange(0, d, 2, device="cpu") / d), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv.float(), float(factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[b, 1, S, head_dim]`` (fp32) for integer ``positions [b, S]``."""
    ang = positions.float()[..., None] * inv_freq.to(positions.device)
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    if factor == 1.0:
        return ang.cos(), ang.sin()
    return ang.cos() * factor, ang.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer_idx, self.head_dim = layer_idx, d
        kv_heads = config.num_key_value_heads
        if kv_heads is None:  # Qwen3Config sets it (to num_attention_heads) when not given
            raise ValueError("DFlash config needs num_key_value_heads")
        self.heads, self.kv_heads = config.num_attention_heads, kv_heads
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None) or ()
        window = getattr(config, "sliding_window", None)
        sliding = bool(kinds) and kinds[layer_idx] == "sliding_attention"
        self.window = int(window) if sliding and window is not None else None
        # is_causal / dflash_config.causal false: sliding layers bidirectional in the block
        said = [getattr(config, "is_causal", None), config.dflash_config.get("causal")]
        self.causal = all(v is None or bool(v) for v in said)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[b, S, heads*d]`` -> ``[b, heads, S, d]``."""
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keep: torch.Tensor | None,
        positions: torch.Tensor,
        cache: Cache | None,
    ) -> torch.Tensor:
        """Block ``x [b, B, H]`` (normed) over keys of ``[ctx ; x]`` (and the cache);
        ``keep [b, keys]`` marks padding (None: none), ``positions [b, n + B]`` are those of
        ``[ctx ; x]``."""
        cos, sin = rope
        q_len = x.shape[1]
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        q = apply_rope(q, cos[..., -q_len:, :], sin[..., -q_len:, :])
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)
        k = apply_rope(self.k_norm(self._split(self.k_proj(kv_in), self.kv_heads)), cos, sin)
        v = self._split(self.v_proj(kv_in), self.kv_heads)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        mask = self._mask(keep, positions, k.shape[-2], q_len)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def _mask(
        self, keep: torch.Tensor | None, positions: torch.Tensor, keys: int, q_len: int
    ) -> torch.Tensor | None:
        """SDPA's boolean mask for ``keys`` keys (cached, then ``positions``' own).

        Full layers: every key but padding. Sliding layers: the key at position p is seen
        from the query at position q iff 0 <= q - p < window. A sliding layer's cache may
        keep only its last states (Transformers' sliding cache layers): the cached keys are
        the positions just before ``positions``' first, and ``keep`` is cut to them."""
        if self.window is None:
            if keep is not None and keep.shape[-1] != keys:
                raise ValueError(
                    f"attention_mask covers {keep.shape[-1]} keys, the layer has {keys} "
                    "(cached + context + block)"
                )
            return None if keep is None else keep[:, None, None, :]
        fresh = positions.shape[-1]
        if keys < fresh or (keep is not None and keep.shape[-1] < keys):
            raise ValueError(f"attention_mask and positions do not cover the layer's {keys} keys")
        cached = keys - fresh
        start = positions[:, :1]
        past = start - cached + torch.arange(cached, device=positions.device)[None]
        key_pos = torch.cat([past, positions], dim=1)  # [b, keys]
        back = positions[:, -q_len:, None] - key_pos[:, None, :]
        seen = (back >= 0) & (back < self.window) if self.causal else back.abs() < self.window
        if keep is not None:
            # Positions count kept keys only from the left edge: a gap inside a row would
            # shift them (and a sliding cache keeps its last slots, gaps included).
            first = keep.float().argmax(dim=-1, keepdim=True)
            after = torch.arange(keep.shape[-1], device=keep.device)[None] >= first
            if bool((after & ~keep).any()):
                raise ValueError(
                    "sliding_attention layers support left padding only (attention_mask has "
                    "a gap after a row's first kept key)"
                )
            seen &= keep[:, None, -keys:]
        return seen[:, None]


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False)
        self.up_proj = nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keep: torch.Tensor | None,
        positions: torch.Tensor,
        cache: Cache | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope, keep, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _check_config(config: DFlashConfig) -> None:
    if not config.target_layer_ids:
        raise ValueError("DFlash config needs dflash_config.target_layer_ids")
    if config.hidden_act != "silu" or getattr(config, "attention_bias", False):
        raise ValueError("this DFlash model supports hidden_act silu without attention bias only")
    kind = _rope_type(config)
    if kind not in ("default", *SCALED_ROPE):
        raise ValueError(
            f"this DFlash model supports RoPE default, {', '.join(SCALED_ROPE)}, not {kind!r}"
        )
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"}:
        raise ValueError(f"this DFlash model supports full and sliding attention, not {kinds}")
    listed = getattr(config, "layer_types", None)
    if listed is not None and len(listed) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(listed)} entries for {config.num_hidden_layers} layers"
        )
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        raise ValueError("sliding_attention layers need sliding_window (and use_sliding_window)")
    overrides = {
        "is_causal": getattr(config, "is_causal", None),
        "causal": config.dflash_config.get("causal"),
        "use_swa": config.dflash_config.get("use_swa"),
    }
    given = {k: v for k, v in overrides.items() if v not in (None, False)}
    if given:
        raise ValueError(
            f"this DFlash model supports bidirectional full layers only, not {given} "
            "(is_causal / causal false is fine: bidirectional sliding layers)"
        )


def _rope_type(config: DFlashConfig) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(rope.get("rope_type", rope.get("type", "default")))


def _rope_theta(config: DFlashConfig) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A 2D keep-mask ``[b, keys]`` (1 = attend) as bool; None where every key is kept."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, keys], got shape {tuple(mask.shape)}")
    keep = mask.bool()
    return None if bool(keep.all()) else keep


class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    main_input_name = "noise_embeds"
    # transformers reads it as any iterable of class names (it annotates a list or a set).
    _no_split_modules = ("DFlashDecoderLayer",)  # type: ignore[assignment]

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        _check_config(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_ids = config.target_layer_ids
        if layer_ids is None:  # refused by _check_config already
            raise ValueError("DFlash config needs dflash_config.target_layer_ids")
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = DFlashRMSNorm(h, eps)
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, eps)
        self.rope_theta = _rope_theta(config)
        # Computed at the first forward (a model built on the meta device has no values
        # yet) and kept as plain attributes, not buffers: no weight of the folder, and never
        # cast to bf16 with the model (a bf16 table is off by radians at long positions).
        self._rope: tuple[torch.Tensor, float] | None = None
        self.post_init()

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutputWithPast:
        """See the module docstring. ``past_key_values`` is an alias of ``cache``."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(context_hidden_states.to(dtype)))
        n, b = ctx.shape[1], noise_embeds.shape[1]
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + n + b, device=ctx.device)
        position_ids = position_ids.expand(noise_embeds.shape[0], -1)
        if position_ids.shape[-1] != n + b:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions, expected context {n} + "
                f"block {b}"
            )
        if self._rope is None:
            self._rope = rope_frequencies(cast(DFlashConfig, self.config))
        rope = rope_cos_sin(position_ids, *self._rope)
        keep = _key_mask(attention_mask)
        h = noise_embeds.to(dtype)
        for layer in self.layers:
            h = layer(h, ctx, rope, keep, position_ids, cache)
        h = self.norm(h).to(noise_embeds.dtype)
        # The cache's field name depends on the transformers version: mypy checks the value
        # against every field.
        return BaseModelOutputWithPast(last_hidden_state=h, **{_CACHE_FIELD: cache})  # type: ignore[arg-type]


__all__ = ["DFlashDraftModel"]
