"""The ZeroMQ side of the daemon: one ROUTER socket, many sessions, one thread.

The loop alternates between draining control messages (never blocking while there is
work) and filling one free slot of one session (round robin), so a slow or misbehaving
client cannot starve the others. Messages are parsed with bounded sizes; anything wrong
earns an ``error`` reply and the daemon keeps serving. ROUTER_MANDATORY turns a send to a
vanished client into an error (ZeroMQ would otherwise drop it silently), which closes that
session at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from loader_server.data.corpus_watch import CorpusWatch
from loader_server.data.dataset import ArrowDataset, CorpusFaultError, DatasetError
from loader_server.planning.planner import EpochPlan
from loader_server.planning.spec import BatchSpec, SpecLimits
from loader_server.service.endpoint import IpcAddress, listen_ipc, remove_socket, socket_identity
from loader_server.service.opening import (
    SYNC_RING_BYTES,
    Opening,
    OpenRequest,
    SpecMismatch,
    check_start,
    parse_open,
)
from loader_server.service.plans import PlanCache
from loader_server.service.readahead import DEPTH as READAHEAD_DEPTH
from loader_server.service.readahead import Readahead
from loader_server.service.rings import ShmRing, ShmSpaceError, ring_bytes, segment_name, shm_caps
from loader_server.service.session import Session, shortest_sample, slot_layout_for
from loader_server.wire import protocol as P

log = logging.getLogger(__name__)
# A session whose client released a slot or sent a message this recently is being consumed:
# the daemon then sleeps at most 1 ms between looks at the ring counters.
_BUSY_S = 0.2


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What the server needs beyond the dataset. Units are in the names."""

    endpoint: str = P.DEFAULT_ENDPOINT
    slots: int = 4
    shm_dir: Path = Path("/dev/shm")
    shm_mode: int = 0o600
    group: str | None = None
    pad_id: int = 0
    session_timeout_s: float = 120.0
    max_sessions: int = 1024
    corpus_check_s: float = 0.5  # how often the corpus files are checked for changes
    max_ring_bytes: int | None = None  # per session; None: derived (loader_server.service.rings)
    shm_budget_bytes: int | None = None  # all rings together; None: derived
    max_sessions_per_peer: int = 8
    spec_defaults: BatchSpec = field(default_factory=BatchSpec)
    limits: SpecLimits = field(default_factory=SpecLimits)
    curve_secret_key_file: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 64:
            raise ValueError(f"slots must be in [1, 64], got {self.slots}")
        if self.session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {self.session_timeout_s}")
        if not 0 <= self.shm_mode <= 0o777:
            raise ValueError(
                f"shm_mode must be a permission mode like 0o600, got {self.shm_mode:o}"
            )
        for name in ("max_ring_bytes", "shm_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


@dataclass
class _Job:
    spec: BatchSpec
    world_size: int


class LoaderServer:
    """Serves one dataset on one endpoint. Call ``serve_forever(should_stop)``."""

    def __init__(self, dataset: ArrowDataset, config: ServerConfig) -> None:
        self.dataset = dataset
        self.config = config
        self.instance = secrets.token_hex(4)
        self.plans = PlanCache(dataset.lengths, dataset.fingerprint)
        self.readahead = Readahead(dataset)
        self.watch = CorpusWatch(dataset.shards)
        self.corpus_error: str | None = None  # set: the corpus changed; nothing is served
        self.max_ring_bytes, self.shm_budget_bytes = shm_caps(
            config.shm_dir, config.max_ring_bytes, config.shm_budget_bytes
        )
        self.shm_used = 0  # bytes of all live sessions' rings and control pages
        self.sessions: dict[str, Session] = {}
        self.opening: dict[str, Opening] = {}  # accepted opens waiting for plan and ring
        self._ring_maker = ThreadPoolExecutor(1, thread_name_prefix="rings")
        self._shortest = shortest_sample(dataset.lengths)
        self.by_rank: dict[tuple[str, int], str] = {}
        self.jobs: dict[str, _Job] = {}
        self.errors = 0
        self.started = time.monotonic()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._handlers: dict[str, Callable[[bytes, dict[str, Any]], None]] = {
            "open": self._on_open,
            "release": self._on_release,
            "heartbeat": self._on_heartbeat,
            "close": self._on_close,
            "stats": self._on_stats,
            "ping": self._on_ping,
        }
        self._rr = 0
        self._ipc: tuple[IpcAddress, tuple[int, int] | None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def bind(self) -> None:
        if self.config.curve_secret_key_file is not None:
            # CURVE: clients must know our public key; traffic is encrypted and only
            # clients holding it can complete the handshake.
            public, secret = zmq.auth.load_certificate(self.config.curve_secret_key_file)
            if secret is None:
                raise ValueError(f"{self.config.curve_secret_key_file} holds no secret key")
            self._sock.curve_server = True
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        if self.config.endpoint.startswith("ipc://"):
            self._bind_ipc()
        else:
            self._sock.bind(self.config.endpoint)

    def _bind_ipc(self) -> None:
        """Bind the socket file ourselves (``bind(2)`` never replaces a path, unlike
        ZeroMQ's ipc bind) and hand the descriptor to ZeroMQ. The file gets the rings'
        access rule: who may read rings may connect (connecting needs write permission)."""
        addr = IpcAddress.parse(self.config.endpoint)
        mode = self.config.shm_mode | (self.config.shm_mode & 0o444) >> 1
        fd = listen_ipc(addr, mode, self.config.group)
        self._ipc = (addr, socket_identity(addr))
        try:
            self._sock.setsockopt(zmq.USE_FD, fd)
            self._sock.bind(self.config.endpoint)
        except zmq.ZMQError as e:
            os.close(fd)
            remove_socket(*self._ipc)
            raise ValueError(f"cannot bind {self.config.endpoint}: {e}") from None

    def serve_forever(
        self, should_stop: Callable[[], bool], tick: Callable[[], None] | None = None
    ) -> None:
        """Run until ``should_stop()``; ``tick`` runs about every 100 ms (watchdog, status)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_tick = next_check = 0.0
        while not should_stop():
            if self.opening:
                self._advance_openings()
            if self._fill_one():
                if poller.poll(0):
                    self._drain(256)
            else:
                # Nothing to fill: ask the clients for a doorbell, look once more (a release
                # may have landed before the request was visible), then sleep: 1 ms while
                # some trainer is consuming (the counters are read on waking), else 20 ms.
                for sess in self.sessions.values():
                    sess.arm()
                if not self._fill_one() and poller.poll(self._sleep_ms()):
                    self._drain(256)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 0.1
                self._expire(now)
                if now >= next_check:
                    next_check = now + self.config.corpus_check_s
                    self.check_corpus()
                if tick is not None:
                    tick()

    def _sleep_ms(self) -> int:
        if self.opening:
            return 1  # a plan or ring may be ready any moment
        now = time.monotonic()
        busy = any(now - s.last_seen < _BUSY_S for s in self.sessions.values() if not s.ended)
        return 1 if busy else 20

    # --- the corpus ------------------------------------------------------------------------

    def check_corpus(self) -> bool:
        """True while the corpus is as opened; on a change, stop serving it (once)."""
        if self.corpus_error is None:
            why = self.watch.check()
            if why is not None:
                self._stop_serving_corpus(why)
        return self.corpus_error is None

    def _stop_serving_corpus(self, why: str) -> None:
        self.corpus_error = (
            f"{why}; the daemon stopped serving this corpus: restore it (or point the daemon "
            f"at a new one) and send SIGHUP, or restart the daemon"
        )
        log.error("%s", self.corpus_error)
        for sess in list(self.sessions.values()):
            self._tell(sess, "error", code=P.E_CORPUS, msg=self.corpus_error)
            self._drop(sess.sid, "the corpus changed")

    def replace_dataset(self, dataset: ArrowDataset) -> None:
        """Serve ``dataset`` (reopened on SIGHUP) from now on. The same corpus, unchanged,
        changes nothing; another one ends every session (``bye``: clients reconnect and
        find out whether their position still applies, by its fingerprint)."""
        old = self.dataset
        if dataset.fingerprint == old.fingerprint and self.corpus_error is None:
            dataset.close()
            log.info("reload: %s unchanged (fingerprint %s)", old.path, old.fingerprint)
            return
        for sess in list(self.sessions.values()):
            self._tell(sess, "bye", instance=self.instance, why="the corpus was reloaded")
            self._drop(sess.sid, "the corpus was reloaded")
        for sid in list(self.opening):  # planned on the old corpus; the clients retry
            self._drop(sid, "the corpus was reloaded")
        self.plans.close()
        self.readahead.close()
        self.dataset = dataset
        self._shortest = shortest_sample(dataset.lengths)
        self.plans = PlanCache(dataset.lengths, dataset.fingerprint)
        self.readahead = Readahead(dataset)
        self.watch = CorpusWatch(dataset.shards)
        self.corpus_error = None
        old.close()
        log.info(
            "reload: serving %s, %d samples, fingerprint %s (was %s)",
            dataset.path,
            dataset.num_samples,
            dataset.fingerprint,
            old.fingerprint,
        )

    def shutdown(self) -> None:
        """Tell every client, unlink every ring, close the socket."""
        for sess in list(self.sessions.values()):
            self._tell(sess, "bye", instance=self.instance)
            self._drop(sess.sid, "daemon shutting down")
        for sid in list(self.opening):
            self._drop(sid, "daemon shutting down")
        self._ring_maker.shutdown(wait=True)  # rings being made are closed by _drop
        self.plans.close()
        self.readahead.close()
        self._sock.close(linger=200)
        self._ctx.term()
        if self._ipc is not None:
            remove_socket(*self._ipc)

    # --- messages ------------------------------------------------------------------------

    def _drain(self, limit: int) -> None:
        for _ in range(limit):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list[bytes]) -> None:
        peer = frames[0]
        if len(frames) != 2:
            self._reject(peer, P.E_MALFORMED, f"expected 1 message frame, got {len(frames) - 1}")
            return
        try:
            msg = P.decode(frames[1])
        except P.ProtocolError as e:
            code = P.E_VERSION if "protocol version" in str(e) else P.E_MALFORMED
            self._reject(peer, code, str(e))
            return
        handler = self._handlers.get(msg["t"])
        if handler is None:
            self._reject(peer, P.E_BAD_REQUEST, f"unknown message type {msg['t']!r}")
            return
        try:
            handler(peer, msg)
        except _UnknownSession as e:
            self._reject(peer, P.E_UNKNOWN_SESSION, str(e), sid=msg.get("s"))
        except ShmSpaceError as e:
            self._reject(peer, P.E_NO_SPACE, str(e))
        except (_Mismatch, SpecMismatch) as e:
            self._reject(peer, P.E_MISMATCH, str(e))
        except _Busy as e:
            self._reject(peer, P.E_BUSY, str(e))
        except _CorpusChanged as e:
            self._reject(peer, P.E_CORPUS, str(e))
        except (ValueError, P.ProtocolError) as e:
            self._reject(peer, P.E_BAD_REQUEST, str(e), sid=msg.get("s"))
        except Exception as e:  # one bad request must not take the daemon down
            log.exception("internal error handling %r", msg.get("t"))
            self._reject(peer, P.E_INTERNAL, f"{type(e).__name__}: {e}")

    def _reject(self, peer: bytes, code: str, text: str, sid: Any = None) -> None:
        self.errors += 1
        log.warning("rejected request from %s: %s (%s)", peer.hex()[:12], text, code)
        extra = {"s": sid} if isinstance(sid, str) else {}
        self._send(peer, "error", code=code, msg=text, **extra)
        sess = self.sessions.get(sid) if isinstance(sid, str) else None
        if sess is not None:
            sess.ring.ring_bell()

    def _send(self, peer: bytes, kind: str, **fields: Any) -> bool:
        try:
            self._sock.send_multipart([peer, P.encode(kind, **fields)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            log.info("cannot reach client %s (%s)", peer.hex()[:12], e.strerror)
            return False

    def _tell(self, sess: Session, kind: str, **fields: Any) -> None:
        """Send a session's client a message and ring its bell: it may sleep on the ring.
        A client ZeroMQ cannot reach (ROUTER_MANDATORY) is gone: its session ends now."""
        if not self._send(sess.peer, kind, s=sess.sid, **fields):
            self._drop(sess.sid, "client unreachable")
            return
        sess.ring.ring_bell()

    def _session(self, msg: dict[str, Any]) -> Session:
        sid = msg.get("s")
        sess = self.sessions.get(sid) if isinstance(sid, str) else None
        if sess is None:
            raise _UnknownSession(sid)
        sess.last_seen = time.monotonic()
        return sess

    def _on_open(self, peer: bytes, msg: dict[str, Any]) -> None:
        """Check an ``open`` now; plan and map in the background (``service.opening``)."""
        if not self.check_corpus():
            raise _CorpusChanged(self.corpus_error)
        c = self.config
        ds = self.dataset
        req = parse_open(msg, c.spec_defaults, c.limits, ds.num_samples, ds.fingerprint)
        self._admit(peer, req)
        try:
            layout = slot_layout_for(req.spec, self._shortest)
            need = ring_bytes(layout, c.slots)
            self._check_space(need, req.spec)
            sid = secrets.token_hex(6)
            path = c.shm_dir / segment_name(self.instance, sid)
            ring: Future[ShmRing]
            if need <= SYNC_RING_BYTES:  # reserving a small ring takes ~1 ms: do it now
                ring = Future()
                ring.set_result(ShmRing(path, layout, c.slots, mode=c.shm_mode, group=c.group))
            else:
                ring = self._ring_maker.submit(
                    ShmRing, path, layout, c.slots, mode=c.shm_mode, group=c.group
                )
        except BaseException:
            self._forget("", req.job, req.rank)  # the job admitted above has no session
            raise
        op = Opening(sid, peer, req, need, self.plans.future(req.spec, req.start[0]), ring)
        self.opening[sid] = op
        self.by_rank[(req.job, req.rank)] = sid
        self.shm_used += need
        if not self._advance(op):
            self._send(peer, "pending", s=sid)

    def _admit(self, peer: bytes, req: OpenRequest) -> None:
        """One live client per (job, rank); the job's ranks agree; session caps."""
        key = (req.job, req.rank)
        old = self.by_rank.get(key)
        if old is not None:
            old_peer = self._peer_of(old)
            # ROUTER_MANDATORY: a send reaches only a connected client. A dead trainer's
            # connection is gone (its process closed it), so its restart replaces it.
            if old_peer != peer and self._send(old_peer, "hb", s=old):
                raise _Busy(
                    f"rank {req.rank} of job {req.job!r} is already being read by a live "
                    f"client (session {old}); a second reader would get part of the batches. "
                    f"Stop the other process first (a restarted trainer replaces a dead one "
                    f"at once)"
                )
            if old_peer != peer:  # its client is gone: it must not count as holding the job
                self._drop(old, "replaced by a new session of the same rank")
                old = None
        known = self.jobs.get(req.job)
        if known is not None and (
            known.world_size != req.world_size or known.spec.key() != req.spec.key()
        ):
            # A job restarted with another spec (or world size) meets its previous run's
            # sessions. Those whose trainer has exited without closing them (kill -9, OOM)
            # have lost their connection: end them now instead of at their timeout, so the
            # new spec is judged only against sessions that are really still in use.
            self._drop_unreachable(req.job, keep=old)
        if not any(x.job == req.job and x.sid != old for x in self._sessions_and_openings()):
            self.jobs.pop(req.job, None)  # nothing else holds the job: its spec may change
        self._check_job(req.job, req.spec, req.world_size)
        if old is not None:
            self._drop(old, "replaced by a new session of the same rank")
        everyone = list(self._sessions_and_openings())
        if len(everyone) >= self.config.max_sessions:
            raise ValueError(f"too many sessions (max_sessions={self.config.max_sessions})")
        mine = sum(1 for x in everyone if x.peer == peer)
        if mine >= self.config.max_sessions_per_peer:
            raise ValueError(
                f"this connection already has {mine} sessions "
                f"(max_sessions_per_peer={self.config.max_sessions_per_peer})"
            )

    def _sessions_and_openings(self) -> Iterator[_Party]:
        for sess in self.sessions.values():
            yield _Party(sess.sid, sess.peer, sess.job)
        for op in self.opening.values():
            yield _Party(op.sid, op.peer, op.req.job)

    def _drop_unreachable(self, job: str, keep: str | None) -> None:
        """End the sessions (and openings) of ``job`` whose client ZeroMQ cannot reach."""
        for party in list(self._sessions_and_openings()):
            other = party.job == job and party.sid != keep
            if other and not self._send(party.peer, "hb", s=party.sid):
                self._drop(party.sid, "its client is gone (found while admitting a new spec)")

    def _holders(self, job: str, limit: int = 4) -> str:
        """The sessions still open for ``job``, each with when it opened and when it expires
        if its client stays silent (a live client's heartbeats keep pushing that out)."""
        now, wall = time.monotonic(), time.time()
        timeout = self.config.session_timeout_s
        parts = []
        for sess in sorted(self.sessions.values(), key=lambda x: x.rank):
            if sess.job != job:
                continue
            silent = now - sess.last_seen
            parts.append(
                f"rank {sess.rank} (session {sess.sid}, opened {_clock(sess.opened_at)}, last "
                f"message {silent:.0f} s ago, expires {_clock(wall + timeout - silent)} if its "
                f"client stays silent)"
            )
        for op in self.opening.values():
            if op.req.job == job:
                parts.append(
                    f"rank {op.req.rank} (session {op.sid}, opened {_clock(op.opened_at)}, "
                    f"still being prepared)"
                )
        more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
        return ", ".join(parts[:limit]) + more

    def _peer_of(self, sid: str) -> bytes:
        sess = self.sessions.get(sid)
        return sess.peer if sess is not None else self.opening[sid].peer

    def _advance(self, op: Opening) -> bool:
        """Finish an opening whose plan and ring are ready: welcome, or refuse. True if done."""
        if not op.ready():
            return False
        del self.opening[op.sid]
        try:
            ring = op.ring.result()
        except Exception as e:
            self._refuse_opening(op, e, None)
            return True
        try:
            plan = op.plan.result()
            check_start(op.req.start, plan, self.dataset.num_samples)
        except Exception as e:
            self._refuse_opening(op, e, ring)
            return True
        self._start_session(op, ring, plan)
        return True

    def _refuse_opening(self, op: Opening, error: Exception, ring: ShmRing | None) -> None:
        if ring is not None:
            ring.close()
        self.shm_used -= op.nbytes
        self._forget(op.sid, op.req.job, op.req.rank)
        if isinstance(error, ShmSpaceError):
            code = P.E_NO_SPACE
        elif isinstance(error, ValueError):
            code = P.E_BAD_REQUEST
        else:
            log.error("session %s: %s: %s", op.sid, type(error).__name__, error)
            code, error = P.E_INTERNAL, RuntimeError(f"planning failed: {error}")
        self._reject(op.peer, code, str(error))

    def _advance_openings(self) -> None:
        now = time.monotonic()
        for op in list(self.opening.values()):
            if not self._advance(op) and now >= op.next_notice:
                op.next_notice = now + 1.0
                if not self._send(op.peer, "pending", s=op.sid):
                    self._drop(op.sid, "client gone while its session was being prepared")

    def _start_session(self, op: Opening, ring: ShmRing, plan: EpochPlan) -> None:
        req = op.req
        sess = Session(
            op.sid,
            op.peer,
            job=req.job,
            rank=req.rank,
            spec=req.spec,
            ring=ring,
            start=req.start,
            end_epoch=req.epochs,
            pad_id=self.config.pad_id,
        )
        sess.opened_at = op.opened_at
        self.sessions[sess.sid] = sess
        for ahead in range(READAHEAD_DEPTH):  # later ones are requested as it fills
            self._read_ahead(sess, plan, ahead)
        sent = self._send(
            op.peer,
            "welcome",
            s=sess.sid,
            shm=str(ring.path),
            ctl=str(ring.control_path),
            slots=ring.num_slots,
            slot_bytes=ring.layout.slot_bytes,
            layout=ring.layout.to_wire(),
            steps=plan.num_steps,
            instance=self.instance,
            fingerprint=self.dataset.fingerprint,
            spec=req.spec.to_dict(),
        )
        if not sent:
            self._drop(sess.sid, "client gone before its welcome")
            return
        log.info(
            "session %s: job %s rank %d/%d from %s",
            sess.sid,
            req.job,
            req.rank,
            req.world_size,
            req.start,
        )

    def _check_job(self, job: str, spec: BatchSpec, world: int) -> None:
        known = self.jobs.get(job)
        if known is None:
            self.jobs[job] = _Job(spec, world)
            return
        if known.world_size != world:
            raise _Mismatch(
                f"job {job!r} runs with world_size {known.world_size}, not {world}"
                + self._still_open(job)
            )
        if known.spec.key() != spec.key():
            a, b = known.spec.to_dict(), spec.to_dict()
            diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            raise _Mismatch(
                f"job {job!r} runs with another spec; differences (job, yours): {diff}"
                + self._still_open(job)
            )

    def _still_open(self, job: str) -> str:
        return (
            f". A job's spec can change once all its sessions are closed; still open: "
            f"{self._holders(job)}. A trainer stopped with SIGTERM closes its sessions, an "
            f"exited one loses them at once; a live one keeps them"
        )

    def _check_space(self, need: int, spec: BatchSpec) -> None:
        what = (
            f"a ring for this spec takes {need:,} bytes ({self.config.slots} slots for "
            f"token_budget {spec.token_budget}, max_batch_size {spec.max_batch_size}, "
            f"layout {spec.layout})"
        )
        if need > self.max_ring_bytes:
            raise ShmSpaceError(
                f"{what}, over the per-session cap of {self.max_ring_bytes:,} bytes "
                f"(max_ring_bytes); lower token_budget or max_batch_size"
            )
        if self.shm_used + need > self.shm_budget_bytes:
            raise ShmSpaceError(
                f"{what}, but {self.shm_used:,} of the daemon's {self.shm_budget_bytes:,} "
                f"bytes of shared memory (shm_budget_bytes) are in use by "
                f"{len(self.sessions)} session(s); try again when some have ended"
            )

    def _on_release(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._session(msg)  # a doorbell: the loop reads the counter; this proves liveness

    def _on_heartbeat(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._tell(self._session(msg), "hb")

    def _on_close(self, peer: bytes, msg: dict[str, Any]) -> None:
        sess = self._session(msg)
        self._drop(sess.sid, "closed by client")
        # The acknowledgement lets a client that is about to exit know its "close" arrived
        # (its socket's pending messages die with the process).
        self._send(peer, "closed", s=sess.sid)

    def _on_ping(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._send(peer, "pong", instance=self.instance, pid=os.getpid())

    def _on_stats(self, peer: bytes, msg: dict[str, Any]) -> None:
        self._send(peer, "stats", **self.stats())

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        sessions = []
        for s in list(self.sessions.values()):  # a copy: the exporter thread calls this too
            age = max(now - s.stats.started, 1e-9)
            sessions.append(
                {
                    "session": s.sid,
                    "job": s.job,
                    "rank": s.rank,
                    "world_size": s.spec.world_size,
                    "pos": list(s.pos),
                    "ring_fill": s.produced - s.consumed,
                    "slots": s.ring.num_slots,
                    "batches": s.stats.batches,
                    "tokens": s.stats.tokens,
                    "tokens_per_s": s.stats.tokens / age,
                    "client_wait_s": s.ring.client_wait_s(),
                    "age_s": age,
                    "opened_at": s.opened_at,  # Unix time
                }
            )
        return {
            "instance": self.instance,
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            "dataset": str(self.dataset.path),
            "corpus_error": self.corpus_error,
            "fingerprint": self.dataset.fingerprint,
            "samples": self.dataset.num_samples,
            "errors": self.errors,
            "sessions": sessions,
        }

    # --- production ----------------------------------------------------------------------

    def _fill_one(self) -> bool:
        """Fill one slot of the next session (round robin) that can take one."""
        order = list(self.sessions.values())
        for k in range(len(order)):
            sess = order[(self._rr + k) % len(order)]
            if sess.ended:
                continue
            try:
                filled = self._fill(sess)
            except ValueError as e:  # this session's own doing (its control page): it ends
                self._tell(sess, "error", code=P.E_BAD_REQUEST, msg=str(e))
                self._drop(sess.sid, str(e))
                continue
            if filled:
                self._rr = (self._rr + k + 1) % max(len(order), 1)
                return True
        return False

    def _fill(self, sess: Session) -> bool:
        """Fill the session's next slot if it has a free one and its plan is ready."""
        sess.sync()
        if not sess.can_fill:
            return False
        if sess.finished:
            sess.ended = True
            self._tell(sess, "end")
            return False
        plan = self._plan_for(sess)
        if plan is None:
            if sess.sid in self.sessions:
                sess.nudge()
            return False
        try:
            sess.fill(plan, self.dataset)
        except CorpusFaultError as e:  # a page of the corpus vanished (SIGBUS)
            log.warning("session %s: %s", sess.sid, e)
            self._stop_serving_corpus(self.watch.check() or f"reading the corpus failed: {e}")
            return False
        except DatasetError as e:  # a value that cannot be served exactly
            if not self.check_corpus():  # because the file changed under the daemon
                return False
            log.error("session %s (job %s rank %d): %s", sess.sid, sess.job, sess.rank, e)
            self._tell(sess, "error", code=P.E_CORPUS, msg=str(e))
            self._drop(sess.sid, str(e))
            return False
        self._read_ahead(sess, plan)
        return True

    def _read_ahead(self, sess: Session, plan: Any, ahead: int = READAHEAD_DEPTH) -> None:
        """Request the pages of the session's micro-batch ``ahead`` further on (in the next
        epoch's plan if this one ends first and that plan is ready)."""
        if not self.readahead.active:
            return
        e, s, m = sess.pos
        ga = sess.spec.grad_accum
        step, micro = divmod(s * ga + m + ahead, ga)
        if e != plan.epoch:
            return
        if step >= plan.num_steps:
            if sess.end_epoch is not None and e + 1 >= sess.end_epoch:
                return
            step -= plan.num_steps
            plan = self.plans.try_get(sess.spec, e + 1)
            if plan is None or step >= plan.num_steps:
                return
        self.readahead.submit(plan.micro(step, sess.rank, micro), sess.spec.max_seq_len)

    def _plan_for(self, sess: Session) -> Any:
        """The plan for the session's position, moving past epoch ends; None if not ready."""
        while True:
            if not self.plans.has(sess.spec, sess.pos[0]) and not self.check_corpus():
                return None  # checked before planning an epoch; the session has ended
            try:
                plan = self.plans.try_get(sess.spec, sess.pos[0])
            except Exception as e:
                self._tell(sess, "error", code=P.E_INTERNAL, msg=f"planning failed: {e}")
                self._drop(sess.sid, f"planning failed: {e}")
                return None
            if plan is None:
                return None
            if plan.num_steps == 0:
                text = (
                    f"epoch {sess.pos[0]} has no steps: {self.dataset.num_samples} samples are "
                    f"too few for {sess.spec.micro_per_step} micro-batches per step"
                )
                self._tell(sess, "error", code=P.E_BAD_REQUEST, msg=text)
                self._drop(sess.sid, text)
                return None
            if sess.pos[1] < plan.num_steps:
                nxt = sess.pos[0] + 1
                if sess.planned_ahead < nxt and not (
                    sess.end_epoch is not None and nxt >= sess.end_epoch
                ):
                    # Prepare the next epoch as soon as this one starts: on a small corpus
                    # an epoch can take less time than planning the next.
                    if not self.plans.has(sess.spec, nxt) and not self.check_corpus():
                        return None
                    self.plans.prefetch(sess.spec, nxt)
                    sess.planned_ahead = nxt
                return plan
            sess.pos = (sess.pos[0] + 1, 0, 0)  # a resume position past this epoch's end
            if sess.finished:
                return None

    def _expire(self, now: float) -> None:
        for sess in list(self.sessions.values()):
            if now - sess.last_seen > self.config.session_timeout_s:
                self._drop(sess.sid, f"no message for {self.config.session_timeout_s:.0f} s")

    def _drop(self, sid: str, why: str) -> None:
        op = self.opening.pop(sid, None)
        if op is not None:  # still being prepared: its ring is closed once made
            op.ring.add_done_callback(_close_ring)
            self.shm_used -= op.nbytes
            self._forget(sid, op.req.job, op.req.rank)
            log.info("session %s (job %s rank %d) closed: %s", sid, op.req.job, op.req.rank, why)
            return
        sess = self.sessions.pop(sid, None)
        if sess is None:
            return
        sess.ring.close()
        self.shm_used -= sess.ring.nbytes
        self._forget(sid, sess.job, sess.rank)
        log.info("session %s (job %s rank %d) closed: %s", sid, sess.job, sess.rank, why)

    def _forget(self, sid: str, job: str, rank: int) -> None:
        if self.by_rank.get((job, rank)) == sid:
            del self.by_rank[(job, rank)]
        if not any(x.job == job for x in self._sessions_and_openings()):
            self.jobs.pop(job, None)


def _clock(t: float) -> str:
    """A wall-clock time as the journal shows it: local, to the second, with the offset."""
    return datetime.fromtimestamp(t).astimezone().isoformat(sep=" ", timespec="seconds")


def _close_ring(fut: Future[ShmRing]) -> None:
    if fut.exception() is None:
        fut.result().close()


@dataclass(frozen=True)
class _Party:
    """A session or an opening, as far as identity and caps are concerned."""

    sid: str
    peer: bytes
    job: str


class _UnknownSession(P.ProtocolError):
    def __init__(self, sid: Any) -> None:
        super().__init__(f"unknown session {sid!r} (the daemon restarted or expired it)")


class _Mismatch(SpecMismatch):
    pass


class _CorpusChanged(Exception):
    pass


class _Busy(Exception):
    pass
