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
``LoaderUnavailableError``.

Process rules: a client belongs to the process that connected it; used after ``fork()`` in
the child it raises (the child must make its own). After ``close()`` it raises too; after
its last epoch it keeps raising ``StopIteration``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from typing import Any

import torch
import zmq

from client.backoff import Backoff
from client.batch import Batch, field_shapes
from client.ring import Ring, RingGone
from client.state import resume, saved_state
from loader_server.wire import protocol as P
from loader_server.wire import ring as R

__all__ = ["Batch", "LoaderClient"]
log = logging.getLogger(__name__)

# After the bell rang for a message rather than a batch: how long to wait for it to arrive.
_MESSAGE_IN_FLIGHT_S = 0.1
# Error codes saying the daemon no longer has this session (it restarted, or another open
# replaced it): reopen it rather than fail.
_SESSION_LOST = (P.E_UNKNOWN_SESSION, P.E_REPLACED)
# How long "busy" (another live client reads this rank) is asked again before it is final.
# A restarted trainer, or this client after a reconnect, can reach the daemon before the
# daemon's I/O thread has seen the old connection close; its heartbeat to the old peer then
# still succeeds. That lasts milliseconds; a real second reader is refused after this.
_BUSY_GRACE_S = 1.0


class LoaderClient:
    """Iterate micro-batches of one rank of a job from the loader daemon.

    Args:
        endpoint: the daemon's ZeroMQ endpoint.
        job: job name; all ranks of a job must agree on ``world_size`` and ``spec``.
        rank, world_size: this process's place in the job.
        spec: BatchSpec fields overriding the daemon's defaults (``world_size`` is set
            from the argument).
        epochs: total epochs to serve (iteration stops at epoch ``epochs``); None: forever.
        timeout_s: how long to keep trying to reach a daemon before raising
            ``LoaderUnavailableError``.
        dead_after_s: silence (heartbeats unanswered) after which the daemon is presumed gone.
        curve_server_key: the daemon's CURVE public key (Z85 text) for a tcp:// endpoint
            secured with ``curve_secret_key_file``; the client uses an ephemeral key pair.
        shm_dir: the daemon's ``--shm-dir``; the client maps only rings in this folder
            (default ``$DFLASH_LOADER_SHM_DIR``, else ``/dev/shm``).
        pin_memory: copy batches into pinned memory (None: when CUDA is initialized in
            this process by the time a batch arrives).
    """

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
        if spec.get("world_size", world_size) != world_size:
            raise ValueError(f"spec world_size {spec['world_size']} != world_size {world_size}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
        self.endpoint = endpoint
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.spec = spec
        self.epochs = epochs
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.curve_server_key = (
            curve_server_key.encode() if isinstance(curve_server_key, str) else curve_server_key
        )
        self.shm_dir = os.fspath(shm_dir) if shm_dir is not None else R.default_shm_dir()
        self.pin_memory = pin_memory
        self.position: tuple[int, int, int] = (0, 0, 0)
        self.legs: tuple[P.Leg, ...] = ()  # shapes the position's epoch had before this one
        self.resized: str | None = None  # what load_state_dict changed, in words
        self.wait_s = 0.0  # total time blocked waiting for data
        self.steps_per_epoch: int | None = None
        self.fingerprint: str | None = None
        self.effective_spec: dict[str, Any] | None = None
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._sid: str | None = None
        self._ring: Ring | None = None
        self._n = 0  # index in the session of the next batch to receive
        self._heard_at = 0.0  # while waiting for a batch: when the daemon was last heard
        self._heartbeat_at = 0.0  # ... and when the next heartbeat is due
        self._pid: int | None = None  # the process that connected (owns socket and session)
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
        deadline = None  # of an outage: timeout_s after it began
        backoff = Backoff()
        while True:
            attempt = time.monotonic()
            try:
                if self._sid is None:  # an answer is waited for until the deadline at most
                    self._open(deadline or attempt + self.timeout_s)
                batch = self._receive()
                if batch is None:
                    self._finish()
                    raise StopIteration
                return batch
            except _Reconnect as why:
                # the outage began when this attempt did, or when the daemon was last heard
                # (not when it was noticed: that takes dead_after_s more)
                deadline = deadline or max(attempt, self._heard_at) + self.timeout_s
                self._reset(str(why), deadline, backoff.next_wait())

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
            spec=self.effective_spec if self.effective_spec is not None else self._saved_spec,
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
        if self._sid is not None:
            self._close_session()

    def close(self, wait_s: float = 1.0) -> None:
        """End the session and free the daemon's ring; the client cannot be used again.
        Waits up to ``wait_s`` for the daemon to confirm, so a process that exits right
        after (a trainer stopped with SIGTERM) does not take its unsent ``close`` with it
        and leave the session to time out. In a child process after ``fork()`` this only
        forgets the parent's connection."""
        self._closed = True
        if self._forked():
            self._abandon()
            return
        sid = self._sid
        self._end_session()
        if sid is not None and self._sock is not None:
            self._await_closed(sid, wait_s)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> LoaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._forked():
                self._abandon()
            else:
                self._close_session()

    # --- process rules ------------------------------------------------------------------

    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _check_usable(self) -> None:
        if self._closed:
            raise P.LoaderError(
                f"this LoaderClient (job {self.job!r}, rank {self.rank}) was closed; "
                f"create a new one to read again"
            )
        if self._forked():
            raise P.LoaderError(
                f"this LoaderClient was connected in process {self._pid} and used in "
                f"process {os.getpid()} after fork(); a child process must create its own "
                f"client (a shared connection would deliver each batch to one of them only)"
            )

    def _abandon(self) -> None:
        """After fork(), in the child: drop the parent's socket and ring without using them."""
        self._sock = None  # pyzmq never closes a socket inherited through fork
        self._sid = None
        self._ring = None  # the inherited mapping goes with the process

    def _end_session(self) -> None:
        if self._sid is not None and self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(P.encode("close", s=self._sid), zmq.NOBLOCK)
        self._close_session()

    def _await_closed(self, sid: str, wait_s: float) -> None:
        """Read until the daemon confirms ``close`` of ``sid`` (or says it no longer knows
        it), at most ``wait_s``; a daemon that is gone simply costs the wait."""
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            try:
                msg = self._recv(left)
            except P.ProtocolError:
                continue
            if msg is None:
                log.info("no confirmation of closing session %s within %.1f s", sid, wait_s)
                return
            if msg.get("s") == sid and msg["t"] in ("closed", "error"):
                return

    def _finish(self, wait_s: float = 1.0) -> None:
        """The requested epochs are done: free the daemon's ring, keep StopIteration.
        Waits (up to ``wait_s``) for the daemon to confirm, so once ``StopIteration`` is
        raised the rank is free: a new client of the same rank, on its own connection, is
        not refused as a second reader because its ``open`` overtook this ``close``."""
        self._done = True
        sid = self._sid
        self._end_session()
        if sid is not None and self._sock is not None:
            self._await_closed(sid, wait_s)

    # --- session ---------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(8))
            sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
            if self.curve_server_key is not None:
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey = self.curve_server_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            sock.connect(self.endpoint)
            self._sock = sock
            self._pid = os.getpid()
        return self._sock

    def _open(self, give_up_at: float) -> None:
        """Open this rank's session; "busy" is asked again for ``_BUSY_GRACE_S``. A daemon
        that has not answered by ``give_up_at`` (or in ``dead_after_s``) is not there."""
        end = time.monotonic() + _BUSY_GRACE_S
        backoff = Backoff(initial_s=0.02, cap_s=0.25)
        while True:
            try:
                return self._open_once(give_up_at)
            except P.LoaderRequestError as e:
                wait = backoff.next_wait()
                if e.code != P.E_BUSY or time.monotonic() + wait > end:
                    raise
                log.debug("rank %d busy (the old connection closing?): asking again", self.rank)
                time.sleep(wait)

    def _open_once(self, give_up_at: float) -> None:
        sock = self._socket()
        expect = self.effective_spec if self.effective_spec is not None else self._saved_spec
        sock.send(
            P.encode(
                "open",
                job=self.job,
                rank=self.rank,
                world_size=self.world_size,
                spec=self.spec,
                pos=list(self.position),
                legs=[list(leg) for leg in self.legs],
                epochs=self.epochs,
                expect_spec=expect,
                expect_fingerprint=self.fingerprint,
            )
        )
        # The daemon answers at once, or says "pending" every second while it plans.
        now = time.monotonic()
        end = min(now + self.dead_after_s, max(give_up_at, now))  # its first answer
        last = now + max(self.timeout_s, self.dead_after_s)  # while it plans ("pending")
        while True:
            msg = self._recv(end - time.monotonic())
            if msg is None:
                raise _Reconnect(f"no answer to open from {self.endpoint}")
            if msg["t"] == "welcome":
                break
            if msg["t"] == "pending":
                end = min(time.monotonic() + self.dead_after_s, last)
            if msg["t"] == "error" and "s" not in msg:
                raise P.LoaderRequestError(str(msg.get("code")), str(msg.get("msg")))
        try:
            self._welcome(msg)
        except RingGone:  # the session ended at once (say its first batch was refused)
            self._why_gone(str(msg.get("s")))
        except P.LoaderError:  # refused here: free the daemon's ring now, not at timeout
            if isinstance(msg.get("s"), str):
                self._send("close", s=msg["s"])
            raise

    def _why_gone(self, sid: str) -> None:
        """Raise the error that ended session ``sid`` (it follows the welcome), or reconnect."""
        end = time.monotonic() + 1.0
        while (left := end - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                break
            if msg["t"] == "error" and msg.get("s") == sid:
                code = str(msg.get("code"))
                if code not in _SESSION_LOST:
                    raise P.LoaderRequestError(code, str(msg.get("msg")))
        raise _Reconnect(f"session {sid} ended before its ring could be mapped")

    def _welcome(self, msg: dict[str, Any]) -> None:
        fingerprint = msg.get("fingerprint")
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                f"daemon serves dataset {fingerprint}, but this position belongs to "
                f"{self.fingerprint}; resuming would replay the wrong data",
            )
        expect = self.effective_spec if self.effective_spec is not None else self._saved_spec
        if expect is not None and msg.get("spec") != expect:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                "the daemon serves another spec than this position was saved under "
                f"(saved {expect}, served {msg.get('spec')})",
            )
        steps = msg.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise P.ProtocolError(f"welcome: steps {steps!r} is not a non-negative int")
        if self.legs and P.legs(msg.get("legs"), "welcome legs") != self.legs:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                f"the daemon at {self.endpoint} did not plan the rest of epoch "
                f"{self.position[0]} after its shape changes {[list(x) for x in self.legs]} "
                "(a daemon from before elastic resumes?); it would serve the epoch from its "
                "start: upgrade the daemon",
            )
        self._ring = Ring(self.shm_dir, msg, self._socket_owner())
        self._sid = str(msg["s"])
        self._n = 0
        self.fingerprint = fingerprint
        self.effective_spec = msg.get("spec")
        self.steps_per_epoch = steps
        log.debug("session %s open at %s", self._sid, self.position)

    def _socket_owner(self) -> int | None:
        """The uid owning the daemon's socket file (ipc on a path), which must own the ring."""
        if not self.endpoint.startswith("ipc://") or self.endpoint.startswith("ipc://@"):
            return None
        try:
            st = os.stat(self.endpoint[len("ipc://") :])
        except OSError:
            return None
        return st.st_uid if stat.S_ISSOCK(st.st_mode) else None

    def _receive(self) -> Batch | None:
        """This session's next batch (None: the requested epochs are done). A batch already
        in the ring is taken without a system call; otherwise the client sleeps for it."""
        if self._ready():
            return self._batch(self._n)
        return self._wait_for_batch()

    def _ready(self) -> bool:
        """Has the daemon published the next batch?"""
        assert self._ring is not None
        return self._ring.produced() > self._n

    def _wait_for_batch(self) -> Batch | None:
        """Sleep until the next batch (or the end), counting the time as waiting for data."""
        ring = self._ring
        assert ring is not None
        t0 = time.monotonic()
        self._heard_at, self._heartbeat_at = t0, t0 + self.heartbeat_s
        # Waiting means the daemon is the slow side: ask to be woken when two batches are
        # ready, halving wake-ups at no cost in throughput (the second is taken at once).
        # The daemon also rings after any message, such as "end" after the last batch.
        ring.wake_client_at(self._n + min(2, ring.slots))
        try:
            return self._sleep_until_batch()
        finally:
            ring.wake_client_at(0)  # awake again: no bells wanted (see Session.nudge)
            self.wait_s += time.monotonic() - t0
            ring.set_wait(self.wait_s)

    def _sleep_until_batch(self) -> Batch | None:
        """Sleep on the ring's bell, which the daemon rings for the batch and after any
        message it sends this session, until the batch is there or the session ends."""
        assert self._ring is not None
        while True:
            bell = self._ring.bell()  # before looking: a ring after this read wakes the wait
            if self._ready():
                return self._batch(self._n)
            msg = self._recv(0)
            if msg is None:
                msg = self._sleep_on_bell(bell)
            if msg is not None:
                self._heard_at = time.monotonic()
                if self._is_end(msg):
                    return self._batch(self._n) if self._ready() else None

    def _sleep_on_bell(self, bell: int) -> dict[str, Any] | None:
        """Sleep until the bell rings past ``bell`` or a heartbeat is due; the message that
        woke the client, if any (None: look at the ring again)."""
        assert self._ring is not None
        timeout = min(self._heartbeat_at, self._heard_at + self.dead_after_s) - time.monotonic()
        if timeout <= 0 or not self._ring.wait(bell, timeout):
            return self._heartbeat()
        if self._ready():
            return None
        # Rung for a message, which may still be in flight through ZeroMQ.
        return self._recv(_MESSAGE_IN_FLIGHT_S)

    def _heartbeat(self) -> dict[str, Any] | None:
        """The bell stayed quiet: give up on a silent daemon, or ask whether it is alive
        when a heartbeat is due; its answer, if one comes at once."""
        now = time.monotonic()
        if now - self._heard_at >= self.dead_after_s:
            raise _Reconnect(f"no message from the daemon for {self.dead_after_s:.1f} s")
        if now < self._heartbeat_at:
            return None
        self._send("heartbeat", s=self._sid)
        self._heartbeat_at = now + self.heartbeat_s
        # The answer rings the bell, but a daemon that no longer knows this session
        # (restarted, or it expired) answers without one.
        return self._recv(_MESSAGE_IN_FLIGHT_S)

    def _is_end(self, msg: dict[str, Any]) -> bool:
        """Act on a message that came while waiting: True for ``end`` (sent after the last
        batch was published); reconnect on ``bye`` or a lost session, raise other errors;
        anything else (``hb``: the daemon is alive, or a stale message) changes nothing."""
        if msg.get("s") not in (None, self._sid):
            return False  # stale: from a session we already left
        kind = msg["t"]
        if kind == "bye":
            raise _Reconnect(str(msg.get("why", "daemon is shutting down")))
        if kind == "error":
            code = str(msg.get("code"))
            if code in _SESSION_LOST:
                raise _Reconnect(f"session lost: {msg.get('msg')}")
            raise P.LoaderRequestError(code, str(msg.get("msg")))
        return kind == "end"

    def _batch(self, n: int) -> Batch:
        """Take batch ``n`` out of its slot, give the slot back, and move past it."""
        ring = self._ring
        assert ring is not None
        slot = n % ring.slots
        meta = ring.meta(slot)
        if meta.n != n or meta.position != self.position:
            raise P.ProtocolError(
                f"slot {slot} holds batch {meta.n} at {meta.position}, expected batch {n} at "
                f"{self.position}: the daemon and this client disagree about the plan"
            )
        layout = (self.effective_spec or {}).get("layout", "padded")
        pin = self.pin_memory
        if pin is None:  # pinned pages only help (and only cost) once CUDA is in use
            pin = torch.cuda.is_initialized()
        t = ring.take(slot, field_shapes(layout, meta.rows, meta.width), pin)
        self._release(n + 1)  # the slot goes straight back: the batch is a private copy
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
            layout=layout,
            steps_per_epoch=meta.steps,
            num_tokens=meta.tokens,
            leg=len(self.legs),
        )
        self.steps_per_epoch = meta.steps
        if meta.next_position[0] != meta.epoch:
            self.legs = ()  # the next epoch is planned whole for this shape
        self.position = meta.next_position
        self._n = n + 1
        return batch

    def _release(self, consumed: int) -> None:
        """Hand slots back up to batch ``consumed``: a counter store, and a doorbell only
        if the daemon sleeps waiting for exactly this."""
        ring = self._ring
        assert ring is not None
        old = consumed - 1
        ring.set_consumed(consumed)
        if R.crossed(old, consumed, ring.daemon_wake()):
            self._send("release", s=self._sid)

    def _send(self, kind: str, **fields: Any) -> None:
        # zmq.Again: no daemon connected right now; the receive side notices and reconnects.
        with contextlib.suppress(zmq.Again):
            self._socket().send(P.encode(kind, **fields), zmq.NOBLOCK)

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        sock = self._socket()
        if not sock.poll(max(0, int(timeout_s * 1000))):
            return None
        return P.decode(sock.recv())

    def _close_session(self) -> None:
        self._sid = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def _reset(self, why: str, deadline: float, wait_s: float) -> None:
        """Drop socket and session; wait ``wait_s`` (but not past ``deadline``) before the
        next open attempt, or raise if that attempt can no longer succeed in time."""
        self._close_session()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        left = deadline - time.monotonic()
        problem = P.ipc_problem(self.endpoint)
        if problem is not None and problem[0] == errno.EACCES:  # waiting will not fix it
            raise P.LoaderUnavailableError(problem[1])
        if left <= 0:
            raise P.LoaderUnavailableError(
                f"no loader daemon answered on {self.endpoint} for {self.timeout_s:.0f} s "
                f"(last problem: {problem[1] if problem else why}); is `dflash-loader serve` "
                f"running?"
            )
        wait_s = min(wait_s, left)
        log.warning(
            "loader connection lost (%s); reconnecting to %s in %.2f s", why, self.endpoint, wait_s
        )
        time.sleep(wait_s)


class _Reconnect(Exception):
    """The daemon or this session is gone: reopen the session (at the client's position)."""
