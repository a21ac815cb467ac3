"""The batch-spec flags: one per ``BatchSpec`` field, the same names in every command.

``plan`` and ``bench`` take them with the spec's defaults (``spec_options``); ``serve``
takes them with no defaults (``spec_options(overrides_only=True)``), so only the flags a
user gives override the config file's ``[spec]`` table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

import click

from loader_server.planning.spec import (
    COMPOSITIONS,
    LAYOUTS,
    ORDERS,
    OVERLONG,
    BatchSpec,
    expand_profile,
)

F = TypeVar("F", bound=Callable[..., Any])
_DEFAULT = BatchSpec()
SPEC_FIELDS = tuple(f.name for f in fields(BatchSpec))

_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--token-budget", {"type": int, "help": "Max cost (tokens) of one micro-batch."}),
    ("--max-batch-size", {"type": int, "help": "Max rows of a padded micro-batch."}),
    ("--max-seq-len", {"type": int, "help": "Longer samples: see --overlong."}),
    ("--overlong", {"type": click.Choice(OVERLONG), "help": "Samples over --max-seq-len."}),
    ("--buckets", {"help": "auto | auto:K | bounds such as 770,1216,1728,2432,3296."}),
    ("--target-efficiency", {"type": float, "help": "What --buckets auto aims for."}),
    ("--layout", {"type": click.Choice(LAYOUTS), "help": "Padded [B, L] or packed [1, T]."}),
    (
        "--composition",
        {
            "type": click.Choice(COMPOSITIONS),
            "help": "sorted/random: baselines (frozen batches / full shuffle).",
        },
    ),
    ("--order", {"type": click.Choice(ORDERS), "help": "How steps mix buckets."}),
    ("--world-size", {"type": int, "help": "Ranks of the job."}),
    ("--grad-accum", {"type": int, "help": "Micro-batches per rank per optimizer step."}),
    ("--seed", {"type": int, "help": "With the epoch, determines the plan."}),
    ("--cost-c0", {"type": float, "help": "Cost model: fixed cost of a micro-batch."}),
    ("--cost-tok", {"type": float, "help": "Cost model: per token as laid out."}),
    ("--cost-attn", {"type": float, "help": "Cost model: per squared document length."}),
    ("--cost-slot", {"type": float, "help": "Cost model: per drafter block slot."}),
    ("--cost-budget", {"type": float, "help": "Max modelled cost of a micro-batch (0: auto)."}),
    ("--block-size", {"type": int, "help": "Trainer's block size (block slots)."}),
    ("--anchors-per-doc", {"type": int, "help": "Trainer's anchors per document, at most."}),
    ("--tokens-per-anchor", {"type": int, "help": "Trainer's tokens of a document per anchor."}),
    ("--max-anchors", {"type": int, "help": "Trainer's anchors per micro-batch (0: no cap)."}),
]
assert [n[2:].replace("-", "_") for n, _ in _FLAGS] == list(SPEC_FIELDS), "flags != BatchSpec"
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
