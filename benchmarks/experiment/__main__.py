"""``python -m benchmarks.experiment OUT_DIR``: the batching experiment (docs/EXPERIMENT.md).
Its flags are made from the options' fields (``benchmarks.experiment.config``)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click

from benchmarks.experiment.config import ExperimentConfig
from benchmarks.experiment.report import looping_line
from benchmarks.experiment.run import SetupError, run_experiment
from trainer.cli.flags import SectionedCommand, options_from


@click.command(cls=SectionedCommand)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@options_from(ExperimentConfig)
def experiment(out_dir: Path, **opts: Any) -> None:
    """Batching experiment: train a drafter under each loader spec (sorted, six hand-set
    buckets, optimal buckets shuffled or stratified, ours packed, sorted with the batch
    order frozen too) and compare them, paired by seed against the old padded default; write
    OUT_DIR/results.json, results.md and PNG plots (docs/EXPERIMENT.md)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # SIGTERM/SIGHUP end the experiment as Ctrl-C does: through the finally blocks that stop
    # the trainers (they checkpoint), the loader daemon and any vLLM server.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        cfg = ExperimentConfig(out_dir=out_dir, **opts)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        results = run_experiment(cfg)
    except SetupError as e:  # refused before anything ran: a message, not a traceback
        raise click.ClickException(str(e)) from e
    if cfg.data_only:
        click.echo(f"data made in {results['elapsed_s']:.0f} s: {results['train']} (training), "
                   f"{results['heldout']} (held out)")  # fmt: skip
        if "looping" in results:
            loops = results["looping"]
            click.echo(looping_line(loops["target"], loops["reference"], loops["by_kind"]))
        return
    click.echo(Path(out_dir, "results.md").read_text())
    click.echo(f"took {results['elapsed_s']:.0f} s; files:")
    for path in results["files"]:
        click.echo(f"  {path}")


if __name__ == "__main__":
    experiment()
