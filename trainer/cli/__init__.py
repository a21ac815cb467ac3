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
``eval`` (acceptance-length tables on the public prompt sets), ``tools`` (export, save-target,
calibrate, plot). Each imports what it runs only when it
runs, so ``--help`` and the torch-free commands start fast.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from loader_server.cli.contract import OneLineGroup, setup_logging
from trainer.cli import data, tools, train
from trainer.cli.eval import eval_command


class _Group(OneLineGroup):
    """Errors keep the one-line contract of ``loader_server.cli.contract``."""

    debug_env = "DFLASH_TRAIN_DEBUG"

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """The command; a process left holding a Mooncake store whose master went away
        ends at once with its status (``trainer.engine.mooncake.abandoned``), without the
        store library's teardown at exit, which would wait on the dead master."""
        try:
            return super().main(*args, **kwargs)
        except SystemExit as e:
            mooncake = sys.modules.get("trainer.engine.mooncake")
            if mooncake is None or not mooncake.abandoned():
                raise
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.option("--debug", is_flag=True, help="Show an error's traceback (and debug logging).")
def main(verbose: bool, debug: bool) -> None:
    """DFlash drafter training fed by the dflash-loader daemon.

    Exit status: 0 done; 1 an error (one line; --debug shows the traceback); 2 a usage
    error; 130 interrupted (a command's --help lists its own).
    """
    rank = os.environ.get("RANK")
    setup_logging(verbose or debug, prefix=f"[rank {rank}] " if rank is not None else "")


for _command in (train.train, data.regen, data.tokenize, eval_command, *tools.COMMANDS):
    main.add_command(_command)
