"""The ZeroMQ side of the daemon: one ROUTER socket, many sessions, one thread.

The loop alternates between draining control messages (never blocking while there is
work) and filling one free slot of one session (round robin), so a slow or misbehaving
client cannot starve the others. The parts, one job each: the socket (``sockets``), the
requests (``dispatch``), who holds which session and job (``registry``), filling the rings
from the corpus (``producer``) and the ``stats`` (``stats``). This class puts them together
and runs the loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from loader_server.data.dataset import ArrowDataset
from loader_server.service.config import DaemonConfig
from loader_server.service.dispatch import Dispatcher
from loader_server.service.producer import Producer
from loader_server.service.registry import Job, Registry
from loader_server.service.rings import shm_caps
from loader_server.service.session import Session
from loader_server.service.sockets import ControlSocket
from loader_server.service.stats import daemon_stats

log = logging.getLogger(__name__)
# A session whose client released a slot or sent a message this recently is being consumed:
# the daemon then sleeps at most BUSY_SLEEP_MS between looks at the ring counters.
BUSY_S = 0.2
# Sleep between looks while a trainer consumes (the counters are read on waking), or while
# an open is being prepared (its plan or ring may be ready any moment): a refill is never
# more than this late.
BUSY_SLEEP_MS = 1
# Sleep while nobody consumes: a ``release`` doorbell or any message ends it at once, so
# this only bounds how stale the periodic work (ticks) can get; it keeps an idle daemon idle.
IDLE_SLEEP_MS = 20
# Period of the housekeeping tick (session expiry, the caller's ``tick``: watchdog, status).
TICK_S = 0.1
# The instance token's random bytes: 8 hex characters, as ring names carry them (wire.ring).
INSTANCE_BYTES = 4


class LoaderServer:
    """Serves one dataset on one endpoint. Call ``serve_forever(should_stop)``."""

    def __init__(self, dataset: ArrowDataset, config: DaemonConfig) -> None:
        self.config = config
        self.instance = secrets.token_hex(INSTANCE_BYTES)
        self.started = time.monotonic()
        self.max_ring_bytes, self.shm_budget_bytes = shm_caps(
            config.shm_dir, config.max_ring_bytes, config.shm_budget_bytes
        )
        self.socket = ControlSocket(config)
        self.registry = Registry(
            config,
            self.socket.send,
            instance=self.instance,
            max_ring_bytes=self.max_ring_bytes,
            shm_budget_bytes=self.shm_budget_bytes,
        )
        self.producer = Producer(dataset, self.registry)
        self.dispatcher = Dispatcher(
            config,
            instance=self.instance,
            socket=self.socket,
            registry=self.registry,
            producer=self.producer,
            stats=self.stats,
        )

    # --- what the daemon reads -------------------------------------------------------------

    @property
    def dataset(self) -> ArrowDataset:
        return self.producer.dataset

    @property
    def corpus_error(self) -> str | None:
        """Set once the corpus changed under the daemon: nothing is served until a reload."""
        return self.producer.corpus_error

    @property
    def sessions(self) -> dict[str, Session]:
        return self.registry.sessions

    @property
    def jobs(self) -> dict[str, Job]:
        return self.registry.jobs

    @property
    def errors(self) -> int:
        """Requests refused since the start."""
        return self.dispatcher.errors

    def stats(self) -> dict[str, Any]:
        return daemon_stats(
            instance=self.instance,
            started=self.started,
            dataset=self.producer.dataset,
            corpus_error=self.producer.corpus_error,
            errors=self.dispatcher.errors,
            sessions=list(self.registry.sessions.values()),  # the exporter's thread calls too
        )

    # --- lifecycle -----------------------------------------------------------------------

    def bind(self) -> None:
        self.socket.bind()

    def serve_forever(
        self, should_stop: Callable[[], bool], tick: Callable[[], None] | None = None
    ) -> None:
        """Run until ``should_stop()``; ``tick`` runs about every ``TICK_S`` (watchdog,
        status)."""
        next_tick = next_check = 0.0
        while not should_stop():
            if self.registry.opening:
                self.dispatcher.advance_openings()
            if self.producer.fill_one():
                if self.socket.poll(0):
                    self.dispatcher.drain()
            else:
                # Nothing to fill: ask the clients for a doorbell, look once more (a release
                # may have landed before the request was visible), then sleep.
                self.producer.arm()
                if not self.producer.fill_one() and self.socket.poll(self._sleep_ms()):
                    self.dispatcher.drain()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self.registry.expire(now)
                if now >= next_check:
                    next_check = now + self.config.corpus_check_s
                    self.producer.check_corpus()
                if tick is not None:
                    tick()

    def _sleep_ms(self) -> int:
        if self.registry.opening:
            return BUSY_SLEEP_MS
        now = time.monotonic()
        sessions = self.registry.sessions.values()
        busy = any(now - s.last_seen < BUSY_S for s in sessions if not s.ended)
        return BUSY_SLEEP_MS if busy else IDLE_SLEEP_MS

    def check_corpus(self) -> bool:
        """True while the corpus is as opened; on a change, stop serving it (once)."""
        return self.producer.check_corpus()

    def replace_dataset(self, dataset: ArrowDataset) -> None:
        """Serve ``dataset`` (reopened on SIGHUP) from now on. The same corpus, unchanged,
        changes nothing; another one ends every session (``bye``: clients reconnect and
        find out whether their position still applies, by its fingerprint)."""
        old = self.producer.dataset
        if self.producer.serves(dataset):
            dataset.close()
            log.info("reload: %s unchanged (fingerprint %s)", old.path, old.fingerprint)
            return
        why = "the corpus was reloaded"
        self.registry.end_sessions(why, "bye", instance=self.instance, why=why)
        self.registry.drop_openings(why)  # planned on the old corpus; the clients retry
        self.producer.replace(dataset)
        log.info(
            "reload: serving %s, %d samples, fingerprint %s (was %s)",
            dataset.path,
            dataset.num_samples,
            dataset.fingerprint,
            old.fingerprint,
        )

    def shutdown(self) -> None:
        """Tell every client, unlink every ring, close the socket."""
        why = "daemon shutting down"
        self.registry.end_sessions(why, "bye", instance=self.instance)
        self.registry.drop_openings(why)
        self.registry.close()
        self.producer.close()
        self.socket.close()
