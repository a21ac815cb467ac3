"""The OpenAI-compatible chat-completions client: keep-alive connections, retries with
backoff that honours ``Retry-After``, replies parsed with their reasons."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from trainer.data.messages import MalformedRow, checked_text
from trainer.data.server.spec import ServerRegenSpec

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429})  # and every 5xx


class ServerUnavailable(ValueError):
    """The server does not answer (at start, or after all retries): the run stops."""


class Cancelled(Exception):
    """The client was closed (the run is stopping): this request is abandoned."""


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
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested too deeply
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
        finish = str(choice.get("finish_reason") or "unknown")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as e:
        raise RowFailed("bad_response", f"{type(e).__name__}: {_error_text(data)}") from e
    if not isinstance(content, str) or not isinstance(reasoning, str):
        kind = type(content if not isinstance(content, str) else reasoning).__name__
        raise RowFailed("bad_response", f"content is {kind}, not a string")
    try:
        checked_text(content + reasoning, "the reply")
    except MalformedRow as e:  # a lone surrogate: cannot be journaled or tokenized
        raise RowFailed("bad_response", e.detail) from None
    if thinking and reasoning:
        content = f"<think>\n{reasoning}\n</think>\n\n{content}"
    return Reply(content, finish, tokens)


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
        self._closed = threading.Event()
        self._open: set[Any] = set()  # every thread's connection, for close()
        self._open_lock = threading.Lock()

    def close(self) -> None:
        """Abandon every request in flight (their sockets shut down, backoff sleeps woken):
        the worker threads end at once with Cancelled. For a run that is stopping."""
        self._closed.set()
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            sock = getattr(conn, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

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
            return [str(m["id"]) for m in json.loads(data)["data"]]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
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
                self._closed.wait(self.backoff(attempt, wait_s))
            if self._closed.is_set():
                raise Cancelled("the run is stopping")
            self.stats.add(requests=1)
            try:
                status, resp_headers, data = self._send("POST", path, body, headers, None)
            except (OSError, http.client.HTTPException) as e:
                if self._closed.is_set():
                    raise Cancelled("the run is stopping") from e
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
            if self._closed.is_set():  # after _connection registered it: close() sees it or we do
                self._drop()
                raise Cancelled("the run is stopping")
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
        with self._open_lock:
            self._open.add(conn)
        return conn, False

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            with self._open_lock:
                self._open.discard(conn)
        self._local.conn = None
