"""One ``regen --server`` run: index the rows, regenerate the ones not finished through a
bounded pool, then tokenize the conversations in source order."""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.messages import MalformedRow, to_messages
from trainer.data.server.http import ChatClient, RowFailed, ServerUnavailable
from trainer.data.server.journal import Journal, journal_path
from trainer.data.server.spec import ServerRegenSpec
from trainer.data.sources import Source, changed_since, expand_sources, fingerprints, source_rows
from trainer.data.tokenize import tokenize_corpus
from trainer.files import check_output
from trainer.progress import progress_bar

log = logging.getLogger(__name__)


def reply_slots(messages: list[dict[str, str]]) -> list[int]:
    """Positions where a reply is generated: every assistant turn, and the end when the
    conversation ends in a user turn. RowFailed without a user turn before them."""
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise RowFailed("no_user_turn", f"roles {roles[:6]}: nothing to answer")
    first_user = roles.index("user")
    if "assistant" in roles[:first_user]:
        raise RowFailed("assistant_before_user", f"roles {roles[:6]}")
    slots = [k for k, r in enumerate(roles) if r == "assistant"]
    if roles[-1] == "user":
        slots.append(len(roles))
    return slots


def regenerate(client: ChatClient, messages: list[dict[str, str]], tag: str) -> dict[str, Any]:
    """The conversation with every reply regenerated in order (see ``reply_slots``)."""
    slots = set(reply_slots(messages))
    history: list[dict[str, str]] = []
    finish, tokens = [], 0
    for k in range(len(messages) + 1):
        if k in slots:
            reply = client.chat(history, f"{tag}:{k}")
            history.append({"role": "assistant", "content": reply.content})
            finish.append(reply.finish_reason)
            tokens += reply.completion_tokens
        elif k < len(messages):
            history.append({"role": messages[k]["role"], "content": messages[k]["content"]})
    return {
        "messages": history,
        "finish_reasons": finish,
        "completion_tokens": tokens,
        "answered_trailing_user": len(messages) in slots,
    }


#: Rows an error names before it says how many more there are.
NAMED_ROWS = 5


@dataclass
class RowIndex:
    """Every row of the sources in order; the held-out rows' messages (the last ``holdout``
    valid rows with an assistant turn, which ``tokenize_corpus`` holds out as well)."""

    keys: list[tuple[str, int]] = field(default_factory=list)
    valid: int = 0
    holdout: dict[tuple[str, int], list[dict[str, str]]] = field(default_factory=dict)


@dataclass
class _RowTally:
    """What the holdout check needs to know about the rows besides their keys."""

    replied: int = 0  # valid rows with an assistant turn: the ones that can be held out
    prompt_only: int = 0  # valid rows without one (regen answers them)
    named_prompt_only: list[tuple[str, int]] = field(default_factory=list)  # the first few
    first_failed: str | None = None  # the first row that is not a valid conversation


def conversation(row: Any) -> list[dict[str, str]]:
    """``to_messages``, except that a row without an assistant turn is a prompt for the
    server to answer, not a malformed row. Raises MalformedRow or RowFailed."""
    messages = to_messages(row, require_assistant=False)
    reply_slots(messages)
    return messages


def _rows(files: list[Source]) -> Iterator[tuple[tuple[str, int], Any]]:
    """``((file, row), messages | RowFailed)`` for every row of the inputs, in order."""
    for file, i, row in source_rows(files):
        key = (str(Path(file).resolve()), int(i))
        if isinstance(row, MalformedRow):
            yield key, RowFailed(row.reason, row.detail)
            continue
        try:
            yield key, conversation(row)
        except MalformedRow as e:
            yield key, RowFailed(e.reason, e.detail)
        except RowFailed as e:
            yield key, e


def index_rows(files: list[Source], holdout: int) -> RowIndex:
    """All row keys and the held-out rows. Only a row with an assistant turn can be held
    out: it is tokenized as it is (not regenerated), and its prompt is what comes before
    its first reply; a prompt-only row is answered and enters the corpus. Raises
    ValueError (naming the rows) when ``holdout`` cannot be met."""
    index, tally = RowIndex(), _RowTally()
    tail: deque = deque(maxlen=max(holdout, 1))
    for key, item in _rows(files):
        index.keys.append(key)
        if isinstance(item, RowFailed):
            if tally.first_failed is None:
                tally.first_failed = f"{key[0]} row {key[1]}: {item.reason}: {item.detail}"
            continue
        index.valid += 1
        if any(m["role"] == "assistant" for m in item):
            tally.replied += 1
            if holdout:
                tail.append((key, item))
        else:
            tally.prompt_only += 1
            if len(tally.named_prompt_only) < NAMED_ROWS:
                tally.named_prompt_only.append(key)
    if holdout:
        _check_holdout(index, tally, holdout)
    index.holdout = dict(tail) if holdout else {}
    return index


def _check_holdout(index: RowIndex, tally: _RowTally, holdout: int) -> None:
    """One line saying why ``--holdout`` cannot be met by these rows, and what would do."""
    rows = len(index.keys)
    invalid = rows - index.valid
    if index.valid == 0:
        raise ValueError(
            f"--holdout {holdout}: none of the {rows} rows of {_files(index.keys)} is a valid "
            f"conversation, so there is nothing to hold out or regenerate; first: "
            f"{tally.first_failed}"
        )
    if tally.replied < holdout and tally.prompt_only:
        have = (
            f"none of the {index.valid} valid conversations in {rows} rows has"
            if tally.replied == 0
            else f"only {tally.replied} of the {index.valid} valid conversations in {rows} rows "
            + ("has" if tally.replied == 1 else "have")
        )
        fix = f"--holdout {tally.replied} or less" if tally.replied else "--holdout 0"
        raise ValueError(
            f"--holdout {holdout}: {have} an assistant reply, and only those can be held out "
            f"(kept out unregenerated, the prompt cut before the first reply); the other "
            f"{tally.prompt_only} are prompt-only (no assistant turn), which regen answers "
            f"into the corpus: {_named_rows(tally.named_prompt_only, tally.prompt_only)} "
            f"(counting from 0). Pass {fix}, or give the rows to hold out an assistant reply "
            f"(any text: only the messages before it are kept)"
        )
    if index.valid <= holdout:
        are = "row is" if invalid == 1 else "rows are"
        not_valid = f", and {invalid} {are} not (first: {tally.first_failed})" if invalid else ""
        fix = f"--holdout {index.valid - 1} or less" if index.valid > 1 else "--holdout 0"
        raise ValueError(
            f"--holdout {holdout} leaves no conversation to regenerate: the {rows} rows of "
            f"{_files(index.keys)} hold {index.valid} valid conversations{not_valid}. "
            f"Pass {fix}"
        )


def _files(keys: list[tuple[str, int]]) -> str:
    """The input files the rows are from, by name (the first few)."""
    names = list(dict.fromkeys(f for f, _ in keys))
    if len(names) <= 3:
        return ", ".join(names)
    return f"{', '.join(names[:3])} and {len(names) - 3} more files"


def _named_rows(named: list[tuple[str, int]], total: int) -> str:
    """``FILE rows 0, 3; OTHER row 7 and 12 more``: the first rows of ``total``."""
    by_file: dict[str, list[int]] = {}
    for file, row in named:
        by_file.setdefault(file, []).append(row)
    parts = [
        f"{file} row{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for file, rs in by_file.items()
    ]
    more = total - len(named)
    return "; ".join(parts) + (f" and {more} more" if more else "")


@dataclass
class RunCounts:
    regenerated: int = 0
    failed: Counter = field(default_factory=Counter)
    first_failed: str | None = None
    finish: Counter = field(default_factory=Counter)
    answered_trailing_user: int = 0
    empty_replies: int = 0  # tokenization skips these conversations (empty_assistant)
    tokens: int = 0

    def count(self, rec: dict[str, Any]) -> None:
        if rec["status"] == "ok":
            self.regenerated += 1
            self.finish.update(rec["finish_reasons"])
            self.answered_trailing_user += bool(rec.get("answered_trailing_user"))
            self.empty_replies += bool(rec.get("empty_reply"))
            self.tokens += rec["completion_tokens"]
            return
        self.failed[rec["reason"]] += 1
        if self.first_failed is None:
            self.first_failed = describe_failure(rec)


def describe_failure(rec: dict[str, Any]) -> str:
    return f"{rec['file']} row {rec['row']}: {rec['reason']}: {rec['detail']}"


def failure_line(counts: RunCounts, rows: int) -> str:
    """One line on the rows that failed: how many, by reason, the first."""
    n = sum(counts.failed.values())
    reasons = ", ".join(f"{k}: {v}" for k, v in counts.failed.most_common())
    return f"{n} of {rows} rows failed ({reasons}); first: {counts.first_failed}"


def _work(client: ChatClient, key: tuple[str, int], item: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"file": key[0], "row": key[1]}
    if isinstance(item, RowFailed):
        return {**rec, "status": "failed", "reason": item.reason, "detail": item.detail}
    tag = f"{Path(key[0]).name}:{key[1]}"
    try:
        return {**rec, "status": "ok", **regenerate(client, item, tag)}
    except RowFailed as e:
        return {**rec, "status": "failed", "reason": e.reason, "detail": e.detail}


class Pool:
    """Runs ``_work`` over the rows with at most ``concurrency`` at once; results are handed
    to ``done`` on the calling thread as they finish. Stops early on ServerUnavailable or,
    with ``strict``, the first failed row (running rows finish and are recorded first)."""

    def __init__(self, client: ChatClient, concurrency: int, strict: bool) -> None:
        self.client, self.concurrency, self.strict = client, concurrency, strict
        self.error: Exception | None = None

    def run(self, todo: Iterator[tuple[Any, Any]], done: Callable[[dict], None]) -> None:
        pending: set[Future] = set()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="regen")
        try:
            for key, item in todo:
                if self.error is not None:
                    break
                pending.add(pool.submit(_work, self.client, key, item))
                if len(pending) >= 2 * self.concurrency:
                    pending = self._collect(pending, done)
            while pending:
                pending = self._collect(pending, done)
        except BaseException:  # Ctrl-C, SIGTERM: what finished is journaled; drop the rest
            self.client.close()  # requests in flight end now, their threads with them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        if self.error is not None:
            raise self.error

    def _collect(self, pending: set[Future], done: Callable) -> set[Future]:
        finished, rest = wait(pending, return_when=FIRST_COMPLETED)
        for fut in finished:
            try:
                rec = fut.result()
            except ServerUnavailable as e:
                self._stop(rest, e)
                continue
            done(rec)
            if rec["status"] == "failed" and self.strict:
                self._stop(rest, ValueError(f"{describe_failure(rec)} (--strict)"))
        return {f for f in rest if not f.cancelled()}

    def _stop(self, rest: set[Future], error: Exception) -> None:
        if self.error is None:
            self.error = error
        for f in rest:
            f.cancel()


def _header(sources: list[Path], spec: ServerRegenSpec, model: str) -> dict[str, Any]:
    """What the journal's replies depend on; a resumed run must match it."""
    return {
        "sources": [str(Path(s).resolve()) for s in sources],
        "model": model,
        "temperature": spec.temperature,
        "max_tokens": spec.max_tokens,
        "thinking": spec.thinking,
    }


def connect(spec: ServerRegenSpec) -> ChatClient:
    """A client for the server's model; ServerUnavailable when /v1/models does not answer."""
    client = ChatClient(spec.url, model=spec.model, spec=spec)
    served = client.list_models()
    if spec.model is None:
        if not served:
            raise ServerUnavailable(f"--server {client.url} lists no models; pass --model")
        client.model = served[0]
    elif spec.model not in served:
        names = ", ".join(served) or "nothing"
        raise ValueError(f"--model {spec.model!r}: {client.url} serves {names}")
    return client


def regen_from_server(
    sources: list[Path], out: Path, spec: ServerRegenSpec, *, progress: bool = True
) -> dict[str, Any]:
    """Regenerate (resuming from the journal), then tokenize into ``out``; the summary.

    The inputs are fingerprinted first (``trainer.data.sources.fingerprints``, recorded in
    the journal): a resumed run refuses inputs that changed since (``spec.restart``
    discards the journal instead), and a run whose inputs change while it runs stops before
    tokenizing. A run where no row could be regenerated is an error naming the reasons; one
    where some failed tokenizes the others and says so (``summary["failed"]``)."""
    start = time.perf_counter()
    client = connect(spec)
    files = expand_sources(sources)
    inputs = fingerprints(files)
    index = index_rows(files, spec.holdout)
    _check_out(Path(out), sources)
    if client.model is None:  # connect() names the served model
        raise RuntimeError(f"--server {client.url}: no model chosen")
    header = _header(sources, spec, client.model)
    journal = Journal(journal_path(out), header, inputs=inputs, restart=spec.restart)
    resumed = sum(journal.finished(k) for k in index.keys)
    todo = [k for k in index.keys if k not in index.holdout and not journal.finished(k)]
    counts = RunCounts()
    log.info(
        "regen via %s (model %s): %d rows, %d finished before, %d to do, holdout %d",
        *(client.url, client.model, len(index.keys), resumed, len(todo), spec.holdout),
    )
    try:
        regen_s = _regenerate_rows(client, files, set(todo), journal, counts, spec, progress)
    finally:
        journal.close()
    _check_unchanged(inputs, journal)
    final = final_counts(index, journal)
    if final.regenerated == 0 and final.failed:
        raise ValueError(
            f"no row was regenerated: {failure_line(final, len(index.keys) - len(index.holdout))}"
            f" (journal {journal.path}: a rerun retries the failed rows)"
        )
    corpus = _tokenize(sources, Path(out), index, journal, spec, progress, final)
    return _summary(index, journal, final, counts, client, corpus, resumed, regen_s, start)


def _check_unchanged(inputs: dict[str, dict[str, Any]], journal: Journal) -> None:
    """The inputs are still what they were when this run fingerprinted them."""
    for name, fp in inputs.items():
        how = changed_since(fp, Path(name))
        if how:
            raise ValueError(
                f"{name} {how} while this run read it: the journal {journal.path} may hold "
                "rows of both versions; rerun with --restart to discard it and regenerate"
            )


def final_counts(index: RowIndex, journal: Journal) -> RunCounts:
    """The journal's newest record of every row of this input (held-out rows aside)."""
    final = RunCounts()
    for key in index.keys:
        if key in journal.records and key not in index.holdout:
            final.count(journal.records[key])
    return final


def _check_out(out: Path, sources: list[Path]) -> None:
    """OUT is replaced at the end: refuse one this command did not write (no journal), and
    one that is, contains or lies inside a source."""
    check_output(out, inputs=sources)
    if out.exists() and (out.is_file() or any(out.iterdir())) and not journal_path(out).exists():
        raise ValueError(
            f"{out} already exists and there is no {journal_path(out).name} next to it: "
            "choose another OUT (regen replaces only an OUT it wrote)"
        )


def _regenerate_rows(
    client: ChatClient,
    files: list[Source],
    todo: set[tuple[str, int]],
    journal: Journal,
    counts: RunCounts,
    spec: ServerRegenSpec,
    progress: bool,
) -> float:
    """Regenerate the ``todo`` rows into the journal; the seconds it took."""
    bar = progress_bar(len(todo), "regen", "conv", progress)
    t0 = time.perf_counter()

    def done(rec: dict[str, Any]) -> None:
        journal.append(rec)
        counts.count(rec)
        rate = counts.tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(in_flight=client.stats.in_flight, tok_s=f"{rate:.0f}", refresh=False)
        bar.update(1)

    rows = ((k, item) for k, item in _rows(files) if k in todo)
    try:
        Pool(client, spec.concurrency, spec.tokenize.strict).run(rows, done)
    finally:
        bar.close()
    return time.perf_counter() - t0


def _tokenize(
    sources: list[Path],
    out: Path,
    index: RowIndex,
    journal: Journal,
    spec: ServerRegenSpec,
    progress: bool,
    final: RunCounts,
) -> dict[str, Any]:
    """The finished conversations in source order, then the held-out ones, through
    ``tokenize_corpus`` into OUT; its report and held-out prompts name the source rows,
    and the report counts the rows that failed to regenerate (``regen_failed``...)."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.regen-ordered.", suffix=".jsonl",
                                dir=out.parent)  # fmt: skip
    os.close(fd)
    ordered = Path(name)
    try:
        order = _write_ordered(ordered, index, journal)
        report = tokenize_corpus(
            [ordered],
            out,
            tokenizer=spec.tokenizer,
            enable_thinking=spec.thinking,
            options=spec.tokenize,
            progress=progress,
            force=True,
        )
    finally:
        ordered.unlink(missing_ok=True)
    report["sources"] = [str(s) for s in sources]
    report["regen_journal"] = str(journal.path)
    report["regen_failed"] = sum(final.failed.values())
    report["regen_failed_by_reason"] = dict(sorted(final.failed.items()))
    report["regen_first_failed"] = final.first_failed
    if report.get("heldout_prompts"):
        _relabel_heldout(Path(report["heldout_prompts"]), order, index)
    (out / "tokenize_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _write_ordered(path: Path, index: RowIndex, journal: Journal) -> list[tuple[str, int]]:
    """Write ``{"messages"}`` lines; the source row of each line."""
    done = [k for k in index.keys if journal.finished(k) and k not in index.holdout]
    with open(path, "w", encoding="utf-8") as f:
        for messages in itertools.chain(journal.messages(done), index.holdout.values()):
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return done + list(index.holdout)


def _relabel_heldout(path: Path, order: list[tuple[str, int]], index: RowIndex) -> None:
    """Held-out prompt lines name the source file and row, not the temporary file."""
    lines = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec["file"], rec["row"] = order[rec["row"]]
        if (rec["file"], rec["row"]) not in index.holdout:
            log.warning(
                "held-out prompt %s row %s was regenerated too (a held-out row was "
                "dropped by tokenization)",
                rec["file"],
                rec["row"],
            )
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")


def _summary(
    index: RowIndex,
    journal: Journal,
    final: RunCounts,
    counts: RunCounts,
    client: ChatClient,
    corpus: dict[str, Any],
    resumed: int,
    regen_s: float,
    start: float,
) -> dict[str, Any]:
    stats = client.stats
    skipped = {k: v["count"] for k, v in (corpus.get("skipped") or {}).items()}
    return {
        "rows": len(index.keys),
        "regenerated": final.regenerated,
        "regenerated_this_run": counts.regenerated,
        "resumed": resumed,
        "holdout": len(index.holdout),
        "failed": sum(final.failed.values()),
        "failed_by_reason": dict(sorted(final.failed.items())),
        "first_failed": final.first_failed,
        "finish_reasons": dict(sorted(final.finish.items())),
        "answered_trailing_user": final.answered_trailing_user,
        "empty_replies": final.empty_replies,
        "completion_tokens": final.tokens,
        "requests": stats.requests,
        "retries": stats.retries,
        "regen_s": round(regen_s, 3),
        "requests_per_s": round(stats.requests / max(regen_s, 1e-9), 2),
        "completion_tokens_per_s": round(counts.tokens / max(regen_s, 1e-9), 1),
        "elapsed_s": round(time.perf_counter() - start, 3),
        "journal": str(journal.path),
        "corpus": {
            "out": corpus["out"],
            "conversations": corpus["conversations"],
            "tokens": corpus["tokens"],
            "supervised_tokens": corpus["supervised_tokens"],
            "skipped": skipped,
            "truncated": corpus["truncated"],
            "heldout_prompts": corpus["heldout_prompts"],
        },
    }
