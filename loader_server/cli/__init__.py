"""``dflash-loader``: the daemon's command line.

Subcommands live next to what they drive: data commands (synth, inspect), planning commands
(buckets, plan), service commands (serve, stats). Project errors print one line and exit 1
instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from client.protocol import LoaderError
from loader_server.dataset import DatasetError

_USER_ERRORS: tuple[type[Exception], ...] = (
    DatasetError,
    LoaderError,
    ValueError,
    FileNotFoundError,
)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except _USER_ERRORS as e:
            raise click.ClickException(str(e)) from e


def setup_logging(verbose: bool = False) -> None:
    """Log to stderr; without timestamps under journald, which adds its own."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stderr, force=True
    )


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Streaming data loader for DFlash drafter training.

    Typical use: `dflash-loader synth corpus --samples 10000`, `dflash-loader inspect corpus`,
    `dflash-loader plan corpus --compare`, then `dflash-loader serve --dataset corpus`.
    """
    setup_logging(verbose)


def _register() -> None:
    # One module per area; each exports COMMANDS.
    from loader_server.cli import bench, data, plan, service

    for module in (data, plan, service, bench):
        for cmd in module.COMMANDS:
            main.add_command(cmd)


_register()
