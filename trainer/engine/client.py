"""The generic client of the states stream: one request per document, through an
``Engine`` adapter (which engine computes the states) and a ``Transport`` (how they travel;
``trainer.engine.seam``), every wait bounded and every document's states checked.

What is checked (``check_states``): the token ids are the document's, the shape the one
asked for, the dtype the engine's (the first document's when the run does not know it) or
the one the run asked to travel (``wire``: ``--states-dtype``), every value finite (fp8's
scales too). Each refusal names the document. What the transport trusts (its
folder, its file or region being this request's own) it checks itself.

Request ids are ``dflash-RUN-INC-rRANK-N`` (``trainer.engine.seam.request_prefix``): ``RUN``
is the run's own random id (kept in its run folder: a resumed run has it again, another run
never), ``INC`` this start of the job (every rank has rank 0's). So what a transport removes
is exactly what this run's requests wrote: what earlier starts left (a killed trainer, ranks
gone, a server killed mid-write) once its place is known, and this start's on closing.

Waits, each bounded and named: a server that stops answering (killed, restarting) is
waited for, one warning line, then the same request again with a backoff that starts anew
with each document, until ``timeout_s`` has passed, then ``EngineError`` (a ``LoaderError``:
the run stops after a final checkpoint and ``--resume`` continues). A server that answers
but cannot be the engine (``trainer.engine.http``) is an ``EngineError`` at once, as is a
server the trainer started that exited (with the line that says why). The caller waits for
a document with ``result``, which gives up ``STUCK_S`` past the request's own deadline (a
read that hangs in the kernel on a dead mount), naming what the request was doing; the
workers are daemon threads, so such a request cannot hold the process either, and ``close``
waits ``CLOSE_GRACE_S`` at most. ``release`` gives a document's place back once its states
were used (they may be views of the transport's memory until then).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from client.backoff import Backoff
from trainer.engine.errors import EngineError
from trainer.engine.http import Busy, Gone, exchange
from trainer.engine.seam import Attempt, Engine, Lost, Transport, request_prefix
from trainer.engine.states import Scaled, States
from trainer.vllm.connector.dflash_states_wire import SCALES, WIRE, nonfinite_fp8, scaled

__all__ = ["EngineError", "StateClient", "check_states", "request_prefix"]

log = logging.getLogger(__name__)

#: The backoff between tries while the server does not answer: from 0.5 s up to 2 s.
RETRY_S = (0.5, 2.0)
#: How long a closing client still waits for requests in flight (then it leaves them).
CLOSE_GRACE_S = 10.0
#: The same, for a server this run started (stopped next, with its folder): a request
#: about to end ends, the read-ahead past the run's last step is dropped.
OWNED_GRACE_S = 1.0
#: How far past its own deadline a request may run before ``result`` gives up on it.
STUCK_S = 30.0


@dataclass
class _Request:
    """A document's request, as far as it got (``stage``, for a message if it hangs)."""

    what: str
    tokens: list[int]
    place: Any = None
    handle: Any = None
    submitted: float = field(default_factory=time.monotonic)
    began: float | None = None
    stage: str = "waiting for a free worker"
    released: bool = False  # its place given back


class StateClient:
    """Hidden states of token-id documents from an engine at ``url``.

    ``submit(ids)`` returns a future of the states ``[T, n, H]`` (the engine's layer order
    and dtype), ``result(future)`` waits for it, bounded, and ``release(future)`` gives its
    place back once used; at most ``inflight`` requests run at once. ``engine``: which
    engine (default vLLM); ``transport``: how the states travel (default: files in
    ``states_dir``, or where the server's first reply says). ``run``: this start of the run
    (``RUN-INC``, ``trainer.engine.supply``). ``alive``: for a server this run started,
    None while it runs, else what to say about its end. ``num_states``/``hidden_size``: the
    ``[n, H]`` every document must have; ``dtype``: the engine's (None: the first
    document's); ``wire``: the dtype the states travel in, by torch's name (``WIRE``;
    ``""``: the engine's); ``target``: the run's target folder, to compare the served model
    with. fp8 states come as ``Scaled``.
    """

    def __init__(
        self, url: str, *, run: str, rank: int, num_states: int, hidden_size: int,
        inflight: int = 32, timeout_s: float = 300.0, states_dir: Path | None = None,
        alive: Callable[[], str | None] | None = None, dtype: torch.dtype | None = None,
        target: Path | None = None, engine: Engine | None = None,
        transport: Transport | None = None, wire: str = "",
    ) -> None:  # fmt: skip
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        if wire and wire not in WIRE:
            raise ValueError(f"states dtype {wire!r}: this torch carries {', '.join(WIRE)}")
        self.wire = wire
        from trainer.engine import seam

        self.engine = engine if engine is not None else seam.engine("vllm")
        if transport is None:
            from trainer.engine.files import FileTransport

            transport = FileTransport(states_dir, run=run, rank=rank)
        self.transport = transport
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.num_states, self.hidden_size, self.dtype = num_states, hidden_size, dtype
        self.inflight, self._alive = inflight, alive
        self.prefix = request_prefix(run, rank)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._outage = False  # warned that the server does not answer
        self._closing = 0.0  # when close() began (0: not yet): nothing is retried then
        self.asked = 0  # documents submitted
        self.retries = 0  # tries that found no server, or states that could not be read
        self.waits: list[float] = []  # the backoff's waits, in order (how outages went)
        self._requests: dict[Future[States], _Request] = {}
        self._queue: queue.SimpleQueue[tuple[Future[States], _Request] | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._work, name=f"engine-{k}", daemon=True)
            for k in range(inflight)
        ]
        for w in self._workers:
            w.start()
        self.model, self.max_model_len = self._served_model(target)

    # ---- the public side ---------------------------------------------------------------

    def submit(self, ids: torch.Tensor, what: str = "a document") -> Future[States]:
        """The states of the token ids ``ids [T]``, in a worker thread; ``what`` names the
        document in errors (``sample 17 of epoch 0 step 3``). Its place in the transport
        is taken now, in submission order."""
        n = int(ids.numel())
        future: Future[States] = Future()
        if self.max_model_len is not None and n > self.max_model_len - 1:
            future.set_exception(EngineError(
                f"{what} has {n} tokens; the server at {self.url} takes prompts of at most "
                f"{self.max_model_len - 1} (its --max-model-len {self.max_model_len} less "
                "the one token it generates): serve the target with a longer --max-model-len, "
                "or give the loader a --max-seq-len that fits"
            ))  # fmt: skip
            return future  # raised when its micro-batch is reached
        request = _Request(what, [int(t) for t in ids.tolist()])
        try:
            request.place = self.transport.place(self._nbytes(n))
        except EngineError as e:
            future.set_exception(e)
            return future
        with self._lock:
            self._requests[future] = request
        self.asked += 1
        self._queue.put((future, request))
        return future

    def _nbytes(self, tokens: int) -> int:
        """A document's bytes in the transport: header, ids and states (4 bytes an element
        while the engine's dtype is not known: no dtype it sends is wider), and fp8's
        scales."""
        from trainer.vllm.connector.dflash_states_shm import region_bytes

        dtype = self._expect()[2]
        size = dtype.itemsize if dtype is not None else 4
        fp8 = dtype is not None and scaled(dtype)
        return region_bytes(tokens, self.num_states, self.hidden_size, size, fp8)

    def result(self, future: Future[States]) -> States:
        """``future``'s states, waited for at most ``STUCK_S`` past its request's deadline;
        then ``EngineError`` naming the document and what its request was doing. They may
        lie in the transport's memory: ``release(future)`` once they are used."""
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

    def release(self, future: Future[States]) -> None:
        """Give the document's place back (its states are not used any more)."""
        with self._lock:
            request = self._requests.pop(future, None)
        if request is not None:
            self._give_back(request)

    def _give_back(self, request: _Request) -> None:
        with self._lock:
            if request.released:
                return
            request.released = True
        self.transport.release(request.place, request.handle)

    def close(self) -> None:
        """Let the requests in flight finish, ``CLOSE_GRACE_S`` at most (one the server does
        not answer is given up at once, not retried: a server a peer rank started may be
        stopping), give every place back, then let the transport remove what this start of
        this rank still holds. With a server this run started (``alive``), ``OWNED_GRACE_S``:
        what its requests were computing (the read-ahead past the run's last step) goes
        with it and its folder. Once: a second call does nothing."""
        if self._closing:
            return
        self._closing = time.monotonic()
        with self._lock:
            pending = list(self._requests)
        for future in pending:
            future.cancel()  # those no worker has begun
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join(max(0.0, self._closing + self._grace() - time.monotonic()))
        hung = [w for w in self._workers if w.is_alive()]
        if hung and self._alive is not None:
            log.info("engine client: %d request(s) read ahead dropped (the server this run "
                     "started stops with it)", len(hung))  # fmt: skip
            return
        if hung:
            log.warning("engine client: %d request(s) still hang after %.0f s; left behind "
                        "(what they wrote, if ever, is removed by the next start)",
                        len(hung), CLOSE_GRACE_S)  # fmt: skip
            return  # their places may still be written into: the transport keeps them
        with self._lock:
            left = list(self._requests.values())
            self._requests.clear()
        for request in left:
            self._give_back(request)
        self.transport.close()

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
                self._give_back(request)
                future.set_exception(e)

    def _gone(self) -> bool:
        """Whether the server has stopped answering (its process ended, or its port
        refuses): a transport with no lock to tell a dead writer by asks this."""
        if self._alive is not None and self._alive() is not None:
            return True
        try:
            exchange(self.url + self.engine.models_path(), None, 5.0)
        except Gone:
            return True
        except (Busy, EngineError):
            return False
        return False

    def _grace(self) -> float:
        """How long a closing client waits for its requests: ``OWNED_GRACE_S`` for a server
        this run started (it is stopped next, its folder removed)."""
        return OWNED_GRACE_S if self._alive is not None else CLOSE_GRACE_S

    def _grace_over(self) -> bool:
        return bool(self._closing) and time.monotonic() > self._closing + self._grace()

    def _stage(self, request: _Request) -> Callable[[str], None]:
        return lambda text: setattr(request, "stage", text)

    def _states(self, request: _Request) -> States:
        deadline = time.monotonic() + self.timeout_s
        attempt = Attempt(request.what, deadline, lambda: bool(self._closing),
                          self._stage(request), self._grace_over, self._gone)  # fmt: skip
        self.transport.ready(request.place, attempt)
        backoff = Backoff(*RETRY_S, jitter=0.25)  # per document: every outage starts anew
        while True:
            req_id = f"{self.prefix}-{next(self._ids)}"
            request.handle = self._request(request, req_id, deadline, backoff)
            try:
                states = self.transport.fetch(request.place, request.handle, attempt)
            except Lost as e:
                self.transport.discard(request.place, request.handle)
                self._wait(str(e), deadline, backoff)
                continue
            except EngineError:
                self.transport.discard(request.place, request.handle)
                raise
            request.stage = "checking its states"
            hs = check_states(states, request.tokens, request.what, self._expect())
            if self.dtype is None and not self.wire:  # the engine's, from its first document on
                self.dtype = hs.dtype
            return hs

    def _request(self, request: _Request, req_id: str, deadline: float, backoff: Backoff) -> Any:
        """Ask the engine for the document as request ``req_id`` (again while it does not
        answer); the transport's handle of what its connector says it wrote."""
        while True:
            params = self.transport.params(request.place, req_id)
            if self.wire:
                params = {**params, "dflash_dtype": self.wire}
            path, body, headers = self.engine.request(self.model, request.tokens, req_id, params)
            request.stage = f"waiting for {self.url} to answer request {req_id}"
            try:
                left = max(1.0, deadline - time.monotonic())  # the socket's wait: bounded
                reply = exchange(self.url + path, body, left, headers)
            except EngineError as e:
                raise EngineError(f"{request.what} ({len(request.tokens)} tokens): {e}") from None
            except (Gone, Busy) as e:
                self._wait(str(e), deadline, backoff)
                req_id = f"{self.prefix}-{next(self._ids)}"
                continue
            self._answering()
            placed = self.engine.placed(reply)
            if placed is not None and "dflash_error" in placed:
                raise EngineError(f"{self.url} refused {request.what}: {placed['dflash_error']}")
            if placed is None:
                raise EngineError(
                    f"{self.url} did not say where it put {request.what}'s states: is it "
                    "serving with the extract_hidden_states method and the DFlash connector? "
                    "(its flags: docs/TRAINER.md, 'Targets served by vLLM')"
                )
            return self.transport.locate(request.place, placed, req_id, self.url, request.what)

    def _expect(self) -> tuple[int, int, torch.dtype | None]:
        """The shape ``[n, H]`` and dtype every document's states must have."""
        return self.num_states, self.hidden_size, WIRE[self.wire] if self.wire else self.dtype

    # ---- a server that does not answer -------------------------------------------------

    def _wait(self, reason: str, deadline: float, backoff: Backoff) -> None:
        """Back off before the next try; EngineError once the server is gone for good."""
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
            broken = self.transport.health()
            if broken:  # the server may be waiting on it too: the cause goes first
                raise EngineError(
                    f"{broken}: no states for {self.timeout_s:.0f} s (--engine-timeout-s; the "
                    f"server {self.url}: {reason})",
                    fix=f"bring it back ({broken})",
                )
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
        """The model name the server serves and its context length, waited for as any
        request is; another model than ``target`` is refused."""
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff(*RETRY_S, jitter=0.25)
        url = self.url + self.engine.models_path()
        while True:
            try:
                left = max(1.0, min(30.0, deadline - time.monotonic()))
                reply = exchange(url, None, left)
                break
            except (Gone, Busy) as e:
                self._wait(str(e), deadline, backoff)
        self._answering()
        try:
            served = self.engine.served_model(reply)
        except EngineError as e:
            raise EngineError(f"{self.url}: {e}") from None
        if target is not None:
            check_served_model(self.url, served.root, Path(target))
        return served.name, served.max_model_len


def check_served_model(url: str, root: str, target: Path) -> None:
    """The model a server serves (its ``root``: a folder or a name) must be the run's
    target: where ``root`` is a folder here, their shapes must agree; elsewhere its name is
    compared, and a different one said in a warning (it cannot be checked from here)."""
    import json

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
    states: dict[str, Any], tokens: list[int], what: str,
    expect: tuple[int, int, torch.dtype | None],
) -> States:  # fmt: skip
    """The file's ``hidden_states`` if they can be ``what``'s: its token ids, the shape
    ``[T, n, H]`` asked for, the expected dtype, every value finite (fp8: with its scales
    ``[T, n]``, as ``Scaled``); else ``EngineError``."""
    n, h, dtype = expect
    ids, hs = states.get("token_ids"), states.get("hidden_states")
    if not isinstance(ids, torch.Tensor) or not isinstance(hs, torch.Tensor):
        raise EngineError(f"no hidden_states or token_ids in the states of {what}")
    if ids.dtype.is_floating_point or ids.dim() != 1 or ids.tolist() != tokens:
        raise EngineError(
            f"the engine returned states for other tokens than {what}'s "
            f"({ids.numel()} ids, {len(tokens)} asked for): refusing a wrong feature"
        )
    want = (len(tokens), n, h)
    if tuple(hs.shape) != want:
        raise EngineError(
            f"states of shape {tuple(hs.shape)} for {what}, expected {want}: the "
            f"server must extract {n} layers of a {h}-wide target "
            "(eagle_aux_hidden_state_layer_ids: docs/TRAINER.md)"
        )
    if not hs.dtype.is_floating_point or (dtype is not None and hs.dtype != dtype):
        raise EngineError(
            f"states of dtype {hs.dtype} for {what}, expected {dtype or 'a float'} "
            "(the engine's, or --states-dtype's): refusing them"
        )
    if scaled(hs.dtype):
        return _check_scaled(hs, states.get(SCALES), what)
    bad = _first_nonfinite(hs)
    if bad is not None:
        raise EngineError(
            f"the states of {what} are not finite (token {bad[0]}, layer column "
            f"{bad[1]}: {bad[2]}): the engine computed NaN or inf; refusing to train on them"
        )
    return hs


def _check_scaled(values: torch.Tensor, scales: Any, what: str) -> Scaled:
    """fp8 states and their per-(token, layer) scales, if every one is finite."""
    t, n, _ = values.shape
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(
        scales.shape) != (t, n):  # fmt: skip
        got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else None
        raise EngineError(
            f"fp8 states of {what} without float32 scales [{t}, {n}] beside them ({SCALES}: "
            f"{got}): refusing them"
        )
    bad_scale = (~torch.isfinite(scales)).nonzero()
    bad_value = nonfinite_fp8(values).nonzero()
    if len(bad_scale) or len(bad_value):
        tok, col = (int(i) for i in (bad_scale[0] if len(bad_scale) else bad_value[0][:2]))
        raise EngineError(
            f"the states of {what} are not finite (token {tok}, layer column {col}: scale "
            f"{float(scales[tok, col])}): the engine computed NaN or inf; refusing to train on "
            "them"
        )
    return Scaled(values, scales)


def _first_nonfinite(hs: torch.Tensor, rows: int = 256) -> tuple[int, int, float] | None:
    """The first ``(token, column, value)`` that is NaN or inf, checked ``rows`` tokens at a
    time (a mask of the whole document would be as large as its states); None: all finite."""
    for lo in range(0, hs.shape[0], rows):
        ok = torch.isfinite(hs[lo : lo + rows])
        if not bool(ok.all()):
            t, c, k = (int(i) for i in (~ok).nonzero()[0])
            return lo + t, c, float(hs[lo + t, c, k])
    return None
