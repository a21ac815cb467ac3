"""Requests to the engine: one document per request, its hidden states read from the file
the server wrote, checked, and removed.

vLLM's OpenAI server returns only the first prompt's ``kv_transfer_params`` of a request,
so each document is its own ``POST /v1/completions`` (token ids in, ``max_tokens`` 1: the
prompt's forward is all that is needed). The reply names a safetensors file
(``hidden_states [T, n, H]``, ``token_ids [T]``) that the server's connector writes after it
answers; the client waits on the file's ``.lock`` (a shared ``flock`` against the writer's
exclusive one), reads it, checks it and deletes it and its lock.

What is trusted (``trainer.engine.folders``): the folder must be the run's own or one that
others cannot write to; the file a reply names must be its request's own name in that
folder, and a regular file. What is checked (``check_states``): the token ids are the
document's, the shape the one asked for, the dtype the engine's (the first document's when
the run does not know it), every value finite. Each refusal names the document.

Request ids are ``dflash-RUN-INC-rRANK-N`` (``X-Request-Id``; vLLM names the file
``cmpl-ID-0-RANDOM.safetensors``): ``RUN`` is the run's own random id (kept in its run
folder: a resumed run has it again, another run never), ``INC`` this start of the job (every
rank has rank 0's). So what a run removes is exactly what its requests wrote: once the
folder is known, every file of this run from an earlier start (a killed trainer, ranks gone
in an elastic shrink, a server killed mid-write: its ``.part``); on closing, this start's
files of this rank. Files of other runs sharing the server and folder are never touched.

Waits, each bounded and named: a server that stops answering (killed, restarting) is
waited for, one warning line, then the same request again with a backoff that starts anew
with each outage, until ``timeout_s`` has passed, then ``EngineError`` (a ``LoaderError``:
the run stops after a final checkpoint and ``--resume`` continues). A server that answers
but cannot be the engine (``trainer.engine.http``) is an ``EngineError`` at once, as is a
server the trainer started that exited (with the line that says why). The caller waits for
a document with ``result``, which gives up ``STUCK_S`` past the request's own deadline
(a read that hangs in the kernel on a dead mount), naming what the request was doing; the
workers are daemon threads, so such a request cannot hold the process either, and
``close`` waits ``CLOSE_GRACE_S`` at most.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from client.backoff import Backoff
from trainer.engine import folders
from trainer.engine.errors import EngineError
from trainer.engine.http import Busy, Gone, exchange

__all__ = ["EngineError", "StateClient", "check_states", "request_prefix"]

log = logging.getLogger(__name__)

#: The backoff between tries while the server does not answer: from 0.5 s up to 2 s.
RETRY_S = (0.5, 2.0)
#: How long a closing client still waits for requests in flight (then it leaves them).
CLOSE_GRACE_S = 10.0
#: How far past its own deadline a request may run before ``result`` gives up on it.
STUCK_S = 30.0


def request_prefix(run: str, rank: int) -> str:
    """The ``X-Request-Id`` prefix of this rank of a run's start (``run``: ``RUN-INC``)."""
    return f"dflash-{run}-r{rank}"


@dataclass
class _Request:
    """A document's request, as far as it got (``stage``, for a message if it hangs)."""

    what: str
    tokens: list[int]
    submitted: float = field(default_factory=time.monotonic)
    began: float | None = None
    stage: str = "waiting for a free worker"


class StateClient:
    """Hidden states of token-id documents from a vLLM server at ``url``.

    ``submit(ids)`` returns a future of the states ``[T, n, H]`` (the engine's layer order
    and dtype) and ``result(future)`` waits for it, bounded; at most ``inflight`` requests
    run at once. ``run``: this start of the run (``RUN-INC``, ``trainer.engine.side``);
    ``states_dir``: where this machine reads the files (None: where the server says, the
    first reply's folder, checked). ``alive``: for a server this run started, None while it
    runs, else what to say about its end. ``num_states``/``hidden_size``: the ``[n, H]``
    every file must have; ``dtype``: the engine's (None: the first document's);
    ``target``: the run's target folder, to compare the served model with.
    """

    def __init__(
        self, url: str, *, run: str, rank: int, num_states: int, hidden_size: int,
        inflight: int = 32, timeout_s: float = 300.0, states_dir: Path | None = None,
        alive: Callable[[], str | None] | None = None, dtype: torch.dtype | None = None,
        target: Path | None = None,
    ) -> None:  # fmt: skip
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.num_states, self.hidden_size, self.dtype = num_states, hidden_size, dtype
        self.inflight, self._alive = inflight, alive
        self.run, self.run_id = run, run.rsplit("-", 1)[0]
        self.prefix = request_prefix(run, rank)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._outage = False  # warned that the server does not answer
        self._closing = 0.0  # when close() began (0: not yet): nothing is retried then
        self.folder: Path | None = None  # where the files are, once known and checked
        self.asked = 0  # documents submitted
        self.retries = 0  # tries that found no server, or a file that could not be read
        self.waits: list[float] = []  # the backoff's waits, in order (how outages went)
        self._requests: dict[Future[torch.Tensor], _Request] = {}
        self._queue: queue.SimpleQueue[tuple[Future[torch.Tensor], _Request] | None] = (
            queue.SimpleQueue()
        )
        self._workers = [
            threading.Thread(target=self._work, name=f"engine-{k}", daemon=True)
            for k in range(inflight)
        ]
        for w in self._workers:
            w.start()
        if states_dir is not None:
            self._adopt(Path(states_dir))
        self.model, self.max_model_len = self._served_model(target)

    # ---- the public side ---------------------------------------------------------------

    def submit(self, ids: torch.Tensor, what: str = "a document") -> Future[torch.Tensor]:
        """The states of the token ids ``ids [T]``, in a worker thread; ``what`` names the
        document in errors (``sample 17 of epoch 0 step 3``)."""
        n = int(ids.numel())
        future: Future[torch.Tensor] = Future()
        if self.max_model_len is not None and n > self.max_model_len - 1:
            future.set_exception(EngineError(
                f"{what} has {n} tokens; the server at {self.url} takes prompts of at most "
                f"{self.max_model_len - 1} (its --max-model-len {self.max_model_len} less "
                "the one token it generates): serve the target with a longer --max-model-len, "
                "or give the loader a --max-seq-len that fits"
            ))  # fmt: skip
            return future  # raised when its micro-batch is reached
        request = _Request(what, [int(t) for t in ids.tolist()])
        with self._lock:
            self._requests[future] = request
        future.add_done_callback(self._forget)
        self.asked += 1
        self._queue.put((future, request))
        return future

    def result(self, future: Future[torch.Tensor]) -> torch.Tensor:
        """``future``'s states, waited for at most ``STUCK_S`` past its request's deadline;
        then ``EngineError`` naming the document and what its request was doing."""
        request = self._requests.get(future)
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if request is None:
                    continue
                began = request.began if request.began is not None else request.submitted
                if time.monotonic() > began + self.timeout_s + STUCK_S:
                    raise EngineError(
                        f"{request.what}: its request has been {request.stage} for "
                        f"{time.monotonic() - began:.0f} s (--engine-timeout-s "
                        f"{self.timeout_s:.0f}, and {STUCK_S:.0f} s more): a server or a "
                        "mount that hangs; the run stops"
                    ) from None

    def close(self) -> None:
        """Let the requests in flight finish, ``CLOSE_GRACE_S`` at most (each removes its
        file; one the server does not answer is given up at once, not retried: a server a
        peer rank started may be stopping), then remove this rank's files of this start."""
        self._closing = time.monotonic()
        with self._lock:
            pending = list(self._requests)
        for future in pending:
            future.cancel()  # those no worker has begun
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join(max(0.0, self._closing + CLOSE_GRACE_S - time.monotonic()))
        hung = [w for w in self._workers if w.is_alive()]
        if hung:
            log.warning("engine client: %d request(s) still hang after %.0f s; left behind "
                        "(their files, if ever written, are removed by the next start)",
                        len(hung), CLOSE_GRACE_S)  # fmt: skip
        if self.folder is not None:
            self._sweep(f"cmpl-{self.prefix}-", keep=None)

    # ---- one document ------------------------------------------------------------------

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, request = item
            if not future.set_running_or_notify_cancel():
                continue
            request.began = time.monotonic()
            try:
                future.set_result(self._states(request))
            except BaseException as e:  # raised on the consumer's thread by result()
                future.set_exception(e)

    def _forget(self, future: Future[torch.Tensor]) -> None:
        with self._lock:
            self._requests.pop(future, None)

    def _states(self, request: _Request) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff(*RETRY_S, jitter=0.25)  # per document: every outage starts anew
        while True:
            path = self._request(request, deadline, backoff)
            try:
                states = self._read(path, request, deadline)
            except FileNotFoundError:
                if not Path(str(path) + ".lock").exists() and not path.exists():
                    # The server makes the lock before it replies: none means another folder.
                    raise EngineError(
                        f"{self.url} wrote {request.what}'s states to {path.name}, which is "
                        f"not in {path.parent} here: give --engine-dir, the folder where this "
                        "machine sees the server's shared_storage_path"
                    ) from None
                self._drop(path)
                self._wait("its states file was never written", deadline, backoff)
                continue
            except EngineError:
                self._drop(path)
                raise
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # killed mid-write
                self._drop(path)
                self._wait(f"its states file {path} could not be read ({e})", deadline, backoff)
                continue
            self._drop(path)
            request.stage = "checking its states"
            hs = check_states(states, request.tokens, request.what, path, self._expect())
            if self.dtype is None:  # the engine's, from its first document on
                self.dtype = hs.dtype
            return hs

    def _request(self, request: _Request, deadline: float, backoff: Backoff) -> Path:
        body = {"model": self.model, "prompt": request.tokens, "max_tokens": 1,
                "temperature": 0.0}  # fmt: skip
        while True:
            req_id = f"{self.prefix}-{next(self._ids)}"
            request.stage = f"waiting for {self.url} to answer request {req_id}"
            try:
                left = max(1.0, deadline - time.monotonic())  # the socket's wait: bounded
                reply = exchange(self.url + "/v1/completions", body, left,
                                 {"X-Request-Id": req_id})  # fmt: skip
            except EngineError as e:
                raise EngineError(f"{request.what} ({len(request.tokens)} tokens): {e}") from None
            except (Gone, Busy) as e:
                self._wait(str(e), deadline, backoff, gone=isinstance(e, Gone))
                continue
            self._answering()
            params = (reply.get("kv_transfer_params") if isinstance(reply, dict) else None) or {}
            named = params.get("hidden_states_path")
            if not named:
                raise EngineError(
                    f"{self.url} returned no hidden-states file for {request.what}: is it "
                    "serving with the extract_hidden_states method and the DFlash connector? "
                    "(its flags: docs/TRAINER.md, 'Targets served by vLLM')"
                )
            return self._local(str(named), req_id, request.what)

    def _local(self, named: str, req_id: str, what: str) -> Path:
        """Where this machine reads the file the server named: its request's own name, in
        the folder (``states_dir``, else the folder of the server's first reply, checked
        then; a later reply naming another folder is refused)."""
        path = folders.request_file(named, self.folder, req_id, self.url, what)
        if self.folder is None:
            with self._lock:
                if self.folder is None:
                    self._adopt(path.parent)
        if os.path.realpath(path.parent) != os.path.realpath(self.folder or path.parent):
            raise EngineError(
                f"{self.url} named {named!r} for {what}, outside the folder it wrote to "
                f"before ({self.folder}): refusing to read or remove it"
            )
        return path

    def _adopt(self, folder: Path) -> None:
        """Take ``folder`` as where the files are (if others cannot write to it), and remove
        what this run's earlier starts left there."""
        self.folder = folders.shared_folder(folder)
        self._sweep(f"cmpl-dflash-{self.run_id}-", keep=f"cmpl-dflash-{self.run}-")

    def _read(self, path: Path, request: _Request, deadline: float) -> dict[str, Any]:
        """The file, once its writer let go of its lock (it holds ``LOCK_EX`` until the
        file is whole, which takes milliseconds); a writer stuck past the deadline (past
        ``CLOSE_GRACE_S`` once the client is closing) is an ``EngineError``. A missing
        file (the server died before writing it) is a ``FileNotFoundError``."""
        import fcntl

        from safetensors.torch import load_file

        request.stage = f"waiting for {path} to be written"
        with folders.open_regular(Path(str(path) + ".lock"), "the states' lock file") as lock:
            for k in itertools.count():
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._closing and time.monotonic() > self._closing + CLOSE_GRACE_S:
                        raise EngineError(f"{path}: not written yet (closing)") from None
                    if time.monotonic() > deadline:
                        raise EngineError(
                            f"{path}: the server has been writing {request.what}'s states for "
                            f"more than {self.timeout_s:.0f} s (--engine-timeout-s)"
                        ) from None
                    time.sleep(min(0.0002 * 2**k, 0.02))  # usually written within ms
            request.stage = f"reading {path}"
            with folders.open_regular(path, f"the states file of {request.what}") as fd:
                return dict(load_file(f"/proc/self/fd/{fd}", device="cpu"))

    def _expect(self) -> tuple[int, int, torch.dtype | None]:
        return self.num_states, self.hidden_size, self.dtype

    # ---- a server that does not answer -------------------------------------------------

    def _wait(self, reason: str, deadline: float, backoff: Backoff, *, gone: bool = False) -> None:
        """Back off before the next try; EngineError once the server is gone for good.
        ``gone``: no server took the connection (not a busy one's refusal)."""
        ended = self._alive() if self._alive is not None else None
        if ended is not None:
            raise EngineError(f"{self.url}: {ended}")
        if self._closing:
            raise EngineError(f"{reason} (closing: not retried)")
        wait = backoff.next_wait()
        with self._lock:
            self.retries += 1
            self.waits.append(wait)
            if not self._outage:
                self._outage = True
                log.warning("engine %s is not answering (%s): retrying for up to %.0f s",
                            self.url, reason, self.timeout_s)  # fmt: skip
        if time.monotonic() + wait > deadline:
            raise EngineError(
                f"{self.url}: no answer for {self.timeout_s:.0f} s (--engine-timeout-s; last: "
                f"{reason})"
            )
        time.sleep(wait)

    def _answering(self) -> None:
        if self._outage:
            with self._lock:
                if self._outage:
                    self._outage = False
                    log.warning("engine %s is answering again", self.url)

    def _served_model(self, target: Path | None) -> tuple[str, int | None]:
        """The model name the server serves and its context length (``/v1/models``),
        waited for as any request is; another model than ``target`` is refused."""
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff(*RETRY_S, jitter=0.25)
        while True:
            try:
                left = max(1.0, min(30.0, deadline - time.monotonic()))
                reply = exchange(self.url + "/v1/models", None, left)
                break
            except (Gone, Busy) as e:
                self._wait(str(e), deadline, backoff, gone=isinstance(e, Gone))
        self._answering()
        models = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(models, list):
            raise EngineError(f"{self.url}/v1/models: not a vLLM answer ({str(reply)[:200]})")
        if not models:
            raise EngineError(f"{self.url} serves no model")
        first = models[0]
        if target is not None:
            check_served_model(self.url, first, Path(target))
        limit = first.get("max_model_len")
        return str(first["id"]), None if limit is None else int(limit)

    # ---- files -------------------------------------------------------------------------

    def _drop(self, path: Path) -> None:
        """Remove a request's file, its lock and what a killed writer left of it."""
        for p in (path, Path(str(path) + ".lock"), Path(str(path) + ".part")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _sweep(self, prefix: str, keep: str | None) -> None:
        """Remove the files in the folder whose names start with ``prefix`` (the run's own
        request ids), but those starting with ``keep``."""
        assert self.folder is not None
        removed = 0
        with os.scandir(self.folder) as entries:
            for entry in entries:
                name = entry.name
                if not name.startswith(prefix) or (keep and name.startswith(keep)):
                    continue
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        if removed:
            log.info("removed %d hidden-state file(s) this run left in %s", removed, self.folder)


def check_served_model(url: str, model: dict[str, Any], target: Path) -> None:
    """The model a server serves (``/v1/models``' entry) must be the run's target: where
    its ``root`` is a folder here, their shapes must agree; elsewhere its name is compared,
    and a different one said in a warning (it cannot be checked from here)."""
    import json

    root = str(model.get("root") or model.get("id") or "")
    ours = json.loads((target / "config.json").read_text())
    theirs_file = Path(root) / "config.json"
    if theirs_file.is_file():
        theirs = json.loads(theirs_file.read_text())
        keys = ("hidden_size", "num_hidden_layers", "vocab_size", "model_type")
        differ = {k: (theirs.get(k), ours.get(k)) for k in keys if theirs.get(k) != ours.get(k)}
        if differ:
            said = ", ".join(f"{k} {a} (the target's {b})" for k, (a, b) in differ.items())
            raise EngineError(
                f"{url} serves {root}, another model than the run's target {target}: {said}"
            )
    elif Path(root).name != target.name:
        log.warning("engine %s serves %r, which this machine cannot compare with the run's "
                    "target %s: make sure it is the same model", url, root, target)  # fmt: skip


def check_states(
    states: dict[str, Any], tokens: list[int], what: str, path: Path,
    expect: tuple[int, int, torch.dtype | None],
) -> torch.Tensor:  # fmt: skip
    """The file's ``hidden_states`` if they can be ``what``'s: its token ids, the shape
    ``[T, n, H]`` asked for, the engine's dtype, every value finite; else ``EngineError``."""
    n, h, dtype = expect
    ids, hs = states.get("token_ids"), states.get("hidden_states")
    if not isinstance(ids, torch.Tensor) or not isinstance(hs, torch.Tensor):
        raise EngineError(f"{path}: no hidden_states or token_ids in the file for {what}")
    if ids.dtype.is_floating_point or ids.dim() != 1 or ids.tolist() != tokens:
        raise EngineError(
            f"{path}: the engine returned states for other tokens than {what}'s "
            f"({ids.numel()} ids, {len(tokens)} asked for): refusing a wrong feature"
        )
    want = (len(tokens), n, h)
    if tuple(hs.shape) != want:
        raise EngineError(
            f"{path}: states of shape {tuple(hs.shape)} for {what}, expected {want}: the "
            f"server must extract {n} layers of a {h}-wide target "
            "(eagle_aux_hidden_state_layer_ids: docs/TRAINER.md)"
        )
    if not hs.dtype.is_floating_point or (dtype is not None and hs.dtype != dtype):
        raise EngineError(
            f"{path}: states of dtype {hs.dtype} for {what}, expected {dtype or 'a float'} "
            "(the engine's): refusing them"
        )
    bad = _first_nonfinite(hs)
    if bad is not None:
        raise EngineError(
            f"{path}: the states of {what} are not finite (token {bad[0]}, layer column "
            f"{bad[1]}: {bad[2]}): the engine computed NaN or inf; refusing to train on them"
        )
    return hs


def _first_nonfinite(hs: torch.Tensor, rows: int = 256) -> tuple[int, int, float] | None:
    """The first ``(token, column, value)`` that is NaN or inf, checked ``rows`` tokens at a
    time (a mask of the whole document would be as large as its states); None: all finite."""
    for lo in range(0, hs.shape[0], rows):
        ok = torch.isfinite(hs[lo : lo + rows])
        if not bool(ok.all()):
            t, c, k = (int(i) for i in (~ok).nonzero()[0])
            return lo + t, c, float(hs[lo + t, c, k])
    return None
