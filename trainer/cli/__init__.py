"""``dflash-train``: train a DFlash drafter from the loader daemon, make its data, export it.

Typical use (tiny CPU setup)::

    dflash-loader synth corpus.arrow --samples 4000 --content learnable --vocab-size 512 \\
        --median-len 160 --max-len 512
    dflash-train regen corpus.arrow regen.arrow --target tiny --holdout 32
    dflash-loader serve --dataset regen.arrow --endpoint ipc:///tmp/loader.sock &
    torchrun --nproc-per-node 2 -m trainer.cli train --endpoint ipc:///tmp/loader.sock \\
        --target tiny --run-dir runs/tiny --steps 200 --eval-prompts regen.heldout.jsonl
    dflash-train plot runs/tiny

The commands live by what they work on: ``data`` (tokenize, regen), ``train`` (train),
``tools`` (export, save-target, calibrate, plot). Each imports what it runs only when it
runs, so ``--help`` and the torch-free commands start fast.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from loader_server.data.dataset import DatasetError
from loader_server.wire.protocol import LoaderError
from trainer.cli import data, tools, train

log = logging.getLogger("trainer")

#: What a user can cause and fix: printed as one line naming the file, flag or value.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError, LoaderError, DatasetError)


class _Group(click.Group):
    """Every error prints one line and exits non-zero: user errors as themselves, anything
    unexpected with its type and a hint; ``--debug`` (or ``DFLASH_TRAIN_DEBUG=1``) shows
    the traceback instead. Ctrl-C exits 130 with one line."""

    def invoke(self, ctx: click.Context) -> object:
        debug = ctx.params.get("debug") or os.environ.get("DFLASH_TRAIN_DEBUG") == "1"
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            if debug:
                raise
            click.echo("Error: interrupted", err=True)
            ctx.exit(130)
        except USER_ERRORS as e:
            if debug:
                raise
            raise click.ClickException(one_line(e)) from e
        except Exception as e:
            if debug:
                raise
            raise click.ClickException(
                f"{type(e).__name__}: {one_line(e)} (--debug shows where)"
            ) from e
        return None


def one_line(e: BaseException) -> str:
    """An exception's message on one line, naming the file of an OS error."""
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text or type(e).__name__


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.option("--debug", is_flag=True, help="Show an error's traceback (and debug logging).")
def main(verbose: bool, debug: bool) -> None:
    """DFlash drafter training fed by the dflash-loader daemon."""
    verbose = verbose or debug
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


for _command in (train.train, data.regen, data.tokenize, *tools.COMMANDS):
    main.add_command(_command)
