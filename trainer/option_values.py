"""How an option's value is checked and read: the types ``trainer.options`` declares
(unions with None, paths, tuples), against what JSON and TOML hold (strings for paths, lists
for tuples, integers for floats); and the option strings a drafter's shape is written in
(layer ids, layer kinds). No torch, nothing of the trainer."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def field_value(cls: type, name: str, value: Any) -> Any:
    """A JSON or TOML value for option ``name`` of ``cls``, in its declared form (a path, a
    tuple); ValueError when it has another type."""
    hint = typing.get_type_hints(cls)[name]
    out = from_json(value, hint)
    if not has_type(out, hint):
        raise ValueError(f"must be {type_name(hint)}, got {value!r}")
    return float(out) if float in _kinds(hint) and isinstance(out, int) else out


def to_json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def from_json(value: Any, hint: Any) -> Any:
    """``value`` as read from JSON, in the form ``hint`` declares (a path, a tuple)."""
    kinds = _kinds(hint)
    if Path in kinds and isinstance(value, str):
        return Path(value)
    if any(typing.get_origin(k) is tuple for k in kinds) and isinstance(value, list):
        return tuple(value)
    return value


def _kinds(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def has_type(value: Any, hint: Any) -> bool:
    return any(_is(value, kind) for kind in _kinds(hint))


def _is(value: Any, kind: Any) -> bool:
    if kind is type(None):
        return value is None
    if isinstance(value, bool) and kind is not bool:  # bool is an int to Python, not to us
        return False
    if kind is float:  # JSON and users write 1 for 1.0
        return isinstance(value, int | float)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(isinstance(v, item) for v in value)
    return isinstance(value, kind)


def type_name(hint: Any) -> str:
    return " or ".join(
        "null" if k is type(None) else getattr(k, "__name__", str(k)) for k in _kinds(hint)
    )


# ---- bounds ------------------------------------------------------------------------------


def option_problem(meta: Mapping[str, Any], value: Any) -> str | None:
    """What is wrong with ``value`` beyond its type ("must be >= 1, got 0"), by the choices
    and bounds an option's field declares beside it (``choices``, ``at_least``, ``above``,
    ``at_most``: ``trainer.options.opt``); None: fine. Flags, config files and ``config.json`` are
    checked by it alike."""
    choices = meta.get("choices")
    if choices and value is not None:
        for v in value if isinstance(value, tuple) else (value,):
            if v not in choices:
                return f"must be one of {', '.join(choices)}, got {v!r}"
    low, floor, high = meta.get("at_least"), meta.get("above"), meta.get("at_most")
    if value is None or (low is None and floor is None and high is None):
        return None
    if low is not None and high is not None:
        return None if low <= value <= high else f"must be in [{low}, {high}], got {value}"
    for bound, ok, says in ((low, lambda b: value >= b, ">="), (floor, lambda b: value > b, ">"),
                            (high, lambda b: value <= b, "<=")):  # fmt: skip
        if bound is not None and not (math.isfinite(value) and ok(bound)):
            return f"must be {says} {bound}, got {value}"
    return None


# ---- option strings the drafter's shape is given in ------------------------------------


def parse_int_list(value: str | None) -> list[int] | None:
    """``"0,1,2"`` -> ``[0, 1, 2]``; ``None``/empty -> ``None``."""
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {value!r}") from e


_LAYER_NAMES = {
    "full": "full_attention", "full_attention": "full_attention",
    "sliding": "sliding_attention", "sliding_attention": "sliding_attention",
}  # fmt: skip


def layer_kinds(value: str, num_layers: int) -> tuple[str, ...]:
    """``--layer-types`` (full/sliding or the config's names) as the config's names, one
    per drafter layer."""
    names = [v.strip() for v in value.split(",")]
    unknown = [v for v in names if v not in _LAYER_NAMES]
    if unknown:
        raise ValueError(
            f"--layer-types {value!r}: {unknown[0]!r} is not full or sliding "
            "(full_attention, sliding_attention)"
        )
    if len(names) != num_layers:
        raise ValueError(
            f"--layer-types {value!r} names {len(names)} layers, the drafter has {num_layers} "
            "(--drafter-layers)"
        )
    return tuple(_LAYER_NAMES[v] for v in names)


def parse_layer_types(
    value: str | None, sliding_window: int | None, num_layers: int
) -> tuple[str, ...] | None:
    """``--layer-types`` as the drafter config's ``layer_types`` (None: all full), checked
    against ``--sliding-window``, which alone makes every layer sliding."""
    if not value:
        return None if sliding_window is None else ("sliding_attention",) * num_layers
    kinds = layer_kinds(value, num_layers)
    if "sliding_attention" in kinds and sliding_window is None:
        raise ValueError(f"--layer-types {value!r} has sliding layers: give --sliding-window N")
    if "sliding_attention" not in kinds and sliding_window is not None:
        raise ValueError(
            f"--sliding-window {sliding_window}: --layer-types {value!r} has no sliding layer"
        )
    return None if "sliding_attention" not in kinds else kinds
