"""``dflash-train``: train a DFlash drafter from the loader daemon, regenerate data, plot.

Typical use (tiny CPU setup)::

    dflash-loader synth corpus.arrow --samples 4000 --content learnable --vocab-size 512 \\
        --median-len 160 --max-len 512
    dflash-train regen corpus.arrow regen.arrow --target tiny --holdout 32
    dflash-loader serve --dataset regen.arrow --endpoint ipc:///tmp/loader.sock &
    torchrun --nproc-per-node 2 -m trainer.cli train --endpoint ipc:///tmp/loader.sock \\
        --target tiny --run-dir runs/tiny --steps 200 --eval-prompts regen.heldout.jsonl
    dflash-train plot runs/tiny
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

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


def _target_options(f):
    f = click.option(
        "--target",
        default="tiny",
        show_default=True,
        help="'tiny' (seeded random Qwen3) or a local Hugging Face model directory.",
    )(f)
    f = click.option("--tiny-vocab", type=int, default=512, show_default=True)(f)
    f = click.option("--tiny-layers", type=int, default=4, show_default=True)(f)
    f = click.option("--tiny-hidden", type=int, default=128, show_default=True)(f)
    f = click.option("--tiny-seed", type=int, default=0, show_default=True)(f)
    f = click.option("--tiny-heads", type=int, default=4, show_default=True)(f)
    f = click.option("--tiny-kv-heads", type=int, default=2, show_default=True)(f)
    f = click.option(
        "--tiny-intermediate", type=int, help="MLP width of the tiny target [3 x hidden]."
    )(f)
    return f


@main.command()
@click.option(
    "--endpoint", required=True, help="Loader endpoint, e.g. ipc:///run/dflash-loader/loader.sock."
)
@click.option("--job", default="train", show_default=True, help="Job name (a session per rank).")
@_target_options
@click.option("--layers", help="Target layer ids for the features, e.g. 0,1,2 (default: spread).")
@click.option("--drafter-layers", type=int, default=1, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--num-anchors", type=int, default=512, show_default=True, help="Per document.")
@click.option(
    "--max-anchors",
    type=int,
    default=2048,
    show_default=True,
    help="Anchors (blocks) per micro-batch, drawn fairly across its documents; 0: no cap. "
    "Compute and activation memory follow it (the reference recipe: 4 x 512 per GPU).",
)
@click.option(
    "--loss-chunk",
    type=int,
    default=1024,
    show_default=True,
    help="Supervised slots per LM-head chunk (and chunk/block-size blocks per drafter "
    "chunk): logits exist for this many slots at once. 0: unchunked (reference; memory "
    "grows with anchors).",
)
@click.option(
    "--attention",
    type=click.Choice(["auto", "sdpa", "flex"]),
    default="auto",
    show_default=True,
    help="Drafter attention kernel; auto: flex_attention on CUDA, SDPA elsewhere.",
)
@click.option(
    "--mask-token-id",
    type=int,
    help="Token id whose frozen target embedding is the MASK slot (default: the target's "
    "mask token from its config or tokenizer, e.g. Qwen3's <|MASK|> 151669).",
)
@click.option(
    "--learned-mask",
    is_flag=True,
    help="Train a MASK vector instead (NOT loadable by SGLang/vLLM/Transformers DFlash).",
)
@click.option("--gamma", type=float, default=7.0, show_default=True, help="Loss decay.")
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option("--warmup", type=float, default=0.04, show_default=True, help="<1: fraction.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--steps", type=int, help="Optimizer steps (or --epochs).")
@click.option("--epochs", type=int, help="Epochs of the loader's plan (or --steps).")
@click.option(
    "--grad-accum", type=int, help="Micro-batches per optimizer step [default: the daemon's]."
)
@click.option("--token-budget", type=int, help="Padded tokens per micro-batch [daemon's].")
@click.option("--max-batch-size", type=int, help="Rows per micro-batch [daemon's].")
@click.option("--max-seq-len", type=int, help="Longer samples are cut or dropped [daemon's].")
@click.option(
    "--layout", type=click.Choice(["padded", "packed"]), help="Micro-batch layout [daemon's]."
)
@click.option(
    "--spec",
    "spec_pairs",
    multiple=True,
    help="Other loader spec fields KEY=VALUE (JSON values), e.g. seed=3 or "
    "buckets=[770,1216]. Fields not given come from the daemon's configured spec.",
)
@click.option("--run-dir", type=click.Path(path_type=Path), required=True)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint, if any.")
@click.option("--eval-every", type=int, default=0, show_default=True, help="0: start and end.")
@click.option("--eval-prompts", type=click.Path(exists=True, path_type=Path), help="JSONL.")
@click.option("--num-eval-prompts", type=int, default=16, show_default=True)
@click.option("--eval-new-tokens", type=int, default=64, show_default=True)
@click.option("--ckpt-every", type=int, default=0, show_default=True, help="0: at the end.")
@click.option("--keep-checkpoints", type=int, default=3, show_default=True)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Trainer seed (init, anchors); the loader's plan seed is the daemon's or --spec seed=N.",
)
@click.option("--timeout-s", type=float, default=60.0, show_default=True)
@click.option("--device", help="Default: cuda:LOCAL_RANK when a GPU is present, else cpu.")
@click.option("--no-progress", is_flag=True)
def train(**opts: Any) -> None:
    """Train a drafter on batches from the loader (run under torchrun for several ranks)."""
    from trainer.run import run_training

    summary = run_training(opts)
    if summary is not None:
        click.echo(json.dumps(summary, indent=2))


@main.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@_target_options
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--holdout", type=int, default=32, show_default=True, help="Samples kept out.")
@click.option(
    "--holdout-out",
    type=click.Path(path_type=Path),
    help="Held-out prompts JSONL (default: OUT with suffix .heldout.jsonl).",
)
@click.option("--limit", type=int, help="Regenerate only the first N samples.")
@click.option("--device", default=None)
@click.option("--no-progress", is_flag=True)
def regen(src: Path, out: Path, **opts: Any) -> None:
    """Rewrite the response part of each sample of SRC with the target's greedy output."""
    import torch

    from trainer.regen import RegenSpec, regen_corpus
    from trainer.run import target_from_opts

    device = opts["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    target = target_from_opts(opts, device)
    holdout_out = opts["holdout_out"] or out.with_suffix(".heldout.jsonl")
    spec = RegenSpec(batch_size=opts["batch_size"], holdout=opts["holdout"], limit=opts["limit"])
    result = regen_corpus(
        target, src, out, spec, holdout_out=holdout_out, progress=not opts["no_progress"]
    )
    if spec.holdout:
        result["holdout_prompts"] = str(holdout_out)
    click.echo(json.dumps(result))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Default: RUN_DIR/plots.")
def plot(run_dir: Path, out: Path | None) -> None:
    """Write PNG curves (loss, tau, throughput and data wait, accuracy by offset)."""
    from trainer.plot import plot_run

    for path in plot_run(run_dir, out):
        click.echo(str(path))


@main.command("save-target")
@click.argument("out", type=click.Path(path_type=Path))
@_target_options
def save_target(out: Path, **opts: Any) -> None:
    """Save the (tiny) target as a Hugging Face model directory, for --target PATH."""
    from trainer.run import target_from_opts

    target = target_from_opts(opts, "cpu")
    target.model.save_pretrained(out)
    click.echo(str(out))


def _int_tuple(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from e


@main.command()
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
@click.option("--num-anchors", type=int, default=8, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--eval-anchors", type=int, default=32, show_default=True, help="Held-out.")
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads.")
@click.option("--burn-in", type=float, default=0.1, show_default=True, help="Steps skipped.")
def experiment(out_dir: Path, **opts: Any) -> None:
    """Batching experiment: train the tiny setup under sorted, bucketed+shuffled and
    bucketed+stratified specs; write OUT_DIR/results.json, results.md and PNG plots."""
    from trainer.experiment import ExperimentConfig, run_experiment

    results = run_experiment(ExperimentConfig(out_dir=out_dir, **opts))
    click.echo(Path(out_dir, "results.md").read_text())
    click.echo(f"took {results['elapsed_s']:.0f} s; files:")
    for path in results["files"]:
        click.echo(f"  {path}")


if __name__ == "__main__":
    main()
