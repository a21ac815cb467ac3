"""``python benchmarks/bench_loader.py DATASET``: the service against a DataLoader and the
sort-once pipeline, in one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loader_bench.run import format_report, plot_report, run_bench  # noqa: E402
from loader_server.cli.spec_flags import spec_from_options, spec_options  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("dataset", type=click.Path(exists=True, path_type=Path))
@click.option("--seconds", type=float, default=5.0, show_default=True, help="Per measurement.")
@click.option("--consumers", type=int, default=2, show_default=True, help="Trainer ranks.")
@click.option(
    "--warmup",
    type=float,
    default=0.0,
    show_default=True,
    help="Seconds every throughput consumer reads before measuring (0: from a cold daemon, "
    "which on a corpus new to it includes mapping its pages).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG.")
@spec_options
def bench(
    dataset: Path,
    seconds: float,
    consumers: int,
    warmup: float,
    as_json: bool,
    plot: Path | None,
    **kw: Any,
) -> None:
    """Measure the service on DATASET side by side with its baselines, in one run.

    Starts a daemon, runs CONSUMERS client processes (ranks of one job, every batch
    touched), then a torch DataLoader (2 workers, pyarrow reads, pad-collate) over the same
    micro-batches, then the sort-once pipeline's restart (load the corpus into memory).
    Prints tokens/s, the ratio to single-core memcpy, padding efficiency, composition
    repeat, first-batch latency after a trainer restart, next() latency and RSS.
    """
    report = run_bench(
        dataset, spec_from_options(**kw), seconds=seconds, consumers=consumers, warmup=warmup
    )
    if plot is not None:
        plot_report(report, plot)
    if as_json:
        report.pop("next_ms_samples", None)
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))


if __name__ == "__main__":
    bench()
