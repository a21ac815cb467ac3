"""``dflash-loader``: the daemon's command group.

Subcommands live next to what they drive: data commands (synth, inspect), planning commands
(buckets, plan), service commands (serve, stats). Errors keep the one-line contract of
``loader_server.cli.contract`` (``--debug`` or ``DFLASH_LOADER_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import click

from loader_server.cli import data, plan, service
from loader_server.cli.contract import OneLineGroup, setup_logging


class _Group(OneLineGroup):
    debug_env = "DFLASH_LOADER_DEBUG"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.option("--debug", is_flag=True, help="Show an error's traceback (and debug logging).")
def main(verbose: bool, debug: bool) -> None:
    """Streaming data loader for DFlash drafter training.

    Typical use: `dflash-loader synth corpus --samples 10000`, `dflash-loader inspect corpus`,
    `dflash-loader plan corpus --compare`, then `dflash-loader serve --dataset corpus`.

    Exit status: 0 done; 1 an error (one line; --debug shows the traceback); 2 a usage
    error; 130 interrupted.
    """
    setup_logging(verbose or debug)


for _module in (data, plan, service):  # one module per area; each exports COMMANDS
    for _command in _module.COMMANDS:
        main.add_command(_command)
