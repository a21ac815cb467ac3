"""``Session``: a client's conversation with the daemon, from ``open`` to ``close``.

A session is one rank of one job served from one ring. This module owns everything that
talks to the daemon, so the iterator (``client.loader``) only asks for "the next batch"
and keeps the position:

* the socket: a DEALER with a random identity, ``MAXMSGSIZE`` bounded, CURVE with an
  ephemeral key pair when the daemon's public key is given; it belongs to the process
  that connected it (``forked``), and every receive has a timeout;
* opening: send ``open`` (an ``Opening``: the rank, the position, what that position
  belongs to), wait for ``welcome`` through the daemon's "pending" (sent every second
  while it plans), ask again on ``busy`` for ``_BUSY_GRACE_S``; check the welcome against
  the position (corpus fingerprint, spec, legs) and map the ring it names
  (``client.ring``), or tell the daemon to free it at once;
* waiting: sleep on the ring's bell, which the daemon rings for the batch asked for and
  after every message; a heartbeat every ``heartbeat_s`` while the bell stays quiet, and
  the daemon is presumed gone after ``dead_after_s`` without a word;
* reconnecting: a silent daemon, a ``bye`` or a lost session (the daemon restarted, or
  another open replaced this one) drops socket and ring, waits with jittered backoff
  (``client.backoff``) and lets the caller reopen at its own position, for ``timeout_s``
  at most before ``LoaderUnavailableError``;
* closing: ``close`` frees the daemon's ring and waits (a second by default) for the
  confirmation, so the rank is free for the next client once it returns.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

from client.backoff import Backoff
from client.ring import Ring, RingGone
from loader_server.wire import protocol as P
from loader_server.wire import ring as R

log = logging.getLogger(__name__)
T = TypeVar("T")

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


@dataclass(frozen=True)
class Opening:
    """What an ``open`` asks for: this rank's place in its job, the position to start at
    with the shape changes of its epoch (``legs``), and the spec and corpus that position
    belongs to (None: not known yet), which the daemon's welcome must match."""

    job: str
    rank: int
    world_size: int
    spec: dict[str, Any]
    position: tuple[int, int, int]
    legs: tuple[P.Leg, ...]
    epochs: int | None
    expect_spec: dict[str, Any] | None
    expect_fingerprint: str | None

    def message(self) -> bytes:
        return P.encode(
            "open",
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            spec=self.spec,
            pos=list(self.position),
            legs=[list(leg) for leg in self.legs],
            epochs=self.epochs,
            expect_spec=self.expect_spec,
            expect_fingerprint=self.expect_fingerprint,
        )


class Session:
    """The connection to the daemon at ``endpoint`` and the session open on it, if any
    (``sid``, with its mapped ``ring``; ``n``: the index in the session of the next batch).
    Settings as ``LoaderClient`` documents them."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        heartbeat_s: float,
        dead_after_s: float,
        curve_server_key: str | bytes | None,
        shm_dir: str | os.PathLike[str] | None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.curve_server_key = (
            curve_server_key.encode() if isinstance(curve_server_key, str) else curve_server_key
        )
        self.shm_dir = os.fspath(shm_dir) if shm_dir is not None else R.default_shm_dir()
        self.sid: str | None = None
        self.ring: Ring | None = None
        self.n = 0  # index in the session of the next batch to receive
        self.pid: int | None = None  # the process that connected (owns socket and session)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._heard_at = 0.0  # while waiting for a batch: when the daemon was last heard
        self._heartbeat_at = 0.0  # ... and when the next heartbeat is due

    # --- process rules ------------------------------------------------------------------

    def forked(self) -> bool:
        """Is this a child of the process that connected (which owns socket and session)?"""
        return self.pid is not None and self.pid != os.getpid()

    def discard(self) -> None:
        """Let go without a word to the daemon (the client is being collected): a child
        after fork() drops the parent's socket and ring; the owner unmaps its ring."""
        if self.forked():
            self._abandon()
        else:
            self.forget()

    def _abandon(self) -> None:
        """After fork(), in the child: drop the parent's socket and ring without using them."""
        self._sock = None  # pyzmq never closes a socket inherited through fork
        self.sid = None
        self.ring = None  # the inherited mapping goes with the process

    # --- reconnecting -----------------------------------------------------------------------

    def retrying(self, attempt: Callable[[float], T]) -> T:
        """``attempt(give_up_at)`` until it gets through: when the daemon or the session is
        gone, drop both, wait with backoff and try again (the attempt reopens the session),
        for ``timeout_s`` from the start of the outage at most. ``give_up_at``: how long an
        open may wait for the daemon's answer."""
        deadline = None  # of an outage: timeout_s after it began
        backoff = Backoff()
        while True:
            started = time.monotonic()
            try:
                return attempt(deadline or started + self.timeout_s)
            except _Reconnect as why:
                # the outage began when this attempt did, or when the daemon was last heard
                # (not when it was noticed: that takes dead_after_s more)
                deadline = deadline or max(started, self._heard_at) + self.timeout_s
                self._reset(str(why), deadline, backoff.next_wait())

    def _reset(self, why: str, deadline: float, wait_s: float) -> None:
        """Drop socket and session; wait ``wait_s`` (but not past ``deadline``) before the
        next open attempt, or raise if that attempt can no longer succeed in time."""
        self.forget()
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

    # --- opening ----------------------------------------------------------------------------

    def open(self, opening: Opening, give_up_at: float) -> dict[str, Any]:
        """Open the session ``opening`` asks for and map its ring; the daemon's welcome.
        "busy" is asked again for ``_BUSY_GRACE_S``. A daemon that has not answered by
        ``give_up_at`` (or in ``dead_after_s``) is not there."""
        end = time.monotonic() + _BUSY_GRACE_S
        backoff = Backoff(initial_s=0.02, cap_s=0.25)
        while True:
            try:
                return self._open_once(opening, give_up_at)
            except P.LoaderRequestError as e:
                wait = backoff.next_wait()
                if e.code != P.E_BUSY or time.monotonic() + wait > end:
                    raise
                log.debug("rank %d busy (the old connection closing?): asking again", opening.rank)
                time.sleep(wait)

    def _open_once(self, opening: Opening, give_up_at: float) -> dict[str, Any]:
        self._socket().send(opening.message())
        msg = self._await_welcome(give_up_at)
        try:
            self._accept(msg, opening)
        except RingGone:  # the session ended at once (say its first batch was refused)
            self._why_gone(str(msg.get("s")))
        except P.LoaderError:  # refused here: free the daemon's ring now, not at timeout
            if isinstance(msg.get("s"), str):
                self._send("close", s=msg["s"])
            raise
        return msg

    def _await_welcome(self, give_up_at: float) -> dict[str, Any]:
        """The daemon answers ``open`` at once, or says "pending" every second while it
        plans: its welcome, or the error it answered with."""
        now = time.monotonic()
        end = min(now + self.dead_after_s, max(give_up_at, now))  # its first answer
        last = now + max(self.timeout_s, self.dead_after_s)  # while it plans ("pending")
        while True:
            msg = self._recv(end - time.monotonic())
            if msg is None:
                raise _Reconnect(f"no answer to open from {self.endpoint}")
            if msg["t"] == "welcome":
                return msg
            if msg["t"] == "pending":
                end = min(time.monotonic() + self.dead_after_s, last)
            if msg["t"] == "error" and "s" not in msg:
                raise P.LoaderRequestError(str(msg.get("code")), str(msg.get("msg")))

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

    def _accept(self, msg: dict[str, Any], opening: Opening) -> None:
        """Check a welcome against the position it opens, then map its ring."""
        fingerprint, expect = msg.get("fingerprint"), opening.expect_spec
        if opening.expect_fingerprint is not None and fingerprint != opening.expect_fingerprint:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                f"daemon serves dataset {fingerprint}, but this position belongs to "
                f"{opening.expect_fingerprint}; resuming would replay the wrong data",
            )
        if expect is not None and msg.get("spec") != expect:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                "the daemon serves another spec than this position was saved under "
                f"(saved {expect}, served {msg.get('spec')})",
            )
        steps = msg.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise P.ProtocolError(f"welcome: steps {steps!r} is not a non-negative int")
        if opening.legs and P.legs(msg.get("legs"), "welcome legs") != opening.legs:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                f"the daemon at {self.endpoint} did not plan the rest of epoch "
                f"{opening.position[0]} after its shape changes "
                f"{[list(x) for x in opening.legs]} (a daemon from before elastic resumes?); "
                "it would serve the epoch from its start: upgrade the daemon",
            )
        self.ring = Ring(self.shm_dir, msg, self._socket_owner())
        self.sid = str(msg["s"])
        self.n = 0

    def _socket_owner(self) -> int | None:
        """The uid owning the daemon's socket file (ipc on a path), which must own the ring."""
        if not self.endpoint.startswith("ipc://") or self.endpoint.startswith("ipc://@"):
            return None
        try:
            st = os.stat(self.endpoint[len("ipc://") :])
        except OSError:
            return None
        return st.st_uid if stat.S_ISSOCK(st.st_mode) else None

    # --- waiting for batches ----------------------------------------------------------------

    def ready(self) -> bool:
        """Has the daemon published the next batch?"""
        assert self.ring is not None
        return self.ring.produced() > self.n

    def await_batch(self) -> None:
        """Sleep until the next batch is ready or the session's epochs are done (``end``)."""
        ring = self.ring
        assert ring is not None
        now = time.monotonic()
        self._heard_at, self._heartbeat_at = now, now + self.heartbeat_s
        # Waiting means the daemon is the slow side: ask to be woken when two batches are
        # ready, halving wake-ups at no cost in throughput (the second is taken at once).
        # The daemon also rings after any message, such as "end" after the last batch.
        ring.wake_client_at(self.n + min(2, ring.slots))
        try:
            self._sleep_until_batch(ring)
        finally:
            ring.wake_client_at(0)  # awake again: no bells wanted (the daemon's Session.nudge)

    def _sleep_until_batch(self, ring: Ring) -> None:
        """Sleep on the ring's bell, which the daemon rings for the batch and after any
        message it sends this session, until the batch is there or the session ends."""
        while True:
            bell = ring.bell()  # before looking: a ring after this read wakes the wait
            if self.ready():
                return
            msg = self._recv(0)
            if msg is None:
                msg = self._sleep_on_bell(ring, bell)
            if msg is not None:
                self._heard_at = time.monotonic()
                if self._is_end(msg):
                    return

    def _sleep_on_bell(self, ring: Ring, bell: int) -> dict[str, Any] | None:
        """Sleep until the bell rings past ``bell`` or a heartbeat is due; the message that
        woke the client, if any (None: look at the ring again)."""
        timeout = min(self._heartbeat_at, self._heard_at + self.dead_after_s) - time.monotonic()
        if timeout <= 0 or not ring.wait(bell, timeout):
            return self._heartbeat()
        if self.ready():
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
        self._send("heartbeat", s=self.sid)
        self._heartbeat_at = now + self.heartbeat_s
        # The answer rings the bell, but a daemon that no longer knows this session
        # (restarted, or it expired) answers without one.
        return self._recv(_MESSAGE_IN_FLIGHT_S)

    def _is_end(self, msg: dict[str, Any]) -> bool:
        """Act on a message that came while waiting: True for ``end`` (sent after the last
        batch was published); reconnect on ``bye`` or a lost session, raise other errors;
        anything else (``hb``: the daemon is alive, or a stale message) changes nothing."""
        if msg.get("s") not in (None, self.sid):
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

    def release(self, consumed: int) -> None:
        """The batches before ``consumed`` are copied out: hand their slots back (a counter
        store, and a doorbell only if the daemon sleeps waiting for exactly this) and
        expect batch ``consumed`` next."""
        ring = self.ring
        assert ring is not None
        old = consumed - 1
        ring.set_consumed(consumed)
        if R.crossed(old, consumed, ring.daemon_wake()):
            self._send("release", s=self.sid)
        self.n = consumed

    # --- closing ----------------------------------------------------------------------------

    def forget(self) -> None:
        """Leave the session without telling the daemon (a new open replaces it, or it
        times out there) and unmap its ring."""
        self.sid = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def end(self, wait_s: float) -> None:
        """End the session, freeing the daemon's ring, and wait up to ``wait_s`` for the
        daemon to confirm; the socket stays connected."""
        sid = self.sid
        if sid is None or self._sock is None:
            self.forget()
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(P.encode("close", s=sid), zmq.NOBLOCK)
        self.forget()
        self._await_closed(sid, wait_s)

    def close(self, wait_s: float) -> None:
        """End the session (see ``end``) and close the socket; in a child process after
        ``fork()`` only forget the parent's connection."""
        if self.forked():
            self._abandon()
            return
        self.end(wait_s)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

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

    # --- the socket -------------------------------------------------------------------------

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
            self.pid = os.getpid()
        return self._sock

    def _send(self, kind: str, **fields: Any) -> None:
        # zmq.Again: no daemon connected right now; the receive side notices and reconnects.
        with contextlib.suppress(zmq.Again):
            self._socket().send(P.encode(kind, **fields), zmq.NOBLOCK)

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        sock = self._socket()
        if not sock.poll(max(0, int(timeout_s * 1000))):
            return None
        return P.decode(sock.recv())


class _Reconnect(Exception):
    """The daemon or this session is gone: reopen the session (at the client's position)."""
