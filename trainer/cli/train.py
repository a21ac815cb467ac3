"""``dflash-train train``: its flags are the fields of ``trainer.options.RunOptions``."""

from __future__ import annotations

import json
from typing import Any

import click

from trainer.cli.flags import SectionedCommand, options_from
from trainer.options import RunOptions


@click.command(cls=SectionedCommand)
@options_from(RunOptions)
def train(**opts: Any) -> None:
    """Train a drafter on batches from the loader (run under torchrun for several ranks)."""
    from trainer.train import stop

    stop.install()  # before torch loads (seconds): a SIGTERM from then on stops cleanly
    from trainer.run import run_training

    summary = run_training(RunOptions(**opts))
    if summary is not None:
        click.echo(json.dumps(summary, indent=2))
