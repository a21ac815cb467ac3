"""The batch-spec flags: one per ``BatchSpec`` field, the same names in every command, made
from the fields' declarations (type, choices, help: ``loader_server.wire.spec``).

``plan`` and ``bench`` take them with the spec's defaults (``spec_options``); ``serve``
takes them with no defaults (``spec_options(overrides_only=True)``), so only the flags a
user gives override the config file's ``[spec]`` table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from loader_server.wire.spec import SPEC_FIELDS as _SPEC_FIELDS
from loader_server.wire.spec import BatchSpec, expand_profile, field_help

F = TypeVar("F", bound=Callable[..., Any])
_DEFAULT = BatchSpec()
SPEC_FIELDS = tuple(_SPEC_FIELDS)


def _flag(name: str) -> tuple[str, dict[str, Any]]:
    """The flag of spec field ``name``: its name, type (or choices) and help, all read off
    the field's declaration (``loader_server.wire.spec``)."""
    meta = _SPEC_FIELDS[name].metadata
    kw: dict[str, Any] = {"help": field_help(name)}
    if "choices" in meta:
        kw["type"] = click.Choice(meta["choices"])
    elif "low" in meta:
        kw["type"] = int
    elif isinstance(_SPEC_FIELDS[name].default, float):
        kw["type"] = float
    return "--" + name.replace("_", "-"), kw


_FLAGS = [_flag(name) for name in SPEC_FIELDS]
_PROFILE_HELP = (
    "Cost profile (JSON from `dflash-train calibrate`): sets the cost coefficients and the "
    "anchor rule; --cost-* flags given with it win."
)


def spec_options(f: F | None = None, *, overrides_only: bool = False) -> Any:
    """Decorator adding the spec flags as keyword arguments (``@spec_options`` or
    ``@spec_options(overrides_only=True)``: defaults None, shown in the help text)."""

    def decorate(func: F) -> F:
        func = click.option(
            "--cost-profile", "cost_profile", type=click.Path(dir_okay=False), default=None,
            help=_PROFILE_HELP,
        )(func)  # fmt: skip
        for name, kw in reversed(_FLAGS):
            field = name[2:].replace("-", "_")
            default = getattr(_DEFAULT, field)
            if isinstance(default, tuple):
                default = ",".join(map(str, default))
            if overrides_only:
                kw = {**kw, "help": f"{kw['help']} [default: {default}]"}
                func = click.option(name, field, default=None, **kw)(func)
            else:
                func = click.option(name, field, default=default, show_default=True, **kw)(func)
        return func

    return decorate(f) if f is not None else decorate


def spec_from_options(**kwargs: Any) -> BatchSpec:
    """The ``BatchSpec`` of a command's keyword arguments (other keys are ignored, so a
    command can pass its whole ``**kwargs``). A ``--cost-profile`` supplies the cost fields
    that were left at their defaults. Invalid values raise ValueError."""
    given = {k: v for k, v in kwargs.items() if k in SPEC_FIELDS}
    profile = kwargs.get("cost_profile")
    if profile:
        given = {k: v for k, v in given.items() if v != getattr(_DEFAULT, k)}
        given = expand_profile({**given, "cost_profile": profile})
    return BatchSpec(**given)


def pop_spec_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the spec flags (and ``--cost-profile``) from ``kwargs``; return those that
    were given, the profile expanded into its fields."""
    values = {k: kwargs.pop(k, None) for k in (*SPEC_FIELDS, "cost_profile")}
    return expand_profile({k: v for k, v in values.items() if v is not None})
