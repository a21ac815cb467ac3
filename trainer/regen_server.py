"""``dflash-train regen SRC... OUT --server URL``: regenerate a conversation dataset's
assistant replies through an OpenAI-compatible chat-completions server (SGLang, vLLM), then
tokenize the result into a loader corpus.

Per conversation (``trainer.chat.to_messages``: ShareGPT or OpenAI rows), every assistant
turn is regenerated in order: the server gets the history (system and user turns plus the
replies already regenerated) and its reply replaces the original. A conversation that ends
in a user turn gets a reply for it (a prompt-only row becomes a one-turn conversation;
counted as ``answered_trailing_user``). A row with no user turn, or with an assistant turn
before the first user turn, fails (``no_user_turn``, ``assistant_before_user``).

Requests: stdlib HTTP (one keep-alive connection per worker thread), at most
``concurrency`` conversations (so requests) in flight. Connection errors, 408, 429 and 5xx
are retried ``retries`` times with exponential backoff and jitter, never sooner than a
``Retry-After`` asks; any other 4xx fails the row with its reason (``http_400`` ...).
A row whose retries run out on an HTTP status fails with it; a server that stops answering
altogether ends the run with an error (the journal keeps what finished: run it again).

Journal: each finished conversation (or failed row) is appended as one JSON line to
``OUT.regen.jsonl`` and flushed. A restarted run reads it (a torn last line, from a kill
mid-write, is cut off), skips the finished rows and retries the failed ones; a journal
written with other settings (sources, model, temperature, max tokens, thinking) is
refused; the server's URL, the concurrency and the tokenization options may change.
When every row is done, the finished conversations are tokenized in source order
(``trainer.chat.tokenize_corpus``: the same template and mask rules as ``dflash-train
tokenize``), so OUT does not depend on completion order. The last ``holdout`` valid rows
are not regenerated: their prompts are written for the verifier.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import random
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOURNAL_SUFFIX = ".regen.jsonl"
JOURNAL_VERSION = 1
RETRY_STATUSES = frozenset({408, 429})  # and every 5xx


@dataclass(frozen=True, kw_only=True)
class ServerRegenSpec:
    url: str
    tokenizer: Path
    model: str | None = None  # default: the first model the server lists
    concurrency: int = 64
    temperature: float = 0.0
    max_tokens: int = 2048
    thinking: bool = False
    retries: int = 5
    timeout_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    holdout: int = 0
    max_length: int | None = None
    overflow: str = "truncate"
    workers: int = 1
    strict: bool = False

    def __post_init__(self) -> None:
        checks = {
            "--concurrency": self.concurrency >= 1,
            "--max-tokens": self.max_tokens >= 1,
            "--retries": self.retries >= 0,
            "--timeout-s": self.timeout_s > 0,
            "--temperature": self.temperature >= 0,
            "--holdout": self.holdout >= 0,
            "--workers": self.workers >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = {k: getattr(self, k[2:].replace("-", "_")) for k in bad}
            raise ValueError(f"out of range: {values} (need counts >= 1, retries >= 0)")


class ServerUnavailable(ValueError):
    """The server does not answer (at start, or after all retries): the run stops."""


class RowFailed(Exception):
    """This row cannot be regenerated: recorded with its reason, counted, reported."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Reply:
    content: str
    finish_reason: str
    completion_tokens: int


# --------------------------------------------------------------------------- HTTP client


def base_url(url: str) -> str:
    """``http://host:port`` from a URL with or without a trailing ``/v1``."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--server {url!r}: expected http://HOST:PORT (or .../v1)")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _error_text(data: bytes) -> str:
    try:
        err = json.loads(data)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message", err) if isinstance(err, dict) else err
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = data.decode("utf-8", "replace")
    return " ".join(text.split())[:300]


def parse_reply(data: bytes, thinking: bool) -> Reply:
    """``choices[0].message.content`` (with a reasoning parser's ``reasoning_content`` put
    back in front as ``<think>...</think>`` when thinking is on), finish reason, tokens."""
    try:
        body = json.loads(data)
        choice = body["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or ""
        tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
        raise RowFailed("bad_response", f"{type(e).__name__}: {_error_text(data)}") from e
    if not isinstance(content, str):
        raise RowFailed("bad_response", f"content is {type(content).__name__}, not a string")
    if thinking and reasoning:
        content = f"<think>\n{reasoning}\n</think>\n\n{content}"
    return Reply(content, str(choice.get("finish_reason") or "unknown"), tokens)


@dataclass
class ClientStats:
    requests: int = 0
    retries: int = 0
    in_flight: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)


class ChatClient:
    """Chat completions over one keep-alive connection per thread, with retries."""

    def __init__(self, url: str, *, model: str | None, spec: ServerRegenSpec) -> None:
        self.url = base_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self._https, self._netloc, self._prefix = parts.scheme == "https", parts.netloc, parts.path
        self.model, self.spec = model, spec
        self.stats = ClientStats()
        self._local = threading.local()

    def list_models(self, timeout_s: float = 10.0) -> list[str]:
        """Model ids from ``GET /v1/models``; ServerUnavailable (one line) if it fails."""
        where = f"{self.url}/v1/models"
        try:
            status, _, data = self._send("GET", "/v1/models", None, {}, timeout_s)
        except (OSError, http.client.HTTPException) as e:
            raise ServerUnavailable(f"--server {self.url}: no answer from {where}: {e}") from e
        if status != 200:
            raise ServerUnavailable(
                f"--server {self.url}: {where} answered HTTP {status}: {_error_text(data)}"
            )
        try:
            return [m["id"] for m in json.loads(data)["data"]]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ServerUnavailable(
                f"--server {self.url}: {where} is not an OpenAI model list: {_error_text(data)}"
            ) from e

    def chat(self, messages: list[dict[str, str]], request_id: str) -> Reply:
        spec = self.spec
        payload = {
            "model": self.model,
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "chat_template_kwargs": {"enable_thinking": spec.thinking},
        }
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        self.stats.add(in_flight=1)
        try:
            reply = self._post_with_retries(body, headers)
        finally:
            self.stats.add(in_flight=-1)
        self.stats.add(completion_tokens=reply.completion_tokens)
        return reply

    def _post_with_retries(self, body: bytes, headers: dict[str, str]) -> Reply:
        path, spec = "/v1/chat/completions", self.spec
        wait_s: float | None = None
        failure: RowFailed | None = None
        error = ""
        for attempt in range(spec.retries + 1):
            if attempt:
                self.stats.add(retries=1)
                time.sleep(self.backoff(attempt, wait_s))
            self.stats.add(requests=1)
            try:
                status, resp_headers, data = self._send("POST", path, body, headers, None)
            except (OSError, http.client.HTTPException) as e:
                failure, wait_s = None, None
                error = f"{type(e).__name__}: {e}"
                continue
            if status == 200:
                return parse_reply(data, spec.thinking)
            failure = RowFailed(f"http_{status}", _error_text(data))
            if status not in RETRY_STATUSES and status < 500:
                raise failure
            wait_s = retry_after_s(resp_headers.get("Retry-After"))
        if failure is not None:
            raise RowFailed(failure.reason, f"{failure.detail} (after {spec.retries} retries)")
        raise ServerUnavailable(
            f"--server {self.url} stopped answering ({error}, {spec.retries} retries); "
            "finished rows are in the journal: run the same command again to resume"
        )

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter (50-100% of base * 2^(attempt-1), capped), never
        shorter than the server's Retry-After."""
        spec = self.spec
        delay = min(spec.max_backoff_s, spec.backoff_s * 2 ** (attempt - 1))
        delay *= random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, spec.max_backoff_s))
        return delay

    def _send(
        self, method: str, path: str, body: bytes | None, headers: dict, timeout_s: float | None
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request; a kept-alive connection the server closed meanwhile is reopened once."""
        for fresh in (False, True):
            conn, reused = self._connection(timeout_s, fresh)
            try:
                conn.request(method, self._prefix + path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop()
                if reused and not fresh:
                    continue
                raise
            except BaseException:
                self._drop()
                raise
            if resp.will_close:
                self._drop()
            return resp.status, resp.headers, data
        raise AssertionError("unreachable")

    def _connection(self, timeout_s: float | None, fresh: bool) -> tuple[Any, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None and not fresh:
            return conn, True
        self._drop()
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._netloc, timeout=timeout_s or self.spec.timeout_s)
        self._local.conn = conn
        return conn, False

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None


# --------------------------------------------------------------------------- conversations


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


# --------------------------------------------------------------------------- journal


def journal_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + JOURNAL_SUFFIX)


class Journal:
    """Append-only JSONL of finished rows; the first line is the run's settings.

    In memory: each row's newest record without its messages (``records``) and where its
    line is (``messages`` reads it back), so a journal of a million conversations costs
    only the bookkeeping."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header = Path(path), header
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self._where: dict[tuple[str, int], tuple[int, int]] = {}
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_header()
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = self._file.seek(0, os.SEEK_END)
        self._lock = threading.Lock()

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        if torn:
            log.warning("%s: cutting a torn last line (%d bytes)", self.path, len(torn))
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(torn))
        if not lines:  # killed while writing the settings line
            self._write_header()
            return
        self._check_header(self._parse(lines[0], 1))
        offset = len(lines[0]) + 1
        for k, line in enumerate(lines[1:], 2):
            self._keep(self._parse(line, k), offset, len(line))
            offset += len(line) + 1

    def _keep(self, rec: dict[str, Any], offset: int, size: int) -> None:
        key = (rec["file"], rec["row"])
        messages = rec.pop("messages", None)
        if messages is not None:
            replies = (m["content"] for m in messages if m["role"] == "assistant")
            rec["empty_reply"] = any(not r.strip() for r in replies)
        self.records[key] = rec
        self._where[key] = (offset, size)

    def _write_header(self) -> None:
        self.path.write_text(json.dumps({"journal": JOURNAL_VERSION, **self.header}) + "\n")

    def _parse(self, line: bytes, k: int) -> dict[str, Any]:
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{self.path}:{k}: not a JSON line ({e}); the journal is damaged"
            ) from e
        if k > 1 and not {"file", "row", "status"} <= set(rec):
            raise ValueError(f"{self.path}:{k}: a record needs file, row and status")
        return rec

    def _check_header(self, old: dict[str, Any]) -> None:
        if old.get("journal") != JOURNAL_VERSION:
            raise ValueError(f"{self.path}: not a regen journal (version {old.get('journal')})")
        diff = {k: (old.get(k), v) for k, v in self.header.items() if old.get(k) != v}
        if diff:
            what = "; ".join(f"{k}: journal {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{self.path} was written with other settings ({what}): use another OUT, "
                "or delete the journal to start over"
            )

    def append(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, ensure_ascii=False).encode()
        with self._lock:
            self._file.write(line + b"\n")
            self._file.flush()
            self._keep(dict(rec), self._size, len(line))
            self._size += len(line) + 1

    def messages(self, keys: list[tuple[str, int]]) -> Iterator[list[dict[str, str]]]:
        """The regenerated conversations of finished rows, read back from the file."""
        with open(self.path, "rb") as f:
            for key in keys:
                offset, size = self._where[key]
                f.seek(offset)
                yield json.loads(f.read(size))["messages"]

    def close(self) -> None:
        self._file.close()

    def finished(self, key: tuple[str, int]) -> bool:
        rec = self.records.get(key)
        return rec is not None and rec["status"] == "ok"


# --------------------------------------------------------------------------- the run


@dataclass
class RowIndex:
    """Every row of the sources in order; the held-out rows' messages (the last ``holdout``
    valid rows with an assistant turn, which ``tokenize_corpus`` holds out as well)."""

    keys: list[tuple[str, int]] = field(default_factory=list)
    valid: int = 0
    holdout: dict[tuple[str, int], list[dict[str, str]]] = field(default_factory=dict)


def conversation(row: Any) -> list[dict[str, str]]:
    """``to_messages``, except that a row without an assistant turn is a prompt for the
    server to answer, not a malformed row. Raises MalformedRow or RowFailed."""
    from trainer.chat import to_messages

    messages = to_messages(row, require_assistant=False)
    reply_slots(messages)
    return messages


def _rows(sources: list[Path]) -> Iterator[tuple[tuple[str, int], Any]]:
    """``((file, row), messages | RowFailed)`` for every row of the sources, in order."""
    from trainer.chat import MalformedRow, read_rows

    for file, i, row in read_rows(sources):
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


def index_rows(sources: list[Path], holdout: int) -> RowIndex:
    """All row keys and the held-out rows."""
    index = RowIndex()
    tail: deque = deque(maxlen=max(holdout, 1))
    for key, item in _rows(sources):
        index.keys.append(key)
        if isinstance(item, RowFailed):
            continue
        index.valid += 1
        if holdout and any(m["role"] == "assistant" for m in item):
            tail.append((key, item))
    if holdout and (len(tail) < holdout or index.valid <= holdout):
        raise ValueError(
            f"{index.valid} valid conversations in {len(index.keys)} rows leave none after a "
            f"holdout of {holdout}"
        )
    index.holdout = dict(tail) if holdout else {}
    return index


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
        except BaseException:  # Ctrl-C: what finished is journaled; do not wait for the rest
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
    """Regenerate (resuming from the journal), then tokenize into ``out``; the summary."""
    start = time.perf_counter()
    client = connect(spec)
    index = index_rows(sources, spec.holdout)
    _check_out(Path(out))
    journal = Journal(journal_path(out), _header(sources, spec, client.model))
    resumed = sum(journal.finished(k) for k in index.keys)
    todo = [k for k in index.keys if k not in index.holdout and not journal.finished(k)]
    counts = RunCounts()
    log.info(
        "regen via %s (model %s): %d rows, %d finished before, %d to do, holdout %d",
        *(client.url, client.model, len(index.keys), resumed, len(todo), spec.holdout),
    )
    try:
        regen_s = _regenerate_rows(client, sources, set(todo), journal, counts, spec, progress)
    finally:
        journal.close()
    corpus = _tokenize(sources, Path(out), index, journal, spec, progress)
    return _summary(index, journal, counts, client, corpus, resumed, regen_s, start)


def _check_out(out: Path) -> None:
    """OUT is replaced at the end: refuse one this command did not write (no journal)."""
    if out.exists() and (out.is_file() or any(out.iterdir())) and not journal_path(out).exists():
        raise ValueError(
            f"{out} already exists and there is no {journal_path(out).name} next to it: "
            "choose another OUT (regen replaces only an OUT it wrote)"
        )


def _regenerate_rows(
    client: ChatClient,
    sources: list[Path],
    todo: set[tuple[str, int]],
    journal: Journal,
    counts: RunCounts,
    spec: ServerRegenSpec,
    progress: bool,
) -> float:
    """Regenerate the ``todo`` rows into the journal; the seconds it took."""
    bar = _bar(len(todo), progress)
    t0 = time.perf_counter()

    def done(rec: dict[str, Any]) -> None:
        journal.append(rec)
        counts.count(rec)
        rate = counts.tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(in_flight=client.stats.in_flight, tok_s=f"{rate:.0f}", refresh=False)
        bar.update(1)

    rows = ((k, item) for k, item in _rows(sources) if k in todo)
    try:
        Pool(client, spec.concurrency, spec.strict).run(rows, done)
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
) -> dict[str, Any]:
    """The finished conversations in source order, then the held-out ones, through
    ``tokenize_corpus`` into OUT; its report and held-out prompts name the source rows."""
    from trainer.chat import tokenize_corpus

    ordered = out.with_name(out.name + ".regen.ordered.jsonl")
    order = _write_ordered(ordered, index, journal)
    try:
        report = tokenize_corpus(
            [ordered],
            out,
            tokenizer=spec.tokenizer,
            enable_thinking=spec.thinking,
            max_length=spec.max_length,
            overflow=spec.overflow,
            workers=spec.workers,
            strict=spec.strict,
            holdout=spec.holdout,
            progress=progress,
            force=True,
        )
    finally:
        ordered.unlink(missing_ok=True)
    report["sources"] = [str(s) for s in sources]
    report["regen_journal"] = str(journal.path)
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
    counts: RunCounts,
    client: ChatClient,
    corpus: dict[str, Any],
    resumed: int,
    regen_s: float,
    start: float,
) -> dict[str, Any]:
    final = RunCounts()
    for key in index.keys:
        if key in journal.records and key not in index.holdout:
            final.count(journal.records[key])
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


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="regen", unit="conv", disable=not enabled, dynamic_ncols=True)


# --------------------------------------------------------------------------- CLI support

IN_PROCESS_ONLY = frozenset(
    {"target", "batch_size", "limit", "device", "holdout_out"}
    | {f"tiny_{k}" for k in ("vocab", "layers", "hidden", "seed", "heads", "kv_heads")}
    | {"tiny_intermediate"}
)
SERVER_ONLY = frozenset(
    {"tokenizer", "model", "concurrency", "temperature", "max_tokens", "thinking", "retries"}
    | {"timeout_s", "max_length", "overflow", "workers", "strict"}
)
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


def check_regen_mode(src: list[Path], opts: dict[str, Any], given: set[str]) -> None:
    """One-line errors where the two regen modes' inputs differ."""
    if opts.get("server"):
        wrong = given & IN_PROCESS_ONLY
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
    wrong = given & SERVER_ONLY
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


def regen_command(src: list[Path], out: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """``dflash-train regen --server``: the spec from the CLI options, the run, the summary."""
    spec = ServerRegenSpec(
        url=opts["server"],
        tokenizer=opts["tokenizer"],
        model=opts["model"],
        concurrency=opts["concurrency"],
        temperature=opts["temperature"],
        max_tokens=opts["max_tokens"],
        thinking=opts["thinking"],
        retries=opts["retries"],
        timeout_s=opts["timeout_s"],
        holdout=opts["holdout"],
        max_length=opts["max_length"],
        overflow=opts["overflow"],
        workers=opts["workers"],
        strict=opts["strict"],
    )
    return regen_from_server(list(src), out, spec, progress=not opts["no_progress"])
