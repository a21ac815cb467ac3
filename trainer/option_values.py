"""How an option's value is checked and read: the types ``trainer.options`` declares
(unions with None, paths, tuples), against what JSON and TOML hold (strings for paths, lists
for tuples, integers for floats). No torch, nothing of the trainer."""

from __future__ import annotations

import types
import typing
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
