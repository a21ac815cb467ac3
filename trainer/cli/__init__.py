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

from trainer.cli import data, tools, train

log = logging.getLogger("trainer")


class _Group(click.Group):
    """User errors print one line (and exit 1) instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """DFlash drafter training fed by the dflash-loader daemon."""
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
