"""``python -m benchmarks.experiment OUT_DIR``: the batching experiment (docs/EXPERIMENT.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from benchmarks.experiment.run import ExperimentConfig, run_experiment


def _int_tuple(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from e


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--samples", type=int, default=4000, show_default=True, help="Training corpus.")
@click.option("--heldout-samples", type=int, default=512, show_default=True)
@click.option("--steps", type=int, default=300, show_default=True, help="Per run.")
@click.option("--seeds", default="0", show_default=True, callback=_int_tuple, help="e.g. 0,1.")
@click.option(
    "--specs",
    default="sorted,shuffled,stratified",
    show_default=True,
    callback=lambda ctx, param, v: tuple(x.strip() for x in v.split(",") if x.strip()),
)
@click.option("--buckets", default="auto:16", show_default=True, help="shuffled, stratified.")
@click.option("--median-len", type=float, default=160.0, show_default=True)
@click.option("--sigma", type=float, default=0.8, show_default=True)
@click.option("--min-len", type=int, default=32, show_default=True)
@click.option("--max-len", type=int, default=1024, show_default=True, help="= --max-seq-len.")
@click.option("--token-budget", type=int, default=2048, show_default=True)
@click.option("--grad-accum", type=int, default=4, show_default=True)
@click.option("--block-size", type=int, default=8, show_default=True)
@click.option("--anchors-per-doc", type=int, default=8, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--eval-anchors", type=int, default=32, show_default=True, help="Held-out.")
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads.")
@click.option("--burn-in", type=float, default=0.1, show_default=True, help="Steps skipped.")
def experiment(out_dir: Path, **opts: Any) -> None:
    """Batching experiment: train the tiny setup under sorted, bucketed+shuffled and
    bucketed+stratified specs; write OUT_DIR/results.json, results.md and PNG plots."""
    results = run_experiment(ExperimentConfig(out_dir=out_dir, **opts))
    click.echo(Path(out_dir, "results.md").read_text())
    click.echo(f"took {results['elapsed_s']:.0f} s; files:")
    for path in results["files"]:
        click.echo(f"  {path}")


if __name__ == "__main__":
    experiment()
