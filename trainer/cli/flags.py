"""Click flags made from the options dataclasses (``trainer.options``), so every option has
one source: its field's type, default, help, choices and aliases. ``SectionedCommand`` lists
a command's flags under the sections the fields name."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, TypeVar

import click

from trainer.options import flag_of

F = TypeVar("F", bound=Callable[..., Any])


class SectionedOption(click.Option):
    """A click option that knows the ``--help`` section it is listed under."""

    def __init__(self, *args: Any, section: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """``--help`` lists the options section by section, in the order they first appear."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                section = getattr(param, "section", "") or "Options"
                groups.setdefault(section, []).append(record)
        # the command's own options (no section) first, then the sections in order
        order = sorted(groups, key=lambda s: s != "Options")
        for section in order:
            records = groups[section]
            with formatter.section(section):
                formatter.write_dl(records)


def _kinds(hint: Any) -> list[Any]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return [a for a in args if a is not type(None)]


def field_option(
    f: Field[Any],
    hint: Any,
    *,
    default: Any = MISSING,
    help: str | None = None,
    section: str | None = None,
) -> Callable[[F], F]:
    """The click option of one options field (``default``, ``help`` and ``section``
    override the field's)."""
    meta = {**f.metadata}
    if help is not None:
        meta["help"] = help
    if section is not None:
        meta["section"] = section
    kind = _kinds(hint)[0]
    flag = flag_of(f)
    decls = [flag, *meta.get("aliases", ()), f.name]
    value = f.default if default is MISSING else default
    kw: dict[str, Any] = {"help": meta.get("help", ""), "section": meta.get("section", "")}
    if value is MISSING:
        kw["required"] = True
    elif kind is bool:
        kw.update(is_flag=True, default=value)
    else:
        kw["default"] = value
        kw["show_default"] = meta.get("show_default", True) and value is not None
    if kind is bool:
        pass
    elif meta.get("parse"):  # one string, read into the field's value
        kw.update(type=str, callback=_parsed(meta["parse"]))
        if isinstance(value, tuple):
            kw["default"] = ",".join(str(v) for v in value)
    elif meta.get("choices"):
        kw["type"] = click.Choice(list(meta["choices"]))
    elif kind is Path:
        kw["type"] = click.Path(path_type=Path, **(meta.get("path") or {}))
    elif typing.get_origin(kind) is tuple:
        kw.update(multiple=True, type=typing.get_args(kind)[0])
    else:
        kw["type"] = kind
    return click.option(*decls, cls=SectionedOption, **kw)


def _parsed(parse: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback: the flag's string through ``parse``, its ValueError a usage error
    naming the flag."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return callback


def options_from(
    cls: type,
    *,
    only: Iterable[str] | None = None,
    defaults: dict[str, Any] | None = None,
    help: dict[str, str] | None = None,
    section: str | None = None,
) -> Callable[[F], F]:
    """Decorator: one flag per field of the options dataclass ``cls`` (or of the fields
    named in ``only``, in that order); ``defaults`` and ``help`` override fields' defaults
    and help texts, ``section`` lists them all under another ``--help`` section."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    # fields without flag metadata (internal knobs, nested options) have no flag
    names = list(only) if only is not None else [n for n in by_name if by_name[n].metadata]
    over = defaults or {}

    def decorate(func: F) -> F:
        for name in reversed(names):
            option = field_option(
                by_name[name], hints[name], default=over.get(name, MISSING),
                help=(help or {}).get(name), section=section,
            )  # fmt: skip
            func = option(func)
        return func

    return decorate
