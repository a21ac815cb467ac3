"""Requests: checking each message, running its handler, answering (or refusing) it.

Messages are parsed with bounded sizes; anything wrong earns an ``error`` reply whose code
comes from the exception's type (``service.errors``), and the daemon keeps serving. An
``open`` is answered later: ``pending`` every second while its plan and ring are being made
(``service.opening``), then ``welcome`` or an ``error``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from loader_server.planning.planner import EpochPlan
from loader_server.service.config import DaemonConfig
from loader_server.service.errors import SESSION_CODES, CorpusChanged, error_code
from loader_server.service.opening import PENDING_EVERY_S, Opening, check_start, parse_open
from loader_server.service.producer import Producer
from loader_server.service.registry import Registry
from loader_server.service.rings import ShmRing
from loader_server.service.sockets import ControlSocket, peer_name
from loader_server.wire import protocol as P

log = logging.getLogger(__name__)
# Messages handled before the loop fills again: enough to clear a burst of opens or
# doorbells in one go, few enough that the rings never wait long for their next batch.
DRAIN_BATCH = 256

Handler = Callable[[bytes, dict[str, Any]], None]


class Dispatcher:
    """Handles the messages the socket receives; counts the requests it refuses."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        instance: str,
        socket: ControlSocket,
        registry: Registry,
        producer: Producer,
        stats: Callable[[], dict[str, Any]],
    ) -> None:
        self._config = config
        self._instance = instance
        self._socket = socket
        self._registry = registry
        self._producer = producer
        self._stats = stats
        self._limits = config.limits()
        self.errors = 0
        self._handlers: dict[str, Handler] = {
            "open": self._on_open,
            "release": self._on_release,
            "heartbeat": self._on_heartbeat,
            "close": self._on_close,
            "stats": self._on_stats,
            "ping": self._on_ping,
        }

    def drain(self) -> None:
        """Handle the messages waiting (at most ``DRAIN_BATCH``)."""
        for frames in self._socket.received(DRAIN_BATCH):
            self.dispatch(frames)

    def dispatch(self, frames: list[bytes]) -> None:
        peer = frames[0]
        if len(frames) != 2:
            self._reject(peer, P.E_MALFORMED, f"expected 1 message frame, got {len(frames) - 1}")
            return
        try:
            msg = P.decode(frames[1])
        except P.ProtocolError as e:
            self._reject(peer, error_code(e), str(e))
            return
        handler = self._handlers.get(msg["t"])
        if handler is None:
            self._reject(peer, P.E_BAD_REQUEST, f"unknown message type {msg['t']!r}")
            return
        try:
            handler(peer, msg)
        except Exception as e:
            code = error_code(e)
            if code == P.E_INTERNAL:  # one bad request must not take the daemon down
                log.exception("internal error handling %r", msg.get("t"))
                self._reject(peer, code, f"{type(e).__name__}: {e}")
            else:
                sid = msg.get("s") if code in SESSION_CODES else None
                self._reject(peer, code, str(e), sid=sid)

    def _reject(self, peer: bytes, code: str, text: str, sid: Any = None) -> None:
        self.errors += 1
        log.warning("rejected request from %s: %s (%s)", peer_name(peer), text, code)
        extra = {"s": sid} if isinstance(sid, str) else {}
        self._socket.send(peer, "error", code=code, msg=text, **extra)
        sess = self._registry.sessions.get(sid) if isinstance(sid, str) else None
        if sess is not None:
            sess.ring.ring_bell()

    # --- handlers --------------------------------------------------------------------------

    def _on_open(self, peer: bytes, msg: dict[str, Any]) -> None:
        """Check an ``open`` now; plan and map in the background (``service.opening``)."""
        producer = self._producer
        if not producer.check_corpus():
            raise CorpusChanged(producer.corpus_error)
        ds = producer.dataset
        req = parse_open(msg, self._config.spec, self._limits, ds.num_samples, ds.fingerprint)
        self._registry.admit(peer, req)
        sid, need, ring = self._registry.make_ring(req, producer.shortest)
        plan = producer.plan_future(req.spec, req.start[0], req.legs)
        op = Opening(sid, peer, req, need, plan, ring)
        self._registry.add_opening(op)
        if not self._advance(op):
            self._socket.send(peer, "pending", s=sid)

    def _on_release(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._registry.session(msg)  # a doorbell: the loop reads the counter; proves liveness

    def _on_heartbeat(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._registry.tell(self._registry.session(msg), "hb")

    def _on_close(self, peer: bytes, msg: dict[str, Any]) -> None:
        sess = self._registry.session(msg)
        self._registry.drop(sess.sid, "closed by client")
        # The acknowledgement lets a client that is about to exit know its "close" arrived
        # (its socket's pending messages die with the process).
        self._socket.send(peer, "closed", s=sess.sid)

    def _on_ping(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._socket.send(peer, "pong", instance=self._instance, pid=os.getpid())

    def _on_stats(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._socket.send(peer, "stats", **self._stats())

    # --- opens being prepared ------------------------------------------------------------

    def advance_openings(self) -> None:
        """Finish the opens that are ready; remind the others' clients they are pending."""
        now = time.monotonic()
        for op in list(self._registry.opening.values()):
            if not self._advance(op) and now >= op.next_notice:
                op.next_notice = now + PENDING_EVERY_S
                if not self._socket.send(op.peer, "pending", s=op.sid):
                    self._registry.drop(op.sid, "client gone while its session was being prepared")

    def _advance(self, op: Opening) -> bool:
        """Finish an opening whose plan and ring are ready: welcome, or refuse. True if done."""
        if not op.ready():
            return False
        self._registry.take_opening(op)
        try:
            ring = op.ring.result()
        except Exception as e:
            self._refuse(op, e, None)
            return True
        try:
            plan = op.plan.result()
            check_start(op.req.start, plan, self._producer.dataset.lengths)
        except Exception as e:
            self._refuse(op, e, ring)
            return True
        self._start_session(op, ring, plan)
        return True

    def _refuse(self, op: Opening, error: Exception, ring: ShmRing | None) -> None:
        self._registry.refuse(op, ring)
        if isinstance(error, ValueError):  # the request's own: a spec the corpus cannot meet
            code = error_code(error)
        else:
            log.error("session %s: %s: %s", op.sid, type(error).__name__, error)
            code, error = P.E_INTERNAL, RuntimeError(f"planning failed: {error}")
        self._reject(op.peer, code, str(error))

    def _start_session(self, op: Opening, ring: ShmRing, plan: EpochPlan) -> None:
        req = op.req
        sess = self._registry.start(op, ring)
        self._producer.start(sess, plan)
        sent = self._socket.send(
            op.peer,
            "welcome",
            s=sess.sid,
            shm=str(ring.path),
            ctl=str(ring.control_path),
            slots=ring.num_slots,
            slot_bytes=ring.layout.slot_bytes,
            layout=ring.layout.to_wire(),
            steps=plan.num_steps,
            legs=[list(leg) for leg in req.legs],  # the client checks they were planned
            instance=self._instance,
            fingerprint=self._producer.dataset.fingerprint,
            spec=req.spec.to_dict(),
        )
        if not sent:
            self._registry.drop(sess.sid, "client gone before its welcome")
            return
        log.info(
            "session %s: job %s rank %d/%d from %s",
            sess.sid,
            req.job,
            req.rank,
            req.world_size,
            req.start,
        )
