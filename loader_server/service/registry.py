"""Who holds what: the daemon's sessions, the opens still being prepared, and their jobs.

Admission rules (``admit``): one live client per (job, rank), so no batch is read twice;
all open sessions of a job share its spec and world size (the job's spec may change once
none is left); caps on sessions, in all and per connection, and on shared memory (``shm_used``
against ``max_ring_bytes`` per ring and ``shm_budget_bytes`` in all). A client counts as live
when a message reaches it: ZeroMQ's ROUTER_MANDATORY fails a send to a peer whose connection
is gone, which is how a dead trainer's sessions are told from a live one's.

The registry owns every session's ring: it makes them (small ones at once, large ones on a
helper thread) and closes them when the session ends.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from loader_server.service.config import DaemonConfig
from loader_server.service.errors import RankBusy, UnknownSession
from loader_server.service.opening import SYNC_RING_BYTES, Opening, OpenRequest, SpecMismatch
from loader_server.service.rings import ShmRing, ShmSpaceError, ring_bytes, segment_name
from loader_server.service.session import Session, slot_layout_for
from loader_server.wire.spec import BatchSpec

log = logging.getLogger(__name__)
# Sessions and opens of the whole daemon: far above any real cluster's ranks, low enough
# that a ``stats`` reply listing them all fits protocol.MAX_STATS_BYTES.
MAX_SESSIONS = 1024
# A session id's random bytes: 12 hex characters, as ring names carry them (wire.ring).
SESSION_ID_BYTES = 6
# Sessions named in a "job still open" refusal; the rest are counted, to keep it one line.
HOLDERS_SHOWN = 4


class Send(Protocol):
    """Sends one message to a client; False when the client cannot be reached."""

    def __call__(self, peer: bytes, kind: str, **fields: Any) -> bool: ...


@dataclass
class Job:
    spec: BatchSpec
    world_size: int


@dataclass(frozen=True)
class Party:
    """A session or an opening, as far as identity and caps are concerned."""

    sid: str
    peer: bytes
    job: str


class Registry:
    """Owns the sessions, the openings, the jobs and the shared memory they take."""

    def __init__(
        self,
        config: DaemonConfig,
        send: Send,
        *,
        instance: str,
        max_ring_bytes: int,
        shm_budget_bytes: int,
    ) -> None:
        self._config = config
        self._send = send
        self._instance = instance
        self.max_ring_bytes = max_ring_bytes
        self.shm_budget_bytes = shm_budget_bytes
        self.shm_used = 0  # bytes of all live sessions' rings and control pages
        self.sessions: dict[str, Session] = {}
        self.opening: dict[str, Opening] = {}  # accepted opens waiting for plan and ring
        self.by_rank: dict[tuple[str, int], str] = {}
        self.jobs: dict[str, Job] = {}
        self._ring_maker = ThreadPoolExecutor(1, thread_name_prefix="rings")

    # --- admission -------------------------------------------------------------------------

    def admit(self, peer: bytes, req: OpenRequest) -> None:
        """One live client per (job, rank); the job's ranks agree; session caps."""
        key = (req.job, req.rank)
        old = self.by_rank.get(key)
        if old is not None:
            old_peer = self._peer_of(old)
            # ROUTER_MANDATORY: a send reaches only a connected client. A dead trainer's
            # connection is gone (its process closed it), so its restart replaces it.
            if old_peer != peer and self._send(old_peer, "hb", s=old):
                raise RankBusy(
                    f"rank {req.rank} of job {req.job!r} is already being read by a live "
                    f"client (session {old}); a second reader would get part of the batches. "
                    f"Stop the other process first (a restarted trainer replaces a dead one "
                    f"at once)"
                )
            if old_peer != peer:  # its client is gone: it must not count as holding the job
                self.drop(old, "replaced by a new session of the same rank")
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
        if not any(x.job == req.job and x.sid != old for x in self._parties()):
            self.jobs.pop(req.job, None)  # nothing else holds the job: its spec may change
        self._check_job(req.job, req.spec, req.world_size)
        if old is not None:
            self.drop(old, "replaced by a new session of the same rank")
        everyone = list(self._parties())
        if len(everyone) >= MAX_SESSIONS:
            raise ValueError(f"too many sessions (max_sessions={MAX_SESSIONS})")
        mine = sum(1 for x in everyone if x.peer == peer)
        if mine >= self._config.max_sessions_per_peer:
            raise ValueError(
                f"this connection already has {mine} sessions "
                f"(max_sessions_per_peer={self._config.max_sessions_per_peer})"
            )

    def _check_job(self, job: str, spec: BatchSpec, world: int) -> None:
        known = self.jobs.get(job)
        if known is None:
            self.jobs[job] = Job(spec, world)
            return
        if known.world_size != world:
            raise SpecMismatch(
                f"job {job!r} runs with world_size {known.world_size}, not {world}"
                + self._still_open(job)
            )
        if known.spec.key() != spec.key():
            a, b = known.spec.to_dict(), spec.to_dict()
            diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            raise SpecMismatch(
                f"job {job!r} runs with another spec; differences (job, yours): {diff}"
                + self._still_open(job)
            )

    def _still_open(self, job: str) -> str:
        return (
            f". A job's spec can change once all its sessions are closed; still open: "
            f"{self._holders(job)}. A trainer stopped with SIGTERM closes its sessions, an "
            f"exited one loses them at once; a live one keeps them"
        )

    def _holders(self, job: str) -> str:
        """The sessions still open for ``job``, each with when it opened and when it expires
        if its client stays silent (a live client's heartbeats keep pushing that out)."""
        now, wall = time.monotonic(), time.time()
        timeout = self._config.session_timeout_s
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
        limit = HOLDERS_SHOWN
        more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
        return ", ".join(parts[:limit]) + more

    def _parties(self) -> Iterator[Party]:
        """Every session and opening."""
        for sess in self.sessions.values():
            yield Party(sess.sid, sess.peer, sess.job)
        for op in self.opening.values():
            yield Party(op.sid, op.peer, op.req.job)

    def _peer_of(self, sid: str) -> bytes:
        sess = self.sessions.get(sid)
        return sess.peer if sess is not None else self.opening[sid].peer

    def _drop_unreachable(self, job: str, keep: str | None) -> None:
        """End the sessions (and openings) of ``job`` whose client ZeroMQ cannot reach."""
        for party in list(self._parties()):
            other = party.job == job and party.sid != keep
            if other and not self._send(party.peer, "hb", s=party.sid):
                self.drop(party.sid, "its client is gone (found while admitting a new spec)")

    # --- rings and openings ----------------------------------------------------------------

    def make_ring(self, req: OpenRequest, shortest: int) -> tuple[str, int, Future[ShmRing]]:
        """(session id, bytes reserved, its ring) for an admitted ``req``: made now when
        small, else on the ring thread. ``shortest``: the corpus's shortest sample. On any
        failure the admission is undone and the error raised (ShmSpaceError: no room)."""
        c = self._config
        try:
            layout = slot_layout_for(req.spec, shortest)
            need = ring_bytes(layout, c.slots)
            self._check_space(need, req.spec)
            sid = secrets.token_hex(SESSION_ID_BYTES)
            path = c.shm_dir / segment_name(self._instance, sid)
            ring: Future[ShmRing]
            if need <= SYNC_RING_BYTES:  # reserving a small ring takes ~1 ms: do it now
                ring = Future()
                ring.set_result(ShmRing(path, layout, c.slots, mode=c.shm_mode, group=c.group))
            else:
                ring = self._ring_maker.submit(
                    ShmRing, path, layout, c.slots, mode=c.shm_mode, group=c.group
                )
        except BaseException:
            self._forget("", req.job, req.rank)  # the job admitted before has no session
            raise
        return sid, need, ring

    def _check_space(self, need: int, spec: BatchSpec) -> None:
        what = (
            f"a ring for this spec takes {need:,} bytes ({self._config.slots} slots for "
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

    def add_opening(self, op: Opening) -> None:
        """Hold an accepted open (its ring from ``make_ring``) until it is finished."""
        self.opening[op.sid] = op
        self.by_rank[(op.req.job, op.req.rank)] = op.sid
        self.shm_used += op.nbytes

    def take_opening(self, op: Opening) -> None:
        """``op`` is ready: the caller now finishes it with ``start`` or ``refuse``."""
        del self.opening[op.sid]

    def refuse(self, op: Opening, ring: ShmRing | None) -> None:
        """Undo a taken opening that will not become a session."""
        if ring is not None:
            ring.close()
        self.shm_used -= op.nbytes
        self._forget(op.sid, op.req.job, op.req.rank)

    def start(self, op: Opening, ring: ShmRing) -> Session:
        """The session a taken opening becomes."""
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
            pad_id=self._config.pad_id,
            legs=req.legs,
        )
        sess.opened_at = op.opened_at
        self.sessions[sess.sid] = sess
        return sess

    # --- sessions ------------------------------------------------------------------------

    def session(self, msg: dict[str, Any]) -> Session:
        """The session a message names (it has just shown that its client is alive)."""
        sid = msg.get("s")
        sess = self.sessions.get(sid) if isinstance(sid, str) else None
        if sess is None:
            raise UnknownSession(sid)
        sess.last_seen = time.monotonic()
        return sess

    def tell(self, sess: Session, kind: str, **fields: Any) -> None:
        """Send a session's client a message and ring its bell: it may sleep on the ring.
        A client ZeroMQ cannot reach (ROUTER_MANDATORY) is gone: its session ends now."""
        if not self._send(sess.peer, kind, s=sess.sid, **fields):
            self.drop(sess.sid, "client unreachable")
            return
        sess.ring.ring_bell()

    def end_sessions(self, reason: str, kind: str, /, **fields: Any) -> None:
        """Tell every session's client ``kind`` (with ``fields``) and end the session, for
        ``reason`` (logged)."""
        for sess in list(self.sessions.values()):
            self.tell(sess, kind, **fields)
            self.drop(sess.sid, reason)

    def drop_openings(self, why: str) -> None:
        for sid in list(self.opening):
            self.drop(sid, why)

    def expire(self, now: float) -> None:
        """End the sessions whose client has been silent for ``session_timeout_s``."""
        timeout = self._config.session_timeout_s
        for sess in list(self.sessions.values()):
            if now - sess.last_seen > timeout:
                self.drop(sess.sid, f"no message for {timeout:.0f} s")

    def drop(self, sid: str, why: str) -> None:
        """End a session or an opening (if it still exists) and free its ring."""
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
        if not any(x.job == job for x in self._parties()):
            self.jobs.pop(job, None)

    def close(self) -> None:
        """After every session and opening was dropped: wait for rings being made (each is
        closed as it completes, by ``drop``)."""
        self._ring_maker.shutdown(wait=True)


def _clock(t: float) -> str:
    """A wall-clock time as the journal shows it: local, to the second, with the offset."""
    return datetime.fromtimestamp(t).astimezone().isoformat(sep=" ", timespec="seconds")


def _close_ring(fut: Future[ShmRing]) -> None:
    if fut.exception() is None:
        fut.result().close()
