"""The tools around a run: ``export`` (a checkpoint -> a served drafter folder),
``save-target`` (the tiny target as a model folder), ``calibrate`` (the cost model fitted to
a run's timings, no torch) and ``plot``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from trainer.cli.flags import options_from
from trainer.options import TargetOptions


@click.command()
@click.argument(
    "run_dirs", metavar="RUN_DIR...", nargs=-1, required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)  # fmt: skip
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path),
    help="[the first RUN_DIR's cost_profile.json]",
)  # fmt: skip
@click.option(
    "--holdout", type=float, default=0.2, show_default=True, help="Share of micro-batches held out."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Of the hold-out split.")
@click.option("--no-plot", is_flag=True, help="Skip RUN_DIR/cost_fit.png.")
def calibrate(
    run_dirs: tuple[Path, ...], out: Path | None, holdout: float, seed: int, no_plot: bool
) -> None:
    """Fit the planner's cost model to the micro-batch times training runs recorded.

    Reads each RUN_DIR/costs/rank*.jsonl (written by `train`, see --cost-samples), fits
    c0 + c_tok*tokens + c_attn*sum L^2 + c_slot*block slots by non-negative least squares
    on relative error, reports the error on held-out micro-batches (per layout too), and
    writes a cost profile for `dflash-loader serve --cost-profile` / `train --cost-profile`.
    Calibrate on runs of the layout you train (packed rows and padded ones run different
    attention kernels); several RUN_DIRs are fitted together.
    """
    from trainer.ops.calibrate import calibrate_run

    report = calibrate_run(run_dirs, out=out, holdout=holdout, seed=seed, plot=not no_plot)
    click.echo(report.summary())


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Default: RUN_DIR/plots.")
def plot(run_dir: Path, out: Path | None) -> None:
    """Write PNG curves (loss, tau, throughput and data wait, accuracy by offset)."""
    from trainer.ops.plot import plot_run

    for path in plot_run(run_dir, out):
        click.echo(str(path))


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--step", type=int, help="Checkpoint step [the newest].")
@click.option(
    "--best", metavar="SET",
    help="The kept checkpoint with the highest tau/SET in RUN_DIR/metrics.jsonl (a set of "
    "train --eval-sets; ties: the later step). Excludes --step.",
)  # fmt: skip
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option(
    "--format", "fmt", type=click.Choice(["dflash", "speculators"]), default="dflash",
    show_default=True,
    help="Config dialect: dflash (z-lab's DFlashDraftModel / DFlash2DraftModel folder: "
    "SGLang, vLLM, Transformers) or speculators (vllm-project/speculators' checkpoint "
    "layout; vLLM reads it too). Same weights either way.",
)  # fmt: skip
def export(
    run_dir: Path, out: Path, step: int | None, best: str | None, dtype: str, force: bool,
    fmt: str,
) -> None:  # fmt: skip
    """Write RUN_DIR's drafter as a Hugging Face folder OUT that SGLang, vLLM and
    Transformers load (DFlashDraftModel, or DFlash2DraftModel for a --drafter dflash2 run),
    or in speculators' layout (--format speculators)."""
    if best is not None and step is not None:
        raise click.UsageError("--best and --step exclude each other")
    from trainer.hf.export import export_drafter

    path = export_drafter(run_dir, out, step=step, best=best, dtype=dtype, force=force, fmt=fmt)
    click.echo(str(path))


@click.command("save-target")
@click.argument("out", type=click.Path(path_type=Path))
@options_from(TargetOptions)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Tokenizer folder saved next to the weights; its EOS, PAD and <|MASK|> ids go into "
    "the model's config (its vocabulary must fit --tiny-vocab).",
)
@click.option("--force", is_flag=True, help="Replace an existing non-empty OUT.")
def save_target(out: Path, tokenizer: Path | None, force: bool, **opts: Any) -> None:
    """Save the (tiny) target as a Hugging Face model directory, for --target PATH."""
    from trainer.files import atomic_output
    from trainer.model.target import adopt_tokenizer, target_from_options

    inputs = [tokenizer] if tokenizer is not None else []
    with atomic_output(out, folder=True, force=force, inputs=inputs) as tmp:
        target = target_from_options(TargetOptions.pick(opts), "cpu")
        if tokenizer is not None:
            adopt_tokenizer(target.model, tokenizer).save_pretrained(tmp)
        target.model.save_pretrained(tmp)
    click.echo(str(out))


@click.command("engine-command")
@click.argument("target", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--layers", help="The run's --layers [the default spread of the target's].")
@click.option(
    "--states-transport", type=click.Choice(["shm", "files", "mooncake"]), default="shm",
    show_default=True,
    help="How the states travel: shm (the trainers' arenas, on the server's machine), files "
    "(one per document, in a folder the trainers see), mooncake (a Mooncake store: "
    "trainers on other machines; the master's command is printed too).",
)  # fmt: skip
@click.option(
    "--states-dir", type=click.Path(path_type=Path), default=Path("/dev/shm/dflash-states"),
    show_default=True,
    help="The server's folder for the states (the trainers' arenas, or the files): on the "
    "trainers' machine in /dev/shm, or a shared mount; trainers give it as --engine-dir.",
)  # fmt: skip
@click.option("--host", default=None, help="This machine as the trainers reach it [its name].")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--mooncake-port", type=int, default=50051, show_default=True,
              help="The Mooncake master's RPC port.")  # fmt: skip
@click.option("--mooncake-metadata-port", type=int, default=8080, show_default=True,
              help="The master's HTTP metadata server's port.")  # fmt: skip
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True)
@click.option("--max-model-len", type=int, help="The loader's --max-seq-len + 1 at least.")
def engine_command(
    target: Path, layers: str | None, states_transport: str, states_dir: Path,
    host: str | None, port: int, mooncake_port: int, mooncake_metadata_port: int,
    tensor_parallel_size: int, max_model_len: int | None,
) -> None:  # fmt: skip
    """Print the commands of the server that computes TARGET's hidden states (and, with
    --states-transport mooncake, of the store's master), and the flags each trainer adds
    (`train --target-engine vllm --engine-url http://HOST:PORT ...`): the layer ids, the
    extraction method, the connector, prefix caching off."""
    import json as json_
    import socket

    from trainer.engine.supply import connector_config
    from trainer.engine.vllm import VllmAdapter
    from trainer.model.target import default_layer_ids
    from trainer.option_values import parse_int_list

    config = target / "config.json"
    if not config.is_file():
        raise click.UsageError(f"{target} has no config.json: give a model folder")
    num_layers = int(json_.loads(config.read_text())["num_hidden_layers"])
    ids = parse_int_list(layers) or default_layer_ids(num_layers)
    engine = VllmAdapter()
    try:
        engine_ids = engine.layers(ids, num_layers).engine_ids
    except ValueError as e:
        raise click.UsageError(f"--layers: {e}") from None
    store: dict[str, str] = {}
    name = host or socket.gethostname()
    if states_transport == "mooncake":
        from trainer.engine.mooncake import master_command, metadata_url

        master = f"{name}:{mooncake_port}"
        store = {"master": master, "metadata": metadata_url(master, mooncake_metadata_port),
                 "local_host": name}  # fmt: skip
        click.echo("# the Mooncake master (its own HTTP metadata server, no etcd):")
        click.echo(" ".join(master_command(mooncake_port, mooncake_metadata_port)))
        click.echo("# the vLLM server:")
    connector = connector_config(states_dir, **store)
    serve = engine.serve_command(target.resolve(), engine_ids, connector, port=port,
                                 tensor_parallel_size=tensor_parallel_size,
                                 max_model_len=max_model_len)  # fmt: skip
    click.echo(serve)
    if states_transport == "mooncake":
        click.echo("# each trainer, on any machine:")
        click.echo(f"dflash-train train ... --target-engine vllm --engine-url http://{name}:{port} "
                   f"--states-transport mooncake --mooncake-master {store['master']}")  # fmt: skip


COMMANDS = (calibrate, plot, export, save_target, engine_command)
