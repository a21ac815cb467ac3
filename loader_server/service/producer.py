"""Production: filling the sessions' rings from the corpus, one slot at a time.

``fill_one`` fills one free slot of one session (round robin), so a slow or misbehaving
client cannot starve the others. Each session walks its plan; at an epoch's end it moves
on to the next epoch's plan, which was asked for (in the background) as soon as the epoch
began. After each fill the pages of the micro-batch ``READAHEAD_DEPTH`` further on are
requested from the read-ahead thread.

The producer owns the corpus being served: the dataset, its plans, its read-ahead and the
watch that notices the files changing (then nothing is served until a reload).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from loader_server.data.corpus_watch import CorpusWatch
from loader_server.data.dataset import ArrowDataset, CorpusFaultError, DatasetError
from loader_server.planning.planner import EpochPlan
from loader_server.service.opening import no_steps
from loader_server.service.plans import PlanCache
from loader_server.service.readahead import DEPTH as READAHEAD_DEPTH
from loader_server.service.readahead import Readahead
from loader_server.service.registry import Registry
from loader_server.service.session import Session, shortest_sample
from loader_server.wire import protocol as P
from loader_server.wire.protocol import Leg
from loader_server.wire.spec import BatchSpec

log = logging.getLogger(__name__)


class Producer:
    """Fills the registry's sessions from one corpus; owns that corpus's plans."""

    def __init__(self, dataset: ArrowDataset, registry: Registry) -> None:
        self._registry = registry
        self._rr = 0  # where the next round-robin look starts
        self._serve(dataset)

    def _serve(self, dataset: ArrowDataset) -> None:
        self.dataset = dataset
        self.shortest = shortest_sample(dataset.lengths)
        self.plans = PlanCache(dataset.lengths, dataset.fingerprint)
        self.readahead = Readahead(dataset)
        self.watch = CorpusWatch(dataset.shards)
        self.corpus_error: str | None = None  # set: the corpus changed; nothing is served

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
        self._registry.end_sessions(
            "the corpus changed", "error", code=P.E_CORPUS, msg=self.corpus_error
        )

    def serves(self, dataset: ArrowDataset) -> bool:
        """Whether ``dataset`` is the corpus being served, unchanged and still served."""
        return dataset.fingerprint == self.dataset.fingerprint and self.corpus_error is None

    def replace(self, dataset: ArrowDataset) -> None:
        """Serve ``dataset`` from now on (no session may use the old one any more)."""
        old = self.dataset
        self.close()
        self._serve(dataset)
        old.close()

    def close(self) -> None:
        self.plans.close()
        self.readahead.close()

    # --- filling ---------------------------------------------------------------------------

    def plan_future(
        self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...] = ()
    ) -> Future[EpochPlan]:
        """The plan of ``epoch`` (of what ``legs`` left of it) under ``spec`` (planning
        starts now if it has not)."""
        return self.plans.future(spec, epoch, legs)

    def start(self, sess: Session, plan: EpochPlan) -> None:
        """A new session: request the pages of its first micro-batches."""
        for ahead in range(READAHEAD_DEPTH):  # later ones are requested as it fills
            self._read_ahead(sess, plan, ahead)

    def arm(self) -> None:
        """Before the daemon sleeps: every session asks its client for a doorbell."""
        for sess in self._registry.sessions.values():
            sess.arm()

    def fill_one(self) -> bool:
        """Fill one slot of the next session (round robin) that can take one."""
        order = list(self._registry.sessions.values())
        for k in range(len(order)):
            sess = order[(self._rr + k) % len(order)]
            if sess.ended:
                continue
            try:
                filled = self._fill(sess)
            except ValueError as e:  # this session's own doing (its control page): it ends
                self._registry.tell(sess, "error", code=P.E_BAD_REQUEST, msg=str(e))
                self._registry.drop(sess.sid, str(e))
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
            self._registry.tell(sess, "end")
            return False
        plan = self._plan_for(sess)
        if plan is None:
            if sess.sid in self._registry.sessions:
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
            self._registry.tell(sess, "error", code=P.E_CORPUS, msg=str(e))
            self._registry.drop(sess.sid, str(e))
            return False
        self._read_ahead(sess, plan)
        return True

    def _read_ahead(self, sess: Session, plan: EpochPlan, ahead: int = READAHEAD_DEPTH) -> None:
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
            nxt = self.plans.try_get(sess.spec, e + 1)
            if nxt is None or step >= nxt.num_steps:
                return
            plan = nxt
        self.readahead.submit(plan.micro(step, sess.rank, micro), sess.spec.max_seq_len)

    def _plan_for(self, sess: Session) -> EpochPlan | None:
        """The plan for the session's position, moving past epoch ends; None if not ready."""
        while True:
            if not self.plans.has(sess.spec, sess.pos[0], sess.legs) and not self.check_corpus():
                return None  # checked before planning an epoch; the session has ended
            try:
                plan = self.plans.try_get(sess.spec, sess.pos[0], sess.legs)
            except Exception as e:
                self._registry.tell(sess, "error", code=P.E_INTERNAL, msg=f"planning failed: {e}")
                self._registry.drop(sess.sid, f"planning failed: {e}")
                return None
            if plan is None:
                return None
            if plan.num_steps == 0:
                text = no_steps(sess.pos[0], plan, self.dataset.lengths)
                self._registry.tell(sess, "error", code=P.E_BAD_REQUEST, msg=text)
                self._registry.drop(sess.sid, text)
                return None
            if sess.pos[1] < plan.num_steps:
                return plan if self._plan_next_epoch(sess) else None
            sess.pos, sess.legs = (sess.pos[0] + 1, 0, 0), ()  # a position past this epoch's end
            if sess.finished:
                return None

    def _plan_next_epoch(self, sess: Session) -> bool:
        """Prepare the epoch after the session's as soon as its epoch starts: on a small
        corpus an epoch can take less time than planning the next. False when the corpus,
        checked before planning, changed (the session has ended)."""
        nxt = sess.pos[0] + 1
        if sess.planned_ahead >= nxt or (sess.end_epoch is not None and nxt >= sess.end_epoch):
            return True
        if not self.plans.has(sess.spec, nxt) and not self.check_corpus():
            return False
        self.plans.prefetch(sess.spec, nxt)
        sess.planned_ahead = nxt
        return True
