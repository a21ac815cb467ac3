"""``dflash-loader``: the daemon's command line.

Subcommands live next to what they drive: data commands (synth, inspect), planning commands
(buckets, plan), service commands (serve, stats). Every error prints one line naming the
offending value and exits non-zero: user mistakes (bad values, paths, corpora, endpoints)
as themselves, anything unexpected with its type and a hint; ``--debug`` (or
``DFLASH_LOADER_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys

import click
import zmq

from loader_server.data.dataset import DatasetError
from loader_server.wire.protocol import LoaderError

_USER_ERRORS: tuple[type[Exception], ...] = (
    DatasetError,
    LoaderError,
    ValueError,
    OSError,
    zmq.ZMQError,
)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        debug = ctx.params.get("debug") or os.environ.get("DFLASH_LOADER_DEBUG") == "1"
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except _USER_ERRORS as e:
            if debug:
                raise
            raise click.ClickException(one_line(e)) from e
        except Exception as e:
            if debug:
                raise
            raise click.ClickException(
                f"{type(e).__name__}: {one_line(e)} (--debug shows where)"
            ) from e


def one_line(e: BaseException) -> str:
    """An exception's message on one line (pyarrow and zmq messages may span several)."""
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text or type(e).__name__


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
@click.option("--debug", is_flag=True, help="Show an error's traceback (and debug logging).")
def main(verbose: bool, debug: bool) -> None:
    """Streaming data loader for DFlash drafter training.

    Typical use: `dflash-loader synth corpus --samples 10000`, `dflash-loader inspect corpus`,
    `dflash-loader plan corpus --compare`, then `dflash-loader serve --dataset corpus`.
    """
    setup_logging(verbose or debug)


def _register() -> None:
    # One module per area; each exports COMMANDS.
    from loader_server.cli import data, plan, service

    for module in (data, plan, service):
        for cmd in module.COMMANDS:
            main.add_command(cmd)


_register()
