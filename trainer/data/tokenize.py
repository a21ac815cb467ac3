"""``dflash-train tokenize``: chat conversations in, a loader corpus out.

Input rows are ShareGPT (``{"conversations": [{"from", "value"}]}``) or OpenAI
(``{"messages": [{"role", "content"}]}``) conversations (``trainer.data.sources``). Each is
rendered and masked by ``trainer.data.encoder.ChatEncoder``; the output is a folder of Arrow
shards with ``input_ids`` (``list<int32>``) and ``loss_mask`` (``list<uint8>``)
(``trainer.data.corpus``), which ``loader_server.data.dataset`` serves.

Tokenization itself is the fast tokenizer's batch encode (Rust). ``tokenize_corpus`` cuts the
input into chunks of bounded size (bytes of row payload, not a row count: long rows make
chunks of a few rows) and encodes them in input order, on an encode thread of this process
(``--workers 1``) or in a pool of worker processes (the tokenizer loaded once, forked into
each). The output depends only on the rows, never on the chunks or the worker count: the
shards are byte-identical for any ``--workers``. Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainer.data.corpus import HELDOUT_NAME, REPORT_NAME, HeldoutPrompt, ShardWriter, write_heldout
from trainer.data.encoder import WARNED, ChatEncoder
from trainer.data.messages import MalformedRow, as_row, prompt_messages, to_messages
from trainer.data.sources import (
    CHUNK_ROWS,
    Payload,
    Source,
    count_rows,
    expand_sources,
    input_bytes,
    payload_rows,
    read_chunks,
)
from trainer.data.token_spans import Longer
from trainer.files import atomic_output
from trainer.options import TokenizeOptions
from trainer.progress import progress_bar

log = logging.getLogger(__name__)
DEFAULT_OPTIONS = TokenizeOptions()
#: Row payload per chunk (and at most ``CHUNK_ROWS`` rows; ``chunk_bytes``). For worker
#: processes: the input's size over 16 per worker, within 64 KiB (~17K Qwen tokens, ~25 ms of
#: encode) and 1 MiB, so a few hundred long rows still make dozens of chunks for the workers
#: to share while a big input pays the ~1 ms a chunk costs (IPC, per-batch work) rarely. In
#: process 4 MiB: big batches for tokenizers' Rust thread pool to spread over the CPUs (64 KiB
#: ones, a few long rows each, took 1.2x as long).
POOL_CHUNK_BYTES, THREAD_CHUNK_BYTES = (64 << 10, 1 << 20), 4 << 20
POOL_CHUNKS_PER_WORKER = 16


def chunk_bytes(workers: int, input_bytes: int) -> int:
    """Row payload per chunk for ``workers`` and an input of ``input_bytes``."""
    if workers <= 1:
        return THREAD_CHUNK_BYTES
    lo, hi = POOL_CHUNK_BYTES
    return min(max(input_bytes // (workers * POOL_CHUNKS_PER_WORKER), lo), hi)


@dataclass
class _Result:
    """One chunk's kept rows (flat) and every row's outcome."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    outcomes: list  # per row: None (kept), "truncated" (kept) or (reason, detail)
    fallbacks: int
    notes: dict[str, int]  # the encoder's notes (unbalanced_markup...) from this chunk


_WORKER: dict[str, Any] = {}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(tokenizer: str, enable_thinking: bool | None, parent: int) -> None:
    """A pool worker's start: one process per core, so no Rust thread pool inside it; the
    encoder inherited (fork) or loaded (spawn); one encode thread (``_encode_task``)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    die_with_parent(parent)
    _WORKER["parent"] = parent
    enc = _WORKER.get("encoder")
    if enc is None or (enc.name, enc.enable_thinking) != (str(tokenizer), enable_thinking):
        WARNED.add(f"{tokenizer}: the chat template ignores enable_thinking={enable_thinking}")
        _WORKER["encoder"] = ChatEncoder(tokenizer, enable_thinking=enable_thinking)
    _WORKER["thread"] = ThreadPoolExecutor(1, thread_name_prefix="encode")


def _encode_task(payload: Payload, max_length: int | None, overflow: str) -> _Result:
    """A pool worker's task: ``_encode_chunk`` on the worker's encode thread. The Rust encode
    costs 10-30% less CPU on any thread but a process's main one (whose malloc arena also
    holds the interpreter's heap and the loaded tokenizer; with ``MALLOC_ARENA_MAX=1`` the
    difference goes away): ``docs/DATASET.md``, "Speed"."""
    return _WORKER["thread"].submit(_encode_chunk, payload, max_length, overflow).result()


def die_with_parent(parent: int) -> None:
    """Make this process (a worker forked by ``parent``) end when ``parent`` does: on Linux
    the kernel sends SIGTERM when it dies (``prctl(PR_SET_PDEATHSIG)``); a parent already
    gone (died before that call) ends us now. SIGTERM ends a worker at once (the parent
    owns every output) and Ctrl-C is the parent's to handle: the terminal sends it to the
    workers too, which then keep quiet instead of printing a traceback each."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _encode_chunk(payload: Payload, max_length: int | None, overflow: str) -> _Result:
    parent = _WORKER.get("parent")
    if parent is not None and os.getppid() != parent:  # where PR_SET_PDEATHSIG is not
        os._exit(1)
    enc: ChatEncoder = _WORKER["encoder"]
    rows = payload_rows(payload)
    outcomes: list[Any] = [None] * len(rows)
    convs: list[Any] = []
    for raw in rows:
        try:
            convs.append(to_messages(as_row(raw)))
        except MalformedRow as e:
            convs.append(e)
    before, notes_before = enc.fallbacks, Counter(enc.notes)
    ids, masks = [], []
    for i, r in enumerate(enc.encode_normalized(convs, max_length)):
        if isinstance(r, MalformedRow):
            outcomes[i] = (r.reason, r.detail)
            continue
        outcomes[i], fitted = _fit(r, max_length, overflow)
        if fitted is not None:
            ids.append(fitted[0])
            masks.append(fitted[1])
    lengths = np.array([len(x) for x in ids], dtype=np.int32)
    return _Result(
        np.concatenate(ids) if ids else np.zeros(0, np.int32),
        np.concatenate(masks) if masks else np.zeros(0, np.uint8),
        lengths,
        outcomes,
        enc.fallbacks - before,
        dict(enc.notes - notes_before),
    )


def _fit(
    sample: tuple[np.ndarray, np.ndarray] | Longer, max_length: int | None, overflow: str
) -> tuple[Any, tuple[np.ndarray, np.ndarray] | None]:
    """A sample under ``--max-length``: (outcome, what enters the corpus). A ``Longer`` one
    (not tokenized whole) is longer than ``max_length`` by construction."""
    if isinstance(sample, Longer):
        ids, mask = sample.ids, sample.mask
        n = f"more than {max_length}"
        whole = f"; {sample.chars:,} characters, not tokenized whole"
    else:
        ids, mask = sample
        n, whole = f"{len(ids)}", ""
        if max_length is None or len(ids) <= max_length:
            return None, sample
    if overflow == "drop":
        return ("too_long", f"{n} tokens > --max-length {max_length}{whole}"), None
    if not mask[:max_length].any():
        return ("too_long", f"no supervised token in the first {max_length} of {n}{whole}"), None
    return "truncated", (ids[:max_length], mask[:max_length])


class _Runner:
    """Chunks through ``_encode_chunk`` in input order, a bounded window of them in flight:
    on an encode thread of this process (one worker: tokenizers' own Rust thread pool then
    spreads each chunk's encode over the CPUs, unless ``TOKENIZERS_PARALLELISM`` says no),
    or in a pool of ``workers`` processes (forked, so they inherit the loaded encoder), at
    most 4 chunks per worker in flight."""

    def __init__(self, encoder: ChatEncoder, tokenizer: str, workers: int) -> None:
        _WORKER["encoder"] = encoder
        self._env = os.environ.get("TOKENIZERS_PARALLELISM")
        self.processes = workers > 1
        self.pool: Executor
        if not self.processes:  # the thread: see _encode_task; it also reads ahead one chunk
            self.pool, self.task, self.window = ThreadPoolExecutor(1, "encode"), _encode_chunk, 2
            return
        # Forked workers must not touch the parent's Rust thread pool; saying so before the
        # fork also silences tokenizers' fork warning. The parent encodes nothing while the
        # pool runs.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        import multiprocessing as mp

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=mp.get_context(method),
            initializer=_init_worker,
            initargs=(tokenizer, encoder.enable_thinking, os.getpid()),
        )
        self.task, self.window = _encode_task, workers * 4

    def map(
        self, chunks: Iterator[tuple[list, Payload]], max_length: int | None, overflow: str
    ) -> Iterator[tuple[list, Payload, _Result]]:
        pending: deque = deque()
        for where, payload in chunks:
            pending.append(
                (where, payload, self.pool.submit(self.task, payload, max_length, overflow))
            )
            if len(pending) >= self.window:
                where0, payload0, fut = pending.popleft()
                yield where0, payload0, fut.result()
        while pending:
            where0, payload0, fut = pending.popleft()
            yield where0, payload0, fut.result()

    def close(self, abort: bool = False) -> None:
        """Stop the pool: after the last chunk, or (``abort``: an error, Ctrl-C, SIGTERM)
        at once, worker processes terminated rather than left to finish their chunks (the
        encode thread finishes the chunk it is in, unwaited for)."""
        if not self.processes:
            self.pool.shutdown(wait=not abort, cancel_futures=True)
            return
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        # The pool forks its workers and then starts its manager thread; a Ctrl-C between
        # the two leaves a thread that was never started, which ``shutdown`` cannot wait for.
        manager = getattr(self.pool, "_executor_manager_thread", None)
        started = manager is None or manager.ident is not None
        if abort:
            for proc in procs:
                proc.terminate()
        self.pool.shutdown(wait=started, cancel_futures=True)
        for proc in procs:  # reaped even when the pool could not wait for them
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._env


@dataclass
class _Stats:
    strict: bool
    rows_read: int = 0
    truncated: int = 0
    fallbacks: int = 0
    notes: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)
    lengths: list[np.ndarray] = field(default_factory=list)

    def add(self, where: list[tuple[str, int]], result: _Result) -> None:
        self.rows_read += len(where)
        self.fallbacks += result.fallbacks
        self.notes.update(result.notes)
        self.lengths.append(result.lengths)
        for (name, i), outcome in zip(where, result.outcomes, strict=True):
            if outcome == "truncated":
                self.truncated += 1
            elif outcome is not None:
                self._skip(name, i, *outcome)

    def _skip(self, name: str, i: int, reason: str, detail: str) -> None:
        if self.strict and reason != "too_long":
            raise ValueError(f"{name}: row {i}: {reason}: {detail} (--strict)")
        entry = self.skipped.setdefault(
            reason, {"count": 0, "first_file": name, "first_row": i, "detail": detail}
        )
        entry["count"] += 1

    def count(self, too_long: bool) -> int:
        return sum(v["count"] for k, v in self.skipped.items() if (k == "too_long") == too_long)


def tokenize_corpus(
    sources: Sequence[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path,
    enable_thinking: bool | None = None,
    options: TokenizeOptions = DEFAULT_OPTIONS,
    progress: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Tokenize conversations into ``out_dir/shard-*.arrow``; returns the report (also
    written to ``out_dir/tokenize_report.json``).

    The output is built in ``OUT.tmp`` and renamed when complete (``trainer.files``); an
    existing non-empty ``out_dir`` is refused unless ``force``. With ``options.holdout > 0``
    the last ``holdout`` conversations that would enter the corpus are kept out and their
    prompts (the messages before the first assistant turn, rendered with the generation
    prompt) written to ``out_dir/heldout.jsonl`` (``trainer.data.corpus.write_heldout``); the
    loader ignores non-shard files in the folder.
    """
    files = expand_sources(sources)
    out = Path(out_dir)
    encoder = ChatEncoder(tokenizer, enable_thinking=enable_thinking)
    with atomic_output(out, folder=True, force=force, inputs=sources) as tmp:
        return _run(files, tmp, out, encoder, str(tokenizer), options, progress)


def _run(
    files: list[Source],
    tmp: Path,
    out: Path,
    encoder: ChatEncoder,
    tokenizer: str,
    opts: TokenizeOptions,
    progress: bool,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    stats = _Stats(strict=opts.strict)
    writer = ShardWriter(tmp, opts.shard_rows, opts.holdout)
    kept: deque = deque(maxlen=max(opts.holdout, 1))  # (file, row, raw) of the last kept rows
    total = count_rows(files) if progress else None
    if total is not None and opts.limit is not None:
        total = min(total, opts.limit)
    bar = progress_bar(total, "tokenize", "conv", progress)
    runner = _Runner(encoder, tokenizer, opts.workers)
    try:
        size = chunk_bytes(opts.workers, input_bytes(files))
        chunks = read_chunks(files, CHUNK_ROWS, opts.limit, size)
        for where, payload, result in runner.map(chunks, opts.max_length, opts.overflow):
            stats.add(where, result)
            writer.add(result.ids, result.mask, result.lengths)
            if opts.holdout:
                _remember(kept, where, payload, result.outcomes)
            _tick(bar, len(where), int(result.ids.size), t0)
    except BaseException:
        runner.close(abort=True)
        raise
    else:
        runner.close()
    finally:
        bar.close()
    held = writer.finish()
    if writer.rows == 0:
        reasons = {k: v["count"] for k, v in stats.skipped.items()}
        raise ValueError(
            f"no conversations for the corpus: {stats.rows_read} rows read, "
            f"{held[2].size} held out, skipped {reasons}"
        )
    heldout = _write_heldout(tmp, out, encoder, kept, held, writer.rows) if opts.holdout else None
    report = _report(files, out, writer, stats, encoder, tokenizer, opts, heldout, t0)
    (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _remember(kept: deque, where: list, payload: Payload, outcomes: list) -> None:
    for k, ((name, i), outcome) in enumerate(zip(where, outcomes, strict=True)):
        if outcome is None or outcome == "truncated":
            kept.append((name, i, payload, k))


def _write_heldout(
    tmp: Path,
    out: Path,
    encoder: ChatEncoder,
    kept: deque,
    held: tuple[np.ndarray, np.ndarray, np.ndarray],
    corpus_rows: int,
) -> str:
    ids, mask, lens = held
    rows = list(kept)[len(kept) - lens.size :]
    starts = np.concatenate([[0], np.cumsum(lens)])
    prompts = []
    for k, (name, i, payload, j) in enumerate(rows):
        messages = prompt_messages(to_messages(as_row(_payload_row(payload, j))))
        if messages:
            prompt = encoder.prompt_ids(messages)
        else:  # the conversation opens with the assistant: its tokens before the reply
            sample_mask = mask[starts[k] : starts[k + 1]]
            prompt = ids[starts[k] : starts[k] + max(int(np.argmax(sample_mask)), 1)]
        prompts.append(HeldoutPrompt(corpus_rows + k, prompt.tolist(), name, i))
    write_heldout(tmp / HELDOUT_NAME, prompts)
    return str(out / HELDOUT_NAME)


def _payload_row(payload: Payload, j: int) -> Any:
    return payload.slice(j, 1).to_pylist()[0] if isinstance(payload, pa.Table) else payload[j]


def _report(
    files: list[Source],
    out: Path,
    writer: ShardWriter,
    stats: _Stats,
    encoder: ChatEncoder,
    tokenizer: str,
    opts: TokenizeOptions,
    heldout: str | None,
    t0: float,
) -> dict[str, Any]:
    elapsed = time.perf_counter() - t0
    lengths = np.concatenate(stats.lengths)
    n_held = opts.holdout
    return {
        "out": str(out),
        "shards": [p.name for p in writer.paths],
        "sources": [str(f.path) for f in files],
        "tokenizer": tokenizer,
        "vocab_size": encoder.vocab_size,
        "end_of_turn": encoder.end_of_turn,
        "template_takes_enable_thinking": encoder.takes_thinking,
        "enable_thinking": encoder.enable_thinking,
        "rows_read": stats.rows_read,
        "conversations": writer.rows,
        "heldout": n_held,
        "heldout_prompts": heldout,
        "malformed_rows": stats.count(too_long=False),
        "dropped_too_long": stats.count(too_long=True),
        "truncated": stats.truncated,
        "skipped": stats.skipped,
        "fallback_conversations": stats.fallbacks,
        # Replies kept, but worth a look: unbalanced_markup (a literal </think>...) is masked
        # as the chat template renders it (docs/DATASET.md, "The mask").
        "template_notes": dict(sorted(stats.notes.items())),
        "tokens": writer.tokens,
        "supervised_tokens": writer.supervised,
        "length": _length_stats(lengths),
        **{
            k: getattr(opts, k)
            for k in ("max_length", "overflow", "workers", "shard_rows", "limit")
        },
        "elapsed_s": round(elapsed, 3),
        "conversations_per_s": round((writer.rows + n_held) / elapsed, 1),
        "tokens_per_s": round(int(lengths.sum()) / elapsed, 1),
    }


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The report in a few lines: what went in, what came out, every skipped reason with the
    first file and row it happened at."""
    lines = [
        f"{report['rows_read']} rows read: {report['conversations']} conversations in the corpus, "
        f"{report['heldout']} held out, {report['malformed_rows']} malformed, "
        f"{report['dropped_too_long']} too long; {report['truncated']} truncated",
        f"{report['tokens']} tokens ({report['supervised_tokens']} supervised) in "
        f"{len(report['shards'])} shards, {report['elapsed_s']:.1f} s "
        f"({report['conversations_per_s']:.0f} conv/s, {report['tokens_per_s']:,.0f} tok/s)",
    ]
    for note, n in report.get("template_notes", {}).items():
        lines.append(f"kept {n} x {note}: masked as the chat template renders them")
    for reason, v in sorted(report["skipped"].items(), key=lambda kv: -kv[1]["count"]):
        lines.append(
            f"skipped {v['count']} x {reason}: first {v['first_file']} row {v['first_row']} "
            f"({v['detail']})"
        )
    return lines


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 1),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(lengths.max()),
    }


def _tick(bar: Any, rows: int, tokens: int, t0: float) -> None:
    bar.update(rows)
    if not bar.disable:
        bar.n_tokens = getattr(bar, "n_tokens", 0) + tokens
        rate = bar.n_tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
