"""A small OpenAI-compatible chat-completions server for tests, the demo and benchmarks.

Two backends:

* ``--model DIR``: a Hugging Face causal LM folder with its tokenizer (e.g. the tiny target
  saved by ``dflash-train save-target`` next to
  ``scripts/fixtures/tiny_chat.build_tokenizer``). Each request is rendered with the chat
  template and the generation prompt (``chat_template_kwargs`` such as
  ``{"enable_thinking": false}`` go to the template), generated greedily (temperature 0;
  sampling otherwise) by one generation thread that batches up to ``--batch`` waiting
  greedy requests (left-padded; default 1: one request at a time, exactly an unbatched
  call), cut at the first EOS and decoded as vLLM decodes
  (``skip_special_tokens``, no clean-up of spaces, and a reply whose text would end in an
  incomplete UTF-8 sequence, e.g. at the ``max_tokens`` cut, loses those trailing tokens
  instead of ending in U+FFFD: ``detokenize_like_vllm``).
* ``--fixed-delay S``: answers ``--fixed-text`` plus a digest of the request's messages
  (so a reply depends on its history only, never on arrival order) after ``S`` seconds.
  At most ``--max-concurrent`` requests are served at once and the rest wait: a server of
  known capacity (``max_concurrent / S`` requests/s), for the regen benchmark.

Endpoints: ``GET /v1/models``, ``GET /load`` (requests running and waiting),
``POST /v1/chat/completions`` (``messages``, ``max_tokens`` or
``max_completion_tokens``, ``temperature``, ``chat_template_kwargs``; the reply has
``choices[0].message.content``, ``finish_reason`` and ``usage``). Errors are JSON
``{"error": {"message", "type", "code"}}``: 400 for a bad body or field, 404 for an unknown
model or path, 503 (with ``Retry-After``) when more than ``--max-queue`` requests wait.

Test hooks: ``--fail-first K`` (the first K chat requests get ``--fail-status``, 503 by
default), ``--reject-containing TEXT`` (a request with TEXT in a message gets a permanent
400), ``--log-requests FILE`` (one JSON line per chat request: its ``X-Request-Id``, the
number of messages and the status).

``--parent-pid PID``: the server exits when process PID (the one that started it: the demo,
a test) does, even when that one is killed -9 (Linux: ``PR_SET_PDEATHSIG``; elsewhere, and
as a second check, a thread that watches the parent pid).

``python scripts/servers/chat_server.py --fixed-delay 0.05 --max-concurrent 32 --port 0`` prints one
line ``READY http://127.0.0.1:PORT`` once it listens (port 0 picks a free port).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_BODY = 64 << 20


class HTTPError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None


@dataclass
class Completion:
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def parse_request(body: bytes, default_max_tokens: int) -> ChatRequest:
    """A validated chat request; HTTPError(400) names the bad field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object")
    if data.get("stream"):
        raise HTTPError(400, "stream=true is not supported by this server")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"messages[{k}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise HTTPError(400, f"messages[{k}].content must be a string")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise HTTPError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    temperature = data.get("temperature", 1.0)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        raise HTTPError(400, f"'temperature' must be a number, got {temperature!r}")
    if temperature < 0:
        raise HTTPError(400, f"'temperature' must be >= 0, got {temperature}")
    kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise HTTPError(400, "'chat_template_kwargs' must be an object")
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    return ChatRequest(msgs, max_tokens, float(temperature), kwargs, data.get("model"))


class Capacity:
    """At most ``limit`` requests served at once; more than ``max_queue`` waiting -> 503."""

    def __init__(self, limit: int, max_queue: int, retry_after: float) -> None:
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self.max_queue, self.retry_after = max_queue, retry_after

    def load(self) -> dict[str, int]:
        """Requests being served and waiting for a slot (``GET /load``)."""
        with self._lock:
            return {"running": self._running, "waiting": self._waiting}

    def __enter__(self) -> Capacity:
        if self._slots.acquire(blocking=False):
            with self._lock:
                self._running += 1
            return self
        with self._lock:
            if self._waiting >= self.max_queue:
                raise HTTPError(503, "server overloaded, retry later", self.retry_after)
            self._waiting += 1
        try:
            self._slots.acquire()
        finally:
            with self._lock:
                self._waiting -= 1
        with self._lock:
            self._running += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
        self._slots.release()


class FixedBackend:
    """Answers a fixed text (plus a digest of the messages) after a fixed delay."""

    def __init__(self, delay: float, text: str) -> None:
        self.delay, self.text = delay, text

    def complete(self, req: ChatRequest) -> Completion:
        time.sleep(self.delay)
        digest = hashlib.sha256(json.dumps(req.messages).encode()).hexdigest()[:8]
        words = f"{self.text} {digest}".split()
        finish = "length" if len(words) > req.max_tokens else "stop"
        prompt = sum(len(m["content"].split()) for m in req.messages)
        content = " ".join(words[: req.max_tokens])
        return Completion(content, finish, prompt, min(len(words), req.max_tokens))


def detokenize_like_vllm(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    """The text vLLM returns for the generated ``ids`` (the EOS already cut off). vLLM
    detokenizes incrementally (its ``FastIncrementalDetokenizer`` steps ``tokenizers``'
    ``DecodeStream``; the slow path, ``detokenize_incrementally``, does the same): a token
    whose text so far ends in U+FFFD (an incomplete UTF-8 sequence, e.g. the first bytes of
    a multi-byte character cut at ``max_tokens``) adds nothing yet, and what is held back
    when the response ends is never sent. So: drop trailing tokens while the decoded text
    ends in U+FFFD. A U+FFFD inside the text (an invalid byte followed by more text) stays,
    as in vLLM."""
    keep = len(ids)
    text = decode(ids)
    while keep and text.endswith("\ufffd"):
        keep -= 1
        text = decode(ids[:keep])
    return text


@dataclass
class _Job:
    ids: list[int]
    req: ChatRequest
    done: threading.Event = field(default_factory=threading.Event)
    new: list[int] = field(default_factory=list)
    error: BaseException | None = None


class ModelBackend:
    """Greedy (or sampled) generation with a local Transformers model. One generation thread
    takes the requests waiting (up to ``batch`` greedy ones at once, left-padded into one
    ``generate``; a sampled request runs alone), as serving engines batch concurrent
    requests. ``batch=1`` generates each request exactly as an unbatched call would."""

    def __init__(
        self, model_dir: Path, max_context: int | None, threads: int | None, batch: int = 1
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        self.model.eval().requires_grad_(False)
        self.eos = self._eos_ids()
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_context = max_context or limit
        self.batch = batch
        self.jobs: queue.Queue[_Job] = queue.Queue()
        threading.Thread(target=self._generation_loop, daemon=True).start()

    def _decode(self, ids: list[int]) -> str:
        """The reply's text as vLLM's detokenizer sees it: the ``tokenizers`` backend's
        decode (no ``clean_up_tokenization_spaces``), special tokens skipped."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return str(backend.decode(ids, skip_special_tokens=True))
        return str(
            self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for value in (self.tok.eos_token_id, self.model.generation_config.eos_token_id):
            if value is not None:
                ids.update([value] if isinstance(value, int) else value)
        return sorted(ids)

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        try:
            text = self.tok.apply_chat_template(
                req.messages, tokenize=False, add_generation_prompt=True, **req.template_kwargs
            )
        except Exception as e:  # a template error is the request's fault
            raise HTTPError(400, f"chat template failed: {e}") from e
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def complete(self, req: ChatRequest) -> Completion:
        ids = self.prompt_ids(req)
        if self.max_context and len(ids) + req.max_tokens > self.max_context:
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the "
                f"request has {len(ids)} prompt tokens and max_tokens {req.max_tokens}",
            )
        job = _Job(ids, req)
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise HTTPError(500, f"generation failed: {job.error}")
        new = job.new
        stop = next((i for i, t in enumerate(new) if t in self.eos), None)
        kept = new if stop is None else new[:stop]
        content = detokenize_like_vllm(self._decode, kept)
        finish = "length" if stop is None else "stop"
        used = len(new) if stop is None else stop + 1
        return Completion(content, finish, len(ids), used)

    def _generation_loop(self) -> None:
        while True:
            group = [self.jobs.get()]
            while group[0].req.temperature == 0 and len(group) < self.batch:
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt.req.temperature != 0:  # sampled requests run alone
                    self.jobs.put(nxt)
                    break
                group.append(nxt)
            try:
                news = self._generate(group)
                for job, new in zip(group, news, strict=True):
                    job.new = new[: job.req.max_tokens]
            except Exception as e:  # reported to each waiting request as a 500
                for job in group:
                    job.error = e
            for job in group:
                job.done.set()

    def _generate(self, group: list[_Job]) -> list[list[int]]:
        torch = self.torch
        width = max(len(j.ids) for j in group)
        x = torch.full((len(group), width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(x)
        for r, job in enumerate(group):
            x[r, width - len(job.ids) :] = torch.tensor(job.ids)
            attn[r, width - len(job.ids) :] = 1
        req = group[0].req
        sample = req.temperature > 0
        extra = {"temperature": req.temperature} if sample else {}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=x,
                attention_mask=attn,
                max_new_tokens=max(j.req.max_tokens for j in group),
                do_sample=sample,
                eos_token_id=self.eos or None,
                pad_token_id=self.pad,
                **extra,
            )
        return out[:, width:].tolist()


class Hooks:
    """Test hooks: fail the first K requests, reject marked ones, log every request."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.fail_left = args.fail_first
        self.fail_status = args.fail_status
        self.reject = args.reject_containing
        self.lock = threading.Lock()
        self.log = open(args.log_requests, "a") if args.log_requests else None  # noqa: SIM115

    def before(self, req: ChatRequest) -> None:
        with self.lock:
            fail = self.fail_left > 0
            self.fail_left -= fail
        if fail:
            raise HTTPError(self.fail_status, "injected failure (--fail-first)", 0.0)
        if self.reject and any(self.reject in m["content"] for m in req.messages):
            raise HTTPError(400, f"rejected: a message contains {self.reject!r}")

    def record(self, request_id: str, n_messages: int, status: int) -> None:
        if self.log is None:
            return
        line = json.dumps({"id": request_id, "messages": n_messages, "status": status})
        with self.lock:
            self.log.write(line + "\n")
            self.log.flush()


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], args: argparse.Namespace, backend: Any) -> None:
        super().__init__(addr, Handler)
        self.backend = backend
        self.model_name = args.served_model_name
        self.default_max_tokens = args.default_max_tokens
        self.capacity = Capacity(args.max_concurrent, args.max_queue, args.retry_after)
        self.hooks = Hooks(args)
        self.verbose = args.verbose


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed ACK
    server: ChatServer

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(fmt, *args)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/load":
            return self._json(200, self.server.capacity.load())
        if self.path.rstrip("/") != "/v1/models":
            return self._error(HTTPError(404, f"no route GET {self.path}"))
        model = {"id": self.server.model_name, "object": "model", "owned_by": "dflash-loader"}
        self._json(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        body = self._body()
        if body is None:
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._error(HTTPError(404, f"no route POST {self.path}"))
        request_id = self.headers.get("X-Request-Id", "")
        n_messages = -1
        try:
            req = parse_request(body, self.server.default_max_tokens)
            n_messages = len(req.messages)
            self._check_model(req.model)
            self.server.hooks.before(req)
            with self.server.capacity:
                done = self.server.backend.complete(req)
        except HTTPError as e:
            self.server.hooks.record(request_id, n_messages, e.status)
            return self._error(e)
        self.server.hooks.record(request_id, n_messages, 200)
        self._json(200, self._response(done))

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.server.model_name):
            raise HTTPError(404, f"The model `{model}` does not exist.")

    def _response(self, done: Completion) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.server.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done.content},
                    "finish_reason": done.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            },
        }

    def _body(self) -> bytes | None:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self._error(HTTPError(400, "missing or bad Content-Length"))
            self.close_connection = True
            return None
        return self.rfile.read(n)

    def _error(self, e: HTTPError) -> None:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        headers = {} if e.retry_after is None else {"Retry-After": f"{e.retry_after:g}"}
        error = {"message": e.message, "type": kind, "code": e.status}
        self._json(e.status, {"error": error}, headers)

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend = p.add_mutually_exclusive_group(required=True)
    backend.add_argument("--model", type=Path, help="HF model folder with its tokenizer.")
    backend.add_argument("--fixed-delay", type=float, help="Seconds per request (fixed text).")
    p.add_argument("--fixed-text", default="This is a regenerated reply.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: pick a free port.")
    p.add_argument("--served-model-name", help="Name in /v1/models [model folder name].")
    p.add_argument("--max-concurrent", type=int, default=1, help="Requests served at once.")
    p.add_argument("--max-queue", type=int, default=4096, help="Waiting requests before 503.")
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After of a 503.")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-context", type=int, help="--model: prompt + max_tokens limit.")
    p.add_argument("--threads", type=int, help="--model: torch threads.")
    p.add_argument("--batch", type=int, default=1, help="--model: requests generated at once.")
    p.add_argument("--fail-first", type=int, default=0, help="First K requests fail.")
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--reject-containing", help="Requests with this text get a 400.")
    p.add_argument("--log-requests", type=Path, help="JSONL: id, messages, status.")
    p.add_argument("-v", "--verbose", action="store_true", help="Log every request.")
    p.add_argument("--parent-pid", type=int, help="Exit when this process exits.")
    args = p.parse_args(argv)
    if args.served_model_name is None:
        args.served_model_name = args.model.name if args.model else "fixed"
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if args.max_concurrent < 1 or (args.fixed_delay is not None and args.fixed_delay < 0):
        p.error("--max-concurrent must be >= 1 and --fixed-delay >= 0")
    return args


def die_with_parent(parent: int) -> None:
    """End this process (SIGTERM) when ``parent`` ends, however it ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it is gone already (before the prctl)
        os._exit(1)

    def watch() -> None:  # where PR_SET_PDEATHSIG is not, or fires on a thread's exit only
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@contextlib.contextmanager
def running(args: Sequence[str], log: Path, *, python: str = sys.executable) -> Iterator[str]:
    """This server as a subprocess started with ``args``, its stderr in ``log``: yields its
    URL (from its READY line). It dies with the caller, even on ``kill -9``
    (``--parent-pid``), and is stopped with SIGTERM (SIGKILL after 30 s) when the block
    ends. The demo, ``serve_check`` and the tests start it through here."""
    cmd = [python, str(Path(__file__).resolve()), *args, "--parent-pid", str(os.getpid())]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY "):
            proc.wait(30)
            raise RuntimeError(
                f"chat_server.py did not start: {log.read_text(errors='replace')[-2000:]}"
            )
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    if args.model is not None:
        if args.max_concurrent != 1:
            print("--model: --batch sets the requests served at once", file=sys.stderr)
        args.max_concurrent = args.batch
        backend: Any = ModelBackend(args.model, args.max_context, args.threads, args.batch)
    else:
        backend = FixedBackend(args.fixed_delay, args.fixed_text)
    server = ChatServer((args.host, args.port), args, backend)
    host, port = server.server_address[:2]
    print(f"READY http://{host!s}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
