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
@click.option(
    "--drafter-layers", type=int, help="Drafter decoder layers [1; --init-drafter: its own]."
)
@click.option("--block-size", type=int, help="Block size [16; --init-drafter: its own].")
@click.option(
    "--init-drafter",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Start from a DFlash drafter folder (an export, or a released one): its weights, "
    "and its layer ids, depth, block size and MASK token where not given. A checkpoint "
    "found by --resume wins.",
)
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
@click.option(
    "--cost-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Ask the loader to cut and balance micro-batches by this cost profile (from "
    "`dflash-train calibrate`); --spec fields given too win.",
)
@click.option(
    "--cost-samples",
    type=int,
    default=2000,
    show_default=True,
    help="Micro-batches per rank whose compute time is recorded in RUN_DIR/costs for "
    "`dflash-train calibrate` (after 2 warm-up steps; synchronizes CUDA while recording). "
    "0: off.",
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
    from trainer import stop

    stop.install()  # before torch loads (seconds): a SIGTERM from then on stops cleanly
    from trainer.options import RunOptions
    from trainer.run import run_training

    summary = run_training(RunOptions(**opts))
    if summary is not None:
        click.echo(json.dumps(summary, indent=2))


def _server_regen_options(f):
    """``regen --server``: conversations regenerated through an inference server."""
    opts = [
        click.option(
            "--server",
            metavar="URL",
            help="OpenAI-compatible server (SGLang, vLLM) serving the target, e.g. "
            "http://127.0.0.1:30000: SRC... are then conversations, OUT a corpus folder.",
        ),
        click.option(
            "--tokenizer",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help="--server: the target's tokenizer folder (its chat template tokenizes OUT).",
        ),
        click.option("--model", help="--server: served model name [the first it lists]."),
        click.option(
            "--concurrency",
            type=int,
            default=64,
            show_default=True,
            help="--server: conversations (= requests) in flight.",
        ),
        click.option(
            "--temperature",
            type=float,
            default=0.0,
            show_default=True,
            help="--server: 0 = greedy.",
        ),
        click.option(
            "--max-tokens", type=int, default=2048, show_default=True, help="--server: per reply."
        ),
        click.option(
            "--thinking/--no-thinking",
            default=False,
            show_default=True,
            help="--server: chat_template_kwargs enable_thinking, at generation and tokenization.",
        ),
        click.option(
            "--retries",
            type=int,
            default=5,
            show_default=True,
            help="--server: per request, on connection errors, 408, 429, 5xx.",
        ),
        click.option(
            "--timeout-s",
            type=float,
            default=600.0,
            show_default=True,
            help="--server: per request.",
        ),
        click.option("--max-length", type=int, help="--server: tokens per sample in OUT."),
        click.option(
            "--overflow",
            type=click.Choice(["truncate", "drop"]),
            default="truncate",
            show_default=True,
            help="--server: a sample over --max-length.",
        ),
        click.option(
            "--workers",
            type=int,
            default=1,
            show_default=True,
            help="--server: tokenizer processes.",
        ),
        click.option(
            "--strict",
            is_flag=True,
            help="--server: a failed or malformed row is an error, not a count.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@main.command()
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@_target_options
@click.option("--batch-size", type=int, default=64, show_default=True, help="In process.")
@click.option(
    "--holdout",
    type=int,
    default=32,
    show_default=True,
    help="Samples (--server: conversations) kept out; their prompts go to the verifier.",
)
@click.option(
    "--holdout-out",
    type=click.Path(path_type=Path),
    help="In process: held-out prompts JSONL [OUT with suffix .heldout.jsonl]; "
    "--server writes OUT/heldout.jsonl.",
)
@click.option("--limit", type=int, help="In process: regenerate only the first N samples.")
@click.option("--device", default=None, help="In process: torch device.")
@_server_regen_options
@click.option("--no-progress", is_flag=True)
@click.pass_context
def regen(ctx: click.Context, src: tuple[Path, ...], out: Path, **opts: Any) -> None:
    """Rewrite responses with the target's own output, in one of two modes.

    \b
    In process (no --server): SRC is ONE tokenized Arrow corpus; the target (--target)
      runs here through Transformers and rewrites each sample's response greedily; OUT is
      an Arrow file.
    Through a server (--server URL --tokenizer DIR): SRC... are conversations (JSONL,
      JSON, Parquet, datasets folders, ShareGPT or OpenAI rows); every assistant turn is
      regenerated by the server, then the conversations are tokenized with the chat
      template into the corpus folder OUT (held-out prompts: OUT/heldout.jsonl).
      Resumable: finished rows are journaled in OUT.regen.jsonl and a rerun of the same
      command skips them.
    """
    from click.core import ParameterSource

    from trainer.regen_server import check_regen_mode

    given = {k for k in opts if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
    check_regen_mode(list(src), opts, given)
    if opts["server"]:
        from trainer.regen_server import regen_command

        click.echo(json.dumps(regen_command(list(src), out, opts)))
        return
    holdout_out = opts["holdout_out"] or out.with_suffix(".heldout.jsonl")
    import torch

    from trainer.options import TargetOptions
    from trainer.regen import RegenSpec, regen_corpus
    from trainer.run import target_from_opts

    device = opts["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    target = target_from_opts(TargetOptions.pick(opts), device)
    spec = RegenSpec(batch_size=opts["batch_size"], holdout=opts["holdout"], limit=opts["limit"])
    result = regen_corpus(
        target, src[0], out, spec, holdout_out=holdout_out, progress=not opts["no_progress"]
    )
    if spec.holdout:
        result["holdout_prompts"] = str(holdout_out)
    click.echo(json.dumps(result))


@main.command()
@click.argument("src", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--tokenizer",
    required=True,
    help="Tokenizer folder (or Hub id) whose chat template renders the conversations.",
)
@click.option(
    "--thinking/--no-thinking",
    default=None,
    help="enable_thinking for templates that take it (Qwen3) [not passed].",
)
@click.option("--max-length", type=int, help="Longest sample in tokens (see --overflow).")
@click.option(
    "--overflow",
    type=click.Choice(["truncate", "drop"]),
    default="truncate",
    show_default=True,
    help="What --max-length does to a longer conversation.",
)
@click.option("--workers", type=int, help="Tokenizer processes [the CPUs available].")
@click.option("--shard-rows", type=int, default=100_000, show_default=True)
@click.option("--strict", is_flag=True, help="Stop at the first malformed row (default: skip).")
@click.option(
    "--holdout",
    type=int,
    default=0,
    show_default=True,
    help="The last N conversations stay out; their prompts go to OUT/heldout.jsonl.",
)
@click.option("--limit", type=int, help="Read only the first N rows.")
@click.option("--force", is_flag=True, help="Replace an existing non-empty OUT.")
@click.option("--no-progress", is_flag=True)
def tokenize(src: tuple[Path, ...], out: Path, **opts: Any) -> None:
    """Tokenize chat conversations into a loader corpus OUT.

    SRC: JSONL, JSON, Parquet, datasets save_to_disk folders or folders of them; ShareGPT or
    OpenAI rows. OUT: Arrow shards (input_ids, loss_mask 1 on the assistant replies),
    tokenize_report.json and, with --holdout, heldout.jsonl."""
    from trainer.chat import summary_lines, tokenize_corpus

    report = tokenize_corpus(
        list(src),
        out,
        tokenizer=opts["tokenizer"],
        enable_thinking=opts["thinking"],
        max_length=opts["max_length"],
        overflow=opts["overflow"],
        workers=opts["workers"] or len(os.sched_getaffinity(0)),
        shard_rows=opts["shard_rows"],
        strict=opts["strict"],
        holdout=opts["holdout"],
        progress=not opts["no_progress"],
        limit=opts["limit"],
        force=opts["force"],
    )
    for line in summary_lines(report):
        click.echo(line, err=True)
    keys = ("out", "conversations", "tokens", "supervised_tokens", "heldout_prompts")
    click.echo(json.dumps({k: report[k] for k in keys}))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), help="[RUN_DIR/cost_profile.json]"
)
@click.option(
    "--holdout", type=float, default=0.2, show_default=True, help="Share of micro-batches held out."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Of the hold-out split.")
@click.option("--no-plot", is_flag=True, help="Skip RUN_DIR/cost_fit.png.")
def calibrate(run_dir: Path, out: Path | None, holdout: float, seed: int, no_plot: bool) -> None:
    """Fit the planner's cost model to the micro-batch times a training run recorded.

    Reads RUN_DIR/costs/rank*.jsonl (written by `train`, see --cost-samples), fits
    c0 + c_tok*tokens + c_attn*sum L^2 + c_slot*block slots by non-negative least squares
    on relative error, reports the error on held-out micro-batches, and writes a cost
    profile for `dflash-loader serve --cost-profile` / `train --cost-profile`.
    """
    from trainer.calibrate import calibrate_run

    report = calibrate_run(run_dir, out=out, holdout=holdout, seed=seed, plot=not no_plot)
    click.echo(report.summary())


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Default: RUN_DIR/plots.")
def plot(run_dir: Path, out: Path | None) -> None:
    """Write PNG curves (loss, tau, throughput and data wait, accuracy by offset)."""
    from trainer.plot import plot_run

    for path in plot_run(run_dir, out):
        click.echo(str(path))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--step", type=int, help="Checkpoint step [the newest].")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
def export(run_dir: Path, out: Path, step: int | None, dtype: str, force: bool) -> None:
    """Write RUN_DIR's drafter as a Hugging Face folder OUT that SGLang, vLLM and
    Transformers load (DFlashDraftModel format)."""
    from trainer.export import export_drafter

    click.echo(str(export_drafter(run_dir, out, step=step, dtype=dtype, force=force)))


@main.command("save-target")
@click.argument("out", type=click.Path(path_type=Path))
@_target_options
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Tokenizer folder saved next to the weights; its EOS, PAD and <|MASK|> ids go into "
    "the model's config (its vocabulary must fit --tiny-vocab).",
)
def save_target(out: Path, tokenizer: Path | None, **opts: Any) -> None:
    """Save the (tiny) target as a Hugging Face model directory, for --target PATH."""
    from trainer.options import TargetOptions
    from trainer.run import target_from_opts
    from trainer.target import adopt_tokenizer

    target = target_from_opts(TargetOptions.pick(opts), "cpu")
    if tokenizer is not None:
        adopt_tokenizer(target.model, tokenizer).save_pretrained(out)
    target.model.save_pretrained(out)
    click.echo(str(out))


if __name__ == "__main__":
    main()
