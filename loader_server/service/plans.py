"""Epoch plans computed on demand, cached, and prepared one epoch ahead in the background.

Plans are keyed by ``(spec key, epoch, legs)`` (one cache per corpus; ``legs``: the shape
changes before the rest of an epoch, ``loader_server.planning.elastic``, usually none); the
rest of an epoch is planned from its last leg's plan when that is cached, so a job resized
on a daemon that served it costs one plan. The planner is pure numpy,
so background threads compute them while the server thread keeps serving (numpy releases
the GIL in its heavy loops). There are several (``workers``), so one job's slow plan (a
large corpus, an exotic spec) does not hold back another job's next epoch. Errors in a
background thread surface on the serving thread when the plan is asked for, never as a
silent hang.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from loader_server.faults import fault_point
from loader_server.planning.elastic import plan_rest, shaped
from loader_server.planning.planner import EpochPlan
from loader_server.wire.protocol import Leg
from loader_server.wire.spec import BatchSpec

log = logging.getLogger(__name__)
# Plans kept (the least recently used go first): each job holds its current epoch's and the
# next one's, so this serves 8 jobs at once without replanning; a plan holds every sample
# id of its epoch, so many more would cost memory on a large corpus.
MAX_PLANS = 16
# Planner threads: one job's slow plan must not hold back another job's next epoch.
PLANNER_THREADS = 4


class PlanCache:
    """``try_get`` never blocks the server loop: it returns None until the plan is ready."""

    def __init__(
        self,
        lengths: np.ndarray,
        fingerprint: str,
        *,
        max_plans: int = MAX_PLANS,
        workers: int = PLANNER_THREADS,
    ) -> None:
        self._lengths = lengths
        self._fingerprint = fingerprint
        self._max_plans = max_plans
        Key = tuple[str, int, tuple[Leg, ...]]
        self._futures: OrderedDict[Key, Future[EpochPlan]] = OrderedDict()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="planner")

    def future(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...] = ()) -> Future[EpochPlan]:
        """The plan's future (planning starts now if it has not)."""
        return self._future(spec, epoch, legs)

    def _future(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...]) -> Future[EpochPlan]:
        key = (spec.key(), epoch, legs)
        fut = self._futures.get(key)
        if fut is None:
            fut = self._pool.submit(self._plan, spec, epoch, legs)
            self._futures[key] = fut
            while len(self._futures) > self._max_plans:
                self._futures.popitem(last=False)
        else:
            self._futures.move_to_end(key)
        return fut

    def _plan(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...]) -> EpochPlan:
        fault_point("plan", epoch)
        t = time.perf_counter()
        plan = plan_rest(
            self._lengths, spec, epoch=epoch, legs=legs, prior=self._prior(spec, epoch, legs)
        )
        log.info(
            "planned epoch %d%s of spec %s on %s: %d steps in %.2f s%s",
            epoch,
            f" after {len(legs)} shape change(s)" if legs else "",
            spec.key(),
            self._fingerprint[:12],
            plan.num_steps,
            time.perf_counter() - t,
            overlong_note(plan.stats, spec.max_seq_len),
        )
        return plan

    def _prior(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...]) -> EpochPlan | None:
        """The cached plan of the last leg, if it is ready (never waited for: a planner
        thread waiting on another could deadlock the pool; it is recomputed instead)."""
        if not legs:
            return None
        last = legs[-1]
        key = (shaped(spec, last.world_size, last.grad_accum).key(), epoch, legs[:-1])
        fut = self._futures.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def has(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...] = ()) -> bool:
        """Whether this plan was asked for already (ready or being computed)."""
        return (spec.key(), epoch, legs) in self._futures

    def try_get(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...] = ()) -> EpochPlan | None:
        """The plan if ready (re-raising a planning error), else None; starts it if needed."""
        fut = self._future(spec, epoch, legs)
        return fut.result() if fut.done() else None

    def get(self, spec: BatchSpec, epoch: int, legs: tuple[Leg, ...] = ()) -> EpochPlan:
        """The plan, waiting for it."""
        return self._future(spec, epoch, legs).result()

    def prefetch(self, spec: BatchSpec, epoch: int) -> None:
        self._future(spec, epoch, ())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def overlong_note(stats: dict, max_seq_len: int) -> str:
    """What the plan did to samples over ``max_seq_len`` (``overlong``), for its log line:
    empty when it met none."""
    done = [(int(stats.get(k, 0)), what) for k, what in
            (("truncated", "truncated"), ("dropped_overlong", "dropped"))]  # fmt: skip
    said = ", ".join(f"{n:,} {what}" for n, what in done if n)
    return f"; samples over max_seq_len {max_seq_len:,}: {said}" if said else ""
