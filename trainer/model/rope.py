"""RoPE as the target applies it: plain, or scaled for long context (YaRN, linear, llama3).

The target's features come from its Hugging Face model, which rotates by its own config
(``rope_parameters``: ``rope_type``, ``factor``, ``original_max_position_embeddings``...).
The drafter attends over those features at the same absolute positions, so it must rotate
its queries and keys the same way, or a drafter trained at 64K positions sees another
geometry than the target at every position past the original context. ``rope_scaling``
(``scaling_from_config``: the target's rope parameters less ``rope_theta``; None for plain
RoPE) goes into the drafter's config and its export, and the frequencies come from
Transformers' own ``ROPE_INIT_FUNCTIONS`` (inverse frequencies and the attention factor
YaRN multiplies cos and sin by), so they are the target's by construction
(``tests/unit/test_rope.py`` compares with Qwen3's rotary embedding). Plain RoPE keeps the
closed form (bit-identical to what drafters trained before).

Refused (``check_scaling``): types whose rotation depends on the sequence length
(``dynamic`` NTK: Transformers rescales per forward past the context, vLLM once at a fixed
length; ``longrope``: short or long factors by the length), a ``partial_rotary_factor``
below 1 (the drafter rotates the whole head), and any type Transformers does not know.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

#: The scaled types the drafter (and its export's remote code) rotates as Transformers does.
SCALED_TYPES = ("linear", "yarn", "llama3")
#: Types whose frequencies change with the sequence length: no fixed rotation serves them.
LENGTH_DEPENDENT = ("dynamic", "longrope")

RopeScaling = dict[str, Any]


def scaling_from_config(config: Any) -> RopeScaling | None:
    """The scaling fields of a Hugging Face config's RoPE (``rope_parameters``, or the older
    ``rope_scaling``) less ``rope_theta``, with ``rope_type`` named so (older configs say
    ``type``); None for plain RoPE. A YaRN config without ``factor`` gets the one
    Transformers derives (``max_position_embeddings / original_max_position_embeddings``)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope = dict(rope or {})
    rope.pop("rope_theta", None)
    kind = rope.pop("type", None)
    rope["rope_type"] = str(rope.get("rope_type", kind or "default"))
    if rope["rope_type"] == "default":
        return None
    if rope["rope_type"] == "yarn" and rope.get("factor") is None:
        original = rope.get("original_max_position_embeddings")
        if original:
            rope["factor"] = float(config.max_position_embeddings) / float(original)
    return rope


#: The fields each scaled type cannot do without.
_NEEDED = {
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_SCALAR = (int, float, str, bool, type(None))


def check_scaling(scaling: RopeScaling | None, where: str = "rope_scaling") -> None:
    """Refuse what the drafter cannot rotate as the target does (module docstring)."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind in LENGTH_DEPENDENT:
        raise ValueError(
            f"{where}: rope_type {kind!r} changes its frequencies with the sequence length "
            "(Transformers and vLLM rescale it differently), so no drafter serves as the "
            f"target computes it; give the target's config.json one of {SCALED_TYPES} "
            "(YaRN, as Qwen3 documents for long context) or plain RoPE"
        )
    if kind not in _NEEDED:
        raise ValueError(f"{where}: rope_type {kind!r} is none of default, {SCALED_TYPES}")
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial}: the drafter rotates all")
    for key, value in scaling.items():
        if not isinstance(value, _SCALAR):
            raise ValueError(f"{where}: {key} = {value!r} is not a number")
    missing = [k for k in _NEEDED[kind] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope_type {kind!r} needs {missing[0]}")


def frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] fp32 on CPU, attention factor)``; computed once per shape."""
    items = None if scaling is None else tuple(sorted(scaling.items()))
    return _frequencies(int(head_dim), float(theta), items)


@lru_cache(maxsize=32)
def _frequencies(
    head_dim: int, theta: float, items: tuple[tuple[str, Any], ...] | None
) -> tuple[torch.Tensor, float]:
    if items is None:
        return 1.0 / theta ** (torch.arange(0, head_dim, 2) / head_dim), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(items)
    check_scaling(scaling)
    # rope_scaling + rope_theta: what Transformers 4.x reads; 5.x folds them into
    # rope_parameters (its typed fields do not list them: passed as extra keys)
    rope: dict[str, Any] = {"rope_scaling": scaling, "rope_theta": theta}
    config = Qwen3Config(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=_context(scaling),
        **rope,
    )
    inv, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    return inv.float(), float(factor)


def _context(scaling: RopeScaling) -> int:
    """The extended context a scaled config describes (``original x factor``): what
    Transformers' consistency checks expect of ``max_position_embeddings``. The frequencies
    do not read it (a YaRN factor is always set: ``scaling_from_config``)."""
    original = scaling.get("original_max_position_embeddings") or 4096
    return round(float(original) * float(scaling.get("factor") or 1.0))


def rotary(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``[..., head_dim]`` (fp32) for integer ``positions [...]``,
    scaled as ``scaling`` says (YaRN's attention factor multiplies both, as Transformers'
    rotary embedding does)."""
    if scaling is None:  # the closed form, on the positions' device (as drafters trained)
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
        factor = 1.0
    else:
        cpu, factor = frequencies(head_dim, theta, scaling)
        inv = cpu.to(positions.device)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    if factor == 1.0:
        return ang.cos(), ang.sin()
    return ang.cos() * factor, ang.sin() * factor
