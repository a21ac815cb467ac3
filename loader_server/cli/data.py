"""Data commands: ``synth`` writes a synthetic corpus, ``inspect`` summarizes one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from loader_server.data import report
from loader_server.data.dataset import open_dataset
from loader_server.data.synth import QWEN3_VOCAB, SynthSpec, synth_lengths, write_corpus


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--samples", "num_samples", type=int, required=True, help="Number of samples.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--median-len", type=float, default=1500.0, show_default=True)
@click.option("--sigma", type=float, default=0.8, show_default=True, help="Lognormal sigma.")
@click.option("--min-len", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=8192, show_default=True)
@click.option("--vocab-size", type=int, default=QWEN3_VOCAB, show_default=True)
@click.option(
    "--content",
    type=click.Choice(["random", "learnable"]),
    default="random",
    show_default=True,
    help="random: uniform ids (loader tests); learnable: Markov chains, harder when longer.",
)
@click.option("--shards", type=int, default=1, show_default=True, help=">1 writes a folder.")
@click.option("--stream", "stream_format", is_flag=True, help="Arrow IPC stream format.")
@click.option("--chunk-samples", type=int, default=8192, show_default=True, help="Rows/batch.")
def synth(out: Path, stream_format: bool, shards: int, **kw: object) -> None:
    """Write a synthetic corpus shaped like the reference one to OUT.

    OUT with a suffix (corpus.arrow) and --shards 1 gives one file; otherwise OUT is a
    folder of data-XXXXX-of-YYYYY.arrow shards. Lengths are lognormal, clipped; the
    loss_mask covers each sample's response part.
    """
    spec = SynthSpec(**kw)  # type: ignore[arg-type]
    total = int(synth_lengths(spec).sum(dtype=np.int64))
    bar: Any
    with click.progressbar(
        length=spec.num_samples,
        label=f"synth {total:,} tokens",
        file=sys.stderr,
    ) as bar:
        paths = write_corpus(
            out, spec, shards=shards, stream_format=stream_format, progress=bar.update
        )
    size = sum(p.stat().st_size for p in paths)
    click.echo(
        f"wrote {spec.num_samples:,} samples, {total:,} tokens, {size / 2**20:.1f} MiB to {out}"
    )


@click.command()
@click.argument("dataset", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG.")
@click.option("--vocab-size", type=int, help="Also check every token id is in [0, vocab).")
@click.option("--bins", type=int, default=16, show_default=True, help="Histogram bins.")
def inspect(
    dataset: Path, as_json: bool, plot: Path | None, vocab_size: int | None, bins: int
) -> None:
    """Summarize DATASET: samples, tokens, length percentiles, a length histogram."""
    ds = open_dataset(dataset, vocab_size=vocab_size, check_values=vocab_size is not None)
    summary = report.length_summary(ds.lengths)
    summary.update(
        path=str(dataset),
        shards=len(ds.paths),
        has_loss_mask=ds.has_loss_mask,
        fingerprint=ds.fingerprint,
    )
    if plot is not None:
        report.plot_length_histogram(ds.lengths, plot, title=str(dataset))
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"{dataset}: {len(ds.paths)} shard(s), fingerprint {ds.fingerprint}")
    click.echo(f"loss_mask: {'yes' if ds.has_loss_mask else 'no (all tokens supervised)'}")
    click.echo(report.format_summary(summary))
    click.echo(report.text_histogram(ds.lengths, bins))
    if plot is not None:
        click.echo(f"plot: {plot}")


COMMANDS = [synth, inspect]
