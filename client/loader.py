"""``LoaderClient``: the iterator a trainer rank uses to receive batches from the daemon.

Each ``next()`` waits for the daemon to announce the next batch in the session's ring,
copies it out into private memory (``client.ring.Ring.take``; pinned once CUDA is
initialized in the process, so ``batch.to("cuda", non_blocking=True)`` is a DMA) and gives
the slot straight back to the daemon. A ``Batch`` is therefore the trainer's own: it never
changes while held, in-place writes work, and it pickles compactly (``client.batch``).

The client holds the position (``[epoch, step, micro]`` of the next batch, and the shape
changes its epoch went through: ``legs``); the daemon holds nothing a restart could lose. A
state saved under one shape (world size, grad_accum) loads into a client of another at a
step boundary: the rest of that epoch is planned afresh for the new shape
(``loader_server.planning.elastic``), so every sample is still served once. If the daemon
goes away (no message for ``dead_after_s``, a ``bye``, or "unknown session" after a daemon
restart) the client reconnects with backoff and reopens its session at its own position,
so nothing is lost or repeated; after ``timeout_s`` without a daemon it raises
``LoaderUnavailableError``. Talking to the daemon (opening, heartbeats, reconnecting,
closing) is ``client.session``'s; this module keeps the position and takes the batches.

Process rules: a client belongs to the process that connected it; used after ``fork()`` in
the child it raises (the child must make its own). After ``close()`` it raises too; after
its last epoch it keeps raising ``StopIteration``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch

from client.batch import Batch
from client.session import Opening, Session
from client.state import resume, saved_state
from loader_server.wire import protocol as P
from loader_server.wire.layouts import PADDED, layout
from loader_server.wire.spec import check_fields

__all__ = ["Batch", "LoaderClient"]
log = logging.getLogger(__name__)


def _from_session(name: str, *, settable: bool = False) -> Any:
    """A client attribute that is its session's ``name``: the connection settings, which
    only the session uses, and what tests look at (the ring, the session id, the socket)."""

    def get(client: LoaderClient) -> Any:
        return getattr(client._session, name)

    def set_(client: LoaderClient, value: Any) -> None:
        setattr(client._session, name, value)

    return property(get, set_ if settable else None)


class LoaderClient:
    """Iterate micro-batches of one rank of a job from the loader daemon.

    Args:
        endpoint: the daemon's ZeroMQ endpoint.
        job: job name; all ranks of a job must agree on ``world_size`` and ``spec``.
        rank, world_size: this process's place in the job.
        spec: BatchSpec fields overriding the daemon's defaults (``world_size`` is set
            from the argument), checked here as the daemon checks them
            (``loader_server.wire.spec.check_fields``): an unknown field, naming the
            nearest known one, or a value outside its field's bounds is a ValueError before
            any daemon is asked.
        epochs: total epochs to serve (iteration stops at epoch ``epochs``); None: forever.
        timeout_s: how long to keep trying to reach a daemon before raising
            ``LoaderUnavailableError``.
        heartbeat_s: while waiting for a batch, how often to ask whether the daemon is alive.
        dead_after_s: silence (heartbeats unanswered) after which the daemon is presumed gone.
        curve_server_key: the daemon's CURVE public key (Z85 text) for a tcp:// endpoint
            secured with ``curve_secret_key_file``; the client uses an ephemeral key pair.
        shm_dir: the daemon's ``--shm-dir``; the client maps only rings in this folder
            (default ``$DFLASH_LOADER_SHM_DIR``, else ``/dev/shm``).
        pin_memory: copy batches into pinned memory (None: when CUDA is initialized in
            this process by the time a batch arrives).
    """

    endpoint = _from_session("endpoint")
    timeout_s = _from_session("timeout_s")
    heartbeat_s = _from_session("heartbeat_s")
    dead_after_s = _from_session("dead_after_s")
    curve_server_key = _from_session("curve_server_key")
    shm_dir = _from_session("shm_dir")
    _ring = _from_session("ring")
    _sid = _from_session("sid")
    _sock = _from_session("_sock", settable=True)  # tests close it as a killed process would

    def __init__(
        self,
        endpoint: str = P.DEFAULT_ENDPOINT,
        *,
        job: str,
        rank: int,
        world_size: int,
        spec: dict[str, Any] | None = None,
        epochs: int | None = None,
        timeout_s: float = 60.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        curve_server_key: str | bytes | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        spec = dict(spec or {})
        check_fields(spec)
        if spec.get("world_size", world_size) != world_size:
            raise ValueError(f"spec world_size {spec['world_size']} != world_size {world_size}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.spec = spec
        self.epochs = epochs
        self.pin_memory = pin_memory
        self.position: tuple[int, int, int] = (0, 0, 0)
        self.legs: tuple[P.Leg, ...] = ()  # shapes the position's epoch had before this one
        self.resized: str | None = None  # what load_state_dict changed, in words
        self.wait_s = 0.0  # total time blocked waiting for data
        self.steps_per_epoch: int | None = None
        self.fingerprint: str | None = None
        self.effective_spec: dict[str, Any] | None = None
        self._session = Session(
            endpoint,
            timeout_s=timeout_s,
            heartbeat_s=heartbeat_s,
            dead_after_s=dead_after_s,
            curve_server_key=curve_server_key,
            shm_dir=shm_dir,
        )
        self._closed = False  # close() was called: the client cannot be used again
        self._done = False  # the requested epochs were served: StopIteration from now on
        self._saved_spec: dict[str, Any] | None = None  # from load_state_dict

    # --- public API -----------------------------------------------------------------------

    def __iter__(self) -> LoaderClient:
        return self

    def __next__(self) -> Batch:
        self._check_usable()
        if self._done:
            raise StopIteration
        if self.epochs is not None and self.position[0] >= self.epochs:
            self._finish()  # free the daemon's ring now rather than at session timeout
            raise StopIteration
        batch = self._session.retrying(self._next_in_session)
        if batch is None:
            self._finish()
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the next batch this rank should receive, with the spec and corpus
        (fingerprint) that position belongs to; a daemon serving another spec or corpus
        refuses to resume it (``client.state``)."""
        return saved_state(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            position=self.position,
            legs=self.legs,
            fingerprint=self.fingerprint,
            spec=self._expected_spec(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (reopening the session if one is open).

        A state of another world size or ``grad_accum`` (this client's ``spec`` override;
        none: the saved one) is resumed under this client's shape when its position is at
        a step boundary: the steps it has served stay served, the rest of its epoch is
        planned afresh, and ``resized`` says so in words. Any rank's state will do then (at
        a step boundary all ranks of a job share one position). Under the same shape the
        state must be this rank's."""
        self._check_usable()
        r = resume(
            state,
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            grad_accum=self.spec.get("grad_accum"),
        )
        self.position, self.legs, self.resized = r.position, r.legs, r.resized
        if r.fingerprint:
            self.fingerprint = r.fingerprint
        if r.spec is not None:
            self._saved_spec = r.spec
            self.effective_spec = None  # the daemon must serve the saved one (checked at open)
        self._done = False
        self._session.forget()  # the next open, at the new position, replaces the session

    def close(self, wait_s: float = 1.0) -> None:
        """End the session and free the daemon's ring; the client cannot be used again.
        Waits up to ``wait_s`` for the daemon to confirm, so a process that exits right
        after (a trainer stopped with SIGTERM) does not take its unsent ``close`` with it
        and leave the session to time out. In a child process after ``fork()`` this only
        forgets the parent's connection."""
        self._closed = True
        self._session.close(wait_s)

    def __enter__(self) -> LoaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._session.discard()

    # --- process rules ------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise P.LoaderError(
                f"this LoaderClient (job {self.job!r}, rank {self.rank}) was closed; "
                f"create a new one to read again"
            )
        if self._session.forked():
            raise P.LoaderError(
                f"this LoaderClient was connected in process {self._session.pid} and used in "
                f"process {os.getpid()} after fork(); a child process must create its own "
                f"client (a shared connection would deliver each batch to one of them only)"
            )

    def _finish(self, wait_s: float = 1.0) -> None:
        """The requested epochs are done: free the daemon's ring, keep StopIteration.
        Waits (up to ``wait_s``) for the daemon to confirm, so once ``StopIteration`` is
        raised the rank is free: a new client of the same rank, on its own connection, is
        not refused as a second reader because its ``open`` overtook this ``close``."""
        self._done = True
        self._session.end(wait_s)

    # --- the session at this position -----------------------------------------------------

    def _expected_spec(self) -> dict[str, Any] | None:
        """The spec the position belongs to: the one served, else the one loaded."""
        return self.effective_spec if self.effective_spec is not None else self._saved_spec

    def _next_in_session(self, give_up_at: float) -> Batch | None:
        """The next batch (None: the requested epochs are done), opening the session at the
        position first if none is open (its answer is waited for until ``give_up_at``)."""
        if self._session.sid is None:
            self._open(give_up_at)
        return self._receive()

    def _open(self, give_up_at: float) -> None:
        opening = Opening(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            spec=self.spec,
            position=self.position,
            legs=self.legs,
            epochs=self.epochs,
            expect_spec=self._expected_spec(),
            expect_fingerprint=self.fingerprint,
        )
        welcome = self._session.open(opening, give_up_at)
        self.fingerprint = welcome.get("fingerprint")
        self.effective_spec = welcome.get("spec")
        self.steps_per_epoch = welcome["steps"]
        log.debug("session %s open at %s", self._session.sid, self.position)

    # --- batches ----------------------------------------------------------------------------

    def _receive(self) -> Batch | None:
        """This session's next batch (None: the requested epochs are done). A batch already
        in the ring is taken without a system call; otherwise the client sleeps for it."""
        if self._session.ready():
            return self._batch(self._session.n)
        return self._wait_for_batch()

    def _wait_for_batch(self) -> Batch | None:
        """Sleep until the next batch (or the end), counting the time as waiting for data."""
        ring = self._session.ring
        assert ring is not None
        t0 = time.monotonic()
        try:
            self._session.await_batch()
            # not ready: the daemon said "end" (after the last batch, which was taken)
            return self._batch(self._session.n) if self._session.ready() else None
        finally:
            self.wait_s += time.monotonic() - t0
            ring.set_wait(self.wait_s)

    def _batch(self, n: int) -> Batch:
        """Take batch ``n`` out of its slot, give the slot back, and move past it."""
        ring = self._session.ring
        assert ring is not None
        slot = n % ring.slots
        meta = ring.meta(slot)
        if meta.n != n or meta.position != self.position:
            raise P.ProtocolError(
                f"slot {slot} holds batch {meta.n} at {meta.position}, expected batch {n} at "
                f"{self.position}: the daemon and this client disagree about the plan"
            )
        name = (self.effective_spec or {}).get("layout", PADDED.name)
        pin = self.pin_memory
        if pin is None:  # pinned pages only help (and only cost) once CUDA is in use
            pin = torch.cuda.is_initialized()
        t = ring.take(slot, layout(name).field_shapes(meta.rows, meta.width), pin)
        self._session.release(n + 1)  # the slot goes straight back: the batch is a private copy
        batch = Batch(
            input_ids=t["input_ids"],
            loss_mask=t["loss_mask"],
            lengths=t["lengths"],
            sample_ids=t["sample_ids"],
            position_ids=t.get("position_ids"),
            cu_seqlens=t.get("cu_seqlens"),
            max_seqlen=meta.maxlen,
            epoch=meta.epoch,
            step=meta.step,
            micro=meta.micro,
            bucket=meta.bucket,
            layout=name,
            steps_per_epoch=meta.steps,
            num_tokens=meta.tokens,
            leg=len(self.legs),
        )
        self.steps_per_epoch = meta.steps
        if meta.next_position[0] != meta.epoch:
            self.legs = ()  # the next epoch is planned whole for this shape
        self.position = meta.next_position
        return batch
