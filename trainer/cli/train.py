"""``dflash-train train``: its flags are the fields of ``trainer.options.RunOptions``; a
``--config`` file (``trainer.config_file``) sets any of them, the command line winning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from trainer.cli.flags import SectionedCommand, options_from
from trainer.sections import RunOptions


def _read_config(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """Eager: the file's options become the defaults of every other flag, so a flag given
    on the command line wins over the file."""
    if value is None:
        return
    from trainer.config_file import read_config

    try:
        values = read_config(value)
    except (ValueError, OSError) as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **values}


@click.command(cls=SectionedCommand)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    is_eager=True,
    expose_value=False,
    callback=_read_config,
    help="Options from a TOML file (examples/*.toml; --print-config writes one) or a run's "
    "config.json (repeats that run); flags given here win over it.",
)
@click.option(
    "--print-config",
    is_flag=True,
    expose_value=False,  # the command's parameters are RunOptions' fields, no more
    callback=lambda ctx, param, value: ctx.meta.update(print_config=value),
    help="Print the resolved options as TOML (a file --config reads back) and exit.",
)
@options_from(RunOptions)
def train(**opts: Any) -> None:
    """Train a drafter on batches from the loader (run under torchrun for several ranks)."""
    if click.get_current_context().meta.get("print_config"):
        from trainer.config_file import to_toml

        click.echo(to_toml(RunOptions(**opts)), nl=False)
        return
    from loader_server import faults
    from trainer.train import stop

    try:
        faults.check()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    stop.install()  # before torch loads (seconds): a SIGTERM from then on stops cleanly
    from trainer.run import run_training

    summary = run_training(RunOptions(**opts))
    if summary is not None:
        click.echo(json.dumps(summary, indent=2))
