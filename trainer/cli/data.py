"""``dflash-train tokenize`` and ``dflash-train regen``: conversations and corpora in, a
loader corpus out. Flags come from ``TokenizeOptions``, ``ServerRegenSpec``,
``RegenOptions`` and ``TargetOptions`` (``trainer.options``, ``trainer.data.server.spec``)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from trainer.cli.flags import SectionedCommand, SectionedOption, options_from
from trainer.data.server.spec import SERVER, ServerRegenSpec
from trainer.options import IN_PROCESS, TARGET, RegenOptions, TargetOptions, TokenizeOptions

_NO_PROGRESS = click.option("--no-progress", is_flag=True, help="No progress bar.")
#: regen --server's exit status when some rows failed (the corpus holds the others).
EXIT_ROWS_FAILED = 3


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command as Ctrl-C does: an exception in the main thread,
    so every cleanup runs (the output's private folder is removed, the tokenizer pool
    stopped, the regen journal closed) before it exits 128 + the signal's number with one
    line. A second signal during that cleanup is ignored; a signal already ignored (``nohup``)
    stays so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if caught:
            return
        caught.append(signum)
        raise SystemExit(128 + signum)

    # A signal ignored on purpose (nohup ignores SIGHUP) stays ignored.
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL]
    old = {sig: signal.signal(sig, handler) for sig in mine}
    try:
        yield
    except SystemExit:
        if caught:
            click.echo(f"Error: stopped by {signal.Signals(caught[0]).name}", err=True)
        raise
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


@click.command(cls=SectionedCommand)
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
@options_from(
    TokenizeOptions,
    defaults={"workers": None},
    help={"workers": "Tokenizer processes [the CPUs available]."},
)
@click.option("--force", is_flag=True, help="Replace an existing non-empty OUT.")
@_NO_PROGRESS
def tokenize(src: tuple[Path, ...], out: Path, **opts: Any) -> None:
    """Tokenize chat conversations into a loader corpus OUT.

    SRC: JSONL, JSON, Parquet, datasets save_to_disk folders or folders of them; ShareGPT or
    OpenAI rows. OUT: Arrow shards (input_ids, loss_mask 1 on the assistant replies),
    tokenize_report.json and, with --holdout, heldout.jsonl. Exit status: 0 done (malformed
    rows counted and skipped); 1 an error (one line; OUT untouched); 128+N stopped by
    signal N (OUT untouched)."""
    from trainer.data.tokenize import summary_lines, tokenize_corpus

    if opts["workers"] is None:  # 0 is an error (TokenizeOptions), never "all CPUs"
        opts["workers"] = len(os.sched_getaffinity(0))
    with stop_signals_raise():
        report = tokenize_corpus(
            list(src),
            out,
            tokenizer=opts["tokenizer"],
            enable_thinking=opts["thinking"],
            options=TokenizeOptions.pick(opts),
            progress=not opts["no_progress"],
            force=opts["force"],
        )
    for line in summary_lines(report):
        click.echo(line, err=True)
    keys = ("out", "conversations", "tokens", "supervised_tokens", "heldout_prompts")
    click.echo(json.dumps({k: report[k] for k in keys}))


#: regen's flags that belong to one mode (by the --help section they are listed in).
_SERVER_TOKENIZE = ("max_length", "overflow", "workers", "strict")


@click.command(cls=SectionedCommand)
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@options_from(RegenOptions, only=("holdout",), defaults={"holdout": 32})
@click.option(
    "--force",
    is_flag=True,
    help="In process: replace an existing OUT (and held-out file). --server replaces only "
    "an OUT it wrote (its journal is beside it).",
    cls=SectionedOption,
)
@_NO_PROGRESS
@options_from(ServerRegenSpec, defaults={"url": None, "tokenizer": None})
@options_from(TokenizeOptions, only=_SERVER_TOKENIZE, section=SERVER)
@options_from(RegenOptions, only=("batch_size", "limit"))
@click.option(
    "--holdout-out",
    type=click.Path(path_type=Path),
    help="Held-out prompts JSONL [OUT with suffix .heldout.jsonl]; --server writes "
    "OUT/heldout.jsonl.",
    cls=SectionedOption,
    section=IN_PROCESS,
)
@click.option(
    "--device",
    default=None,
    help="Torch device [cuda when present, else cpu].",
    cls=SectionedOption,
    section=IN_PROCESS,
)
@options_from(TargetOptions)
@click.pass_context
def regen(ctx: click.Context, src: tuple[Path, ...], out: Path, **opts: Any) -> None:
    """Rewrite responses with the target's own output, in one of two modes.

    \b
    Through a server (--server URL --tokenizer DIR): SRC... are conversations (JSONL,
      JSON, Parquet, datasets folders, ShareGPT or OpenAI rows); every assistant turn is
      regenerated by the server, then the conversations are tokenized with the chat
      template into the corpus folder OUT (held-out prompts: OUT/heldout.jsonl).
      Resumable: finished rows are journaled in OUT.regen.jsonl and a rerun of the same
      command skips them and retries the failed ones; a rerun refuses inputs that
      changed since the journal was written (--restart discards it and starts over).
    In process (no --server): SRC is ONE tokenized Arrow corpus; the target (--target)
      runs here through Transformers and rewrites each sample's response greedily; OUT is
      an Arrow file.

    \b
    Exit status: 0 done; 1 an error (one line; OUT untouched); 3 (--server) some rows
      failed: OUT holds the others, the summary is printed and its last line says how
      many failed and the first failure; 128+N stopped by signal N (OUT untouched).
    """
    given = {k for k in opts if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}
    sections = {p.name: getattr(p, "section", "") for p in ctx.command.params}
    check_regen_mode(list(src), opts, given, sections)
    with stop_signals_raise():
        if opts["url"]:
            _regen_server(ctx, list(src), out, opts)
        else:
            _regen_in_process(src[0], out, opts)


def _regen_server(ctx: click.Context, src: list[Path], out: Path, opts: dict[str, Any]) -> None:
    from trainer.data.server.run import RunCounts, failure_line, regen_from_server

    tokenize = TokenizeOptions(**{k: opts[k] for k in (*_SERVER_TOKENIZE, "holdout")})
    server = ServerRegenSpec.pick({**opts, "tokenize": tokenize})
    summary = regen_from_server(src, out, server, progress=not opts["no_progress"])
    click.echo(json.dumps(summary))
    if summary["failed"]:
        counts = RunCounts(first_failed=summary["first_failed"])
        counts.failed.update(summary["failed_by_reason"])
        click.echo(
            f"regen: {failure_line(counts, summary['rows'] - summary['holdout'])}; "
            f"{out} holds the {summary['corpus']['conversations']} conversations that did "
            "not; rerun the same command to retry the failed rows",
            err=True,
        )
        ctx.exit(EXIT_ROWS_FAILED)


def _regen_in_process(src: Path, out: Path, opts: dict[str, Any]) -> None:
    holdout_out = opts["holdout_out"] or out.with_suffix(".heldout.jsonl")
    import torch

    from trainer.data.regen import regen_corpus
    from trainer.model.target import target_from_options

    device = opts["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    target = target_from_options(TargetOptions.pick(opts), device)
    spec = RegenOptions.pick(opts)
    result = regen_corpus(
        target, src, out, spec, holdout_out=holdout_out, progress=not opts["no_progress"],
        force=opts["force"],
    )  # fmt: skip
    if spec.holdout:
        result["holdout_prompts"] = str(holdout_out)
    click.echo(json.dumps(result))


CONVERSATION_SUFFIXES = frozenset({".jsonl", ".json", ".parquet"})
ARROW_SUFFIXES = frozenset({".arrow", ".ipc", ".feather"})


def _flags(names: set[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in sorted(names))


def _arrow_columns(path: Path) -> set[str] | None:
    """Column names of an Arrow file (or a folder's first Arrow shard); None if none."""
    import pyarrow as pa

    path = Path(path)
    shards = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    shards = [p for p in shards if p.suffix in ARROW_SUFFIXES]
    if not shards:
        return None
    for opener in (pa.ipc.open_file, pa.ipc.open_stream):
        try:
            with pa.memory_map(str(shards[0])) as src:
                return set(opener(src).schema.names)
        except (pa.ArrowInvalid, OSError):
            continue
    return None


def check_regen_mode(
    src: list[Path], opts: dict[str, Any], given: set[str], sections: dict[str, str]
) -> None:
    """One-line errors where the two regen modes' inputs differ (a flag's mode is the
    ``--help`` section it is listed in)."""
    in_process = {k for k, s in sections.items() if s in (IN_PROCESS, TARGET)}
    server = {k for k, s in sections.items() if s == SERVER and k != "url"}
    if opts.get("url"):
        wrong = given & in_process
        if wrong:
            raise ValueError(
                f"{_flags(wrong)}: in-process regen only (an Arrow SRC and the "
                "target run here); with --server the server's model generates"
            )
        if not opts.get("tokenizer"):
            raise ValueError(
                "--server needs --tokenizer DIR: the target's tokenizer folder, "
                "whose chat template tokenizes the regenerated conversations"
            )
        for s in src:
            if "input_ids" in (_arrow_columns(s) or ()):
                raise ValueError(
                    f"SRC {s} is a tokenized corpus (input_ids): --server takes "
                    "conversations (JSONL, JSON, Parquet, a datasets folder); "
                    "regenerate a tokenized corpus in process (without --server)"
                )
        return
    wrong = given & server
    if wrong:
        raise ValueError(
            f"{_flags(wrong)}: need --server URL (regenerating conversations "
            "through an inference server)"
        )
    if len(src) != 1:
        raise ValueError(
            f"in-process regen takes one tokenized Arrow corpus SRC, got {len(src)}; "
            "conversation files go through --server URL --tokenizer DIR"
        )
    cols = _arrow_columns(src[0]) if src[0].suffix not in CONVERSATION_SUFFIXES else None
    if cols is None or "input_ids" not in cols:
        raise ValueError(
            f"SRC {src[0]}: in-process regen reads a tokenized Arrow corpus "
            "(input_ids, loss_mask); conversations (JSONL, JSON, Parquet) are "
            "regenerated with --server URL --tokenizer DIR"
        )
