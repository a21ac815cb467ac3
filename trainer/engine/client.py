"""Requests to the engine: one document per request, its hidden states read from the file
the server wrote, checked, and removed.

vLLM's OpenAI server returns only the first prompt's ``kv_transfer_params`` of a request,
so each document is its own ``POST /v1/completions`` (token ids in, ``max_tokens`` 1: the
prompt's forward is all that is needed). The reply names a safetensors file
(``hidden_states [T, n, H]``, ``token_ids [T]``) that the server's connector writes after it
answers; the client waits on the file's ``.lock`` (a shared ``flock`` against the writer's
exclusive one), reads it, checks that its token ids are the document's and its shape the
one asked for, and deletes the file and its lock. A state is never wrong or missing: a
file that cannot be read (a server killed while writing it) is asked for again.

Request ids are ``dflash-TAG-rRANK-PID-N`` (``X-Request-Id``; vLLM names the file
``cmpl-ID-0-RANDOM.safetensors``): files of this run and rank that an earlier process left
(killed with requests in flight) are removed when the first reply shows the folder, and
every file of this run and rank once the client closes.

A server that stops answering (killed, restarting) is waited for: one warning line, then
the same request again every second or two until ``timeout_s`` has passed without an
answer, then ``EngineError`` (a ``LoaderError``: the run stops after a final checkpoint and
``--resume`` continues where it stopped). Once a server that was not listening answers
again, the temporary files its killed process left half written (safetensors' ``.tmp*``)
are removed (``sweep_orphans``). A server the trainer started and that exited is
an ``EngineError`` at once, with its log. A refusal (HTTP 4xx: a document longer than the
server's context) is one at once too, naming the document.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import itertools
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from loader_server.wire.protocol import LoaderError

log = logging.getLogger(__name__)

#: Seconds between tries while the server does not answer (doubling up to the second).
RETRY_S = (0.5, 2.0)
#: How long a closing client still waits for a file being written (then it gives it up).
CLOSE_GRACE_S = 10.0


class EngineError(LoaderError):
    """The engine stayed away past its timeout, refused a document, or returned states
    that are not the document's."""


def request_prefix(tag: str, rank: int) -> str:
    """The ``X-Request-Id`` prefix of this run's rank (``tag``: the run's)."""
    return f"dflash-{tag}-r{rank}"


class StateClient:
    """Hidden states of token-id documents from a vLLM server at ``url``.

    ``submit(ids)`` returns a future of the states ``[T, n, H]`` (the engine's layer order,
    the file's dtype); at most ``inflight`` requests run at once. ``states_dir``: where this
    machine reads the files (None: where the server says it wrote them). ``alive``: for a
    server this process started, None while it runs, else what to say about its end.
    ``num_states``/``hidden_size``: the ``[n, H]`` every file must have.
    """

    def __init__(
        self, url: str, *, tag: str, rank: int, num_states: int, hidden_size: int,
        inflight: int = 32, timeout_s: float = 300.0, states_dir: Path | None = None,
        alive: Callable[[], str | None] | None = None,
    ) -> None:  # fmt: skip
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        self.url, self.timeout_s, self.states_dir = url.rstrip("/"), timeout_s, states_dir
        self.num_states, self.hidden_size = num_states, hidden_size
        self.inflight, self._alive = inflight, alive
        self.prefix = request_prefix(tag, rank)
        self._ids = itertools.count()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._outage = False  # warned that the server does not answer
        self._gone_since: float | None = None  # wall time no server was first listening
        self._swept: Path | None = None  # the folder stale files were removed from
        self._closing = 0.0  # when close() began (0: not yet): nothing is retried then
        self.asked = 0  # documents submitted
        self.retries = 0  # tries that found no server, or a file that could not be read
        self._pool = ThreadPoolExecutor(inflight, thread_name_prefix="engine")
        self.model, self.max_model_len = self._served_model()

    # ---- the public side ---------------------------------------------------------------

    def submit(self, ids: torch.Tensor, what: str = "a document") -> Future[torch.Tensor]:
        """The states of the token ids ``ids [T]``, in a worker thread; ``what`` names the
        document in errors (``sample 17 of epoch 0 step 3``)."""
        n = int(ids.numel())
        if self.max_model_len is not None and n > self.max_model_len - 1:
            refused: Future[torch.Tensor] = Future()  # raised when its micro-batch is reached
            refused.set_exception(EngineError(
                f"{what} has {n} tokens; the server at {self.url} takes prompts of at most "
                f"{self.max_model_len - 1} (its --max-model-len {self.max_model_len} less "
                "the one token it generates): serve the target with a longer --max-model-len, "
                "or give the loader a --max-seq-len that fits"
            ))  # fmt: skip
            return refused
        tokens = [int(t) for t in ids.tolist()]
        self.asked += 1
        return self._pool.submit(self._states, tokens, what)

    def close(self) -> None:
        """Let the requests in flight finish (each removes its file; one the server does
        not answer is given up at once, not retried: a server a peer rank started may be
        stopping), then remove every file of this run and rank still in the folder."""
        self._closing = time.monotonic()
        self._pool.shutdown(wait=True, cancel_futures=True)
        folder = self._swept or self.states_dir
        if folder is not None and folder.is_dir():
            self._sweep(folder, everyone=True)

    # ---- one document ------------------------------------------------------------------

    def _states(self, tokens: list[int], what: str) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        while True:
            path = self._request(tokens, what, deadline)
            try:
                lock = open(str(path) + ".lock")  # noqa: SIM115 (closed below)
            except FileNotFoundError:
                # The server makes the lock before it replies: none means another folder.
                raise EngineError(
                    f"{self.url} wrote {what}'s states to {path.name}, which is not in "
                    f"{path.parent} here: give --engine-dir, the folder where this machine "
                    "sees the server's shared_storage_path"
                ) from None
            try:
                states = self._read(path, lock, deadline)
            except EngineError:
                self._drop(path)
                raise
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # killed mid-write
                self._drop(path)
                self._wait(f"its states file {path} could not be read ({e})", deadline)
                continue
            self._drop(path)
            self._check(states, tokens, what, path)
            return states["hidden_states"]

    def _request(self, tokens: list[int], what: str, deadline: float) -> Path:
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        data = json.dumps(body).encode()
        while True:
            req_id = f"{self.prefix}-{self._pid}-{next(self._ids)}"
            headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
            request = urllib.request.Request(self.url + "/v1/completions", data, headers)
            try:
                with urllib.request.urlopen(request, timeout=max(self.timeout_s, 30.0)) as r:
                    reply = json.loads(r.read())
            except urllib.error.HTTPError as e:
                text = e.read()[:300].decode(errors="replace")
                if e.code < 500 and e.code not in (408, 429):
                    raise EngineError(
                        f"{self.url} refused {what} ({len(tokens)} tokens): HTTP {e.code}: {text}"
                    ) from None
                self._wait(f"HTTP {e.code}: {text}", deadline)
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
                # no server, a reply cut short (killed mid-body), or one that is not JSON
                why = str(getattr(e, "reason", e)) or type(e).__name__
                self._wait(why, deadline, gone=_no_server(e))
                continue
            self._answering()
            params = reply.get("kv_transfer_params") or {}
            path = params.get("hidden_states_path")
            if not path:
                raise EngineError(
                    f"{self.url} returned no hidden-states file for {what}: is it serving with "
                    "the extract_hidden_states method and the DFlash connector? (its flags: "
                    "docs/TRAINER.md, 'Targets served by vLLM')"
                )
            return self._local(Path(path))

    def _local(self, path: Path) -> Path:
        """Where this machine reads the file the server named (``states_dir``), and the
        first time, the files an earlier process of this rank left there removed."""
        local = path if self.states_dir is None else self.states_dir / path.name
        if self._swept is None:
            with self._lock:
                if self._swept is None:
                    self._swept = local.parent
                    self._sweep(local.parent, everyone=False)
        return local

    def _read(self, path: Path, lock: Any, deadline: float) -> dict[str, torch.Tensor]:
        """The file, once its writer let go of its lock (it holds ``LOCK_EX`` until the
        file is whole, which takes milliseconds); a writer stuck past the deadline (past
        ``CLOSE_GRACE_S`` once the client is closing) is an ``EngineError``. A missing
        file (the server died before writing it) is an ``OSError``: asked for again."""
        from safetensors.torch import load_file

        with lock:
            for k in itertools.count():
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._closing and time.monotonic() > self._closing + CLOSE_GRACE_S:
                        raise EngineError(f"{path}: not written yet (closing)") from None
                    if time.monotonic() > deadline:
                        raise EngineError(
                            f"{path}: the server has been writing it for more than "
                            f"{self.timeout_s:.0f} s (--engine-timeout-s)"
                        ) from None
                    time.sleep(min(0.0002 * 2**k, 0.02))  # usually written within ms
            return load_file(str(path), device="cpu")

    def _check(self, states: dict[str, Any], tokens: list[int], what: str, path: Path) -> None:
        ids, hs = states.get("token_ids"), states.get("hidden_states")
        if ids is None or hs is None:
            raise EngineError(f"{path}: no hidden_states or token_ids in the file for {what}")
        if ids.tolist() != tokens:
            raise EngineError(
                f"{path}: the engine returned states for other tokens than {what}'s "
                f"({ids.numel()} ids, {len(tokens)} asked for): refusing a wrong feature"
            )
        want = (len(tokens), self.num_states, self.hidden_size)
        if tuple(hs.shape) != want:
            raise EngineError(
                f"{path}: states of shape {tuple(hs.shape)} for {what}, expected {want}: the "
                f"server must extract {self.num_states} layers of a {self.hidden_size}-wide "
                "target (eagle_aux_hidden_state_layer_ids: docs/TRAINER.md)"
            )

    # ---- a server that does not answer -------------------------------------------------

    def _wait(self, reason: str, deadline: float, *, gone: bool = False) -> None:
        """Back off before the next try; EngineError once the server is gone for good.
        ``gone``: no server took the connection (not a busy one's refusal)."""
        ended = self._alive() if self._alive is not None else None
        if ended is not None:
            raise EngineError(f"{self.url}: {ended}")
        if self._closing:
            raise EngineError(f"{self.url}: {reason} (closing: not retried)")
        with self._lock:
            self.retries += 1
            if gone and self._gone_since is None:
                self._gone_since = time.time()
            if not self._outage:
                self._outage = True
                log.warning(
                    "engine %s is not answering (%s): retrying for up to %.0f s",
                    self.url, reason, self.timeout_s,
                )  # fmt: skip
        if time.monotonic() > deadline:
            raise EngineError(
                f"{self.url}: no answer for {self.timeout_s:.0f} s (--engine-timeout-s; last: "
                f"{reason})"
            )
        time.sleep(RETRY_S[0] if self.retries < 4 else RETRY_S[1])

    def _answering(self) -> None:
        if self._outage:
            with self._lock:
                if self._outage:
                    self._outage = False
                    log.warning("engine %s is answering again", self.url)
                    gone, self._gone_since = self._gone_since, None
                    folder = self._swept or self.states_dir
                    if gone is not None and folder is not None:
                        sweep_orphans(folder, gone)

    def _served_model(self) -> tuple[str, int | None]:
        """The model name the server serves and its context length (``/v1/models``),
        waited for as any request is."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
                    models = json.loads(r.read())["data"]
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                self._wait(str(getattr(e, "reason", e)), deadline, gone=_no_server(e))
            except (KeyError, ValueError) as e:
                raise EngineError(f"{self.url}/v1/models: not a vLLM answer ({e})") from None
        self._answering()
        if not models:
            raise EngineError(f"{self.url} serves no model")
        first = models[0]
        limit = first.get("max_model_len")
        return str(first["id"]), None if limit is None else int(limit)

    # ---- files -------------------------------------------------------------------------

    def _drop(self, path: Path) -> None:
        for p in (path, Path(str(path) + ".lock")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _sweep(self, folder: Path, *, everyone: bool) -> None:
        """Remove this run and rank's files in ``folder``: those of earlier processes, or
        (``everyone``) all of them."""
        mine = f"cmpl-{self.prefix}-{self._pid}-"
        removed = 0
        for p in folder.glob(f"cmpl-{self.prefix}-*"):
            if everyone or not p.name.startswith(mine):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
        if removed:
            log.info("removed %d hidden-state files left in %s", removed, folder)


def _no_server(e: BaseException) -> bool:
    """The connection was refused or cut: no process serves (a busy server's 503 or a
    timeout is not that)."""
    return isinstance(getattr(e, "reason", e), (ConnectionRefusedError, ConnectionResetError))


#: How safetensors (0.8, whose ``save_file`` vLLM's connector calls) names the file it
#: writes before renaming it to the one asked for.
WRITER_TEMP = ".tmp*"


def sweep_orphans(folder: Path, before: float) -> int:
    """Remove the writer's temporary files in ``folder`` last written before ``before``
    (wall time): a server killed mid-write leaves one, under a name no request can claim
    (a document's states, up to hundreds of MB in ``/dev/shm``). Called once a server that
    was not listening answers again, with the moment it was first found gone: a file
    untouched since then is the dead process's, and the new one writes after it."""
    removed = 0
    for p in folder.glob(WRITER_TEMP):
        with contextlib.suppress(FileNotFoundError):
            if p.is_file() and p.stat().st_mtime < before:
                p.unlink()
                removed += 1
    if removed:
        log.warning("removed %d file(s) a killed server left half written in %s", removed, folder)
    return removed
