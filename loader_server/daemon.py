"""Daemon lifecycle: starting -> serving -> draining -> stopped.

Starting: check the endpoint is ours to take and the shared-memory folder takes a ring
(``loader_server.endpoint``: no path the daemon did not create is ever removed), sweep
shared-memory segments of dead instances, open the dataset, bind, log one ``READY`` line
and tell systemd. Serving: the server loop; signal handlers only set a flag. Draining: say
``STOPPING=1``, tell clients ``bye``, unlink every ring (in ``finally``, so an error path
cleans up too). Exit status 0 after SIGTERM/SIGINT.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from types import FrameType
from typing import Any

from loader_server.config import DaemonConfig
from loader_server.dataset import open_dataset
from loader_server.endpoint import EndpointBusyError, check_endpoint, check_shm_dir
from loader_server.prometheus import start_exporter
from loader_server.sdnotify import Notifier
from loader_server.server import LoaderServer, ServerConfig
from loader_server.shm import sweep_dead_segments

log = logging.getLogger(__name__)
__all__ = ["Daemon", "EndpointBusyError", "State"]


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class Daemon:
    """Owns the server, the notifier and the signal flag."""

    def __init__(self, config: DaemonConfig) -> None:
        if config.dataset is None:
            raise ValueError("no dataset: pass --dataset or set dataset in the config file")
        self.config = config
        self.state = State.STARTING
        self.notifier = Notifier.from_env(unset_environment=True)
        self._stop = False
        self._next_watchdog = 0.0
        self._next_status = 0.0
        self.server: LoaderServer | None = None
        self._exporter: Any = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start()
            assert self.server is not None
            self.server.serve_forever(lambda: self._stop, self._tick)
        finally:
            self.state = State.DRAINING
            self.notifier.stopping("draining: telling clients, unlinking shared memory")
            if self._exporter is not None:
                self._exporter.shutdown()
            if self.server is not None:
                self.server.shutdown()
            self.state = State.STOPPED
            log.info("stopped")
        return 0

    def _start(self) -> None:
        c = self.config
        check_endpoint(
            c.endpoint, curve=c.curve_secret_key_file is not None, insecure_tcp=c.insecure_tcp
        )
        free = check_shm_dir(c.shm_dir)
        log.info("shm dir %s: %.1f MiB free", c.shm_dir, free / 2**20)
        sweep_dead_segments(c.shm_dir)
        self.notifier.status(f"opening {c.dataset}")
        t = time.perf_counter()
        assert c.dataset is not None
        ds = open_dataset(c.dataset, vocab_size=c.vocab_size, check_values=c.check_values)
        log.info(
            "opened %s: %d samples, %d tokens, fingerprint %s in %.2f s",
            c.dataset,
            ds.num_samples,
            ds.num_tokens,
            ds.fingerprint,
            time.perf_counter() - t,
        )
        self.server = LoaderServer(
            ds,
            ServerConfig(
                endpoint=c.endpoint,
                slots=c.slots,
                shm_dir=c.shm_dir,
                shm_mode=c.shm_mode,
                group=c.group,
                pad_id=c.pad_id,
                session_timeout_s=c.session_timeout_s,
                max_ring_bytes=c.max_ring_bytes,
                shm_budget_bytes=c.shm_budget_bytes,
                spec_defaults=c.spec,
                curve_secret_key_file=c.curve_secret_key_file,
            ),
        )
        self.server.bind()
        log.info(
            "shared memory caps: %s bytes per session, %s bytes in all (%s)",
            f"{self.server.max_ring_bytes:,}",
            f"{self.server.shm_budget_bytes:,}",
            c.shm_dir,
        )
        if c.metrics_port:
            self._exporter = start_exporter(self.server.stats, c.metrics_host, c.metrics_port)
            log.info("metrics on http://%s:%d/metrics", c.metrics_host, c.metrics_port)
        self.state = State.SERVING
        log.info(
            "READY endpoint=%s pid=%d instance=%s samples=%d",
            c.endpoint,
            os.getpid(),
            self.server.instance,
            ds.num_samples,
        )
        self.notifier.ready(self._status_line())

    def _status_line(self) -> str:
        s = self.server
        if s is None:
            return self.state.value
        sessions = list(s.sessions.values())
        tokens = sum(x.stats.tokens for x in sessions)
        return (
            f"{self.state.value}: {len(sessions)} session(s), {len(s.jobs)} job(s), "
            f"{tokens:,} tokens served, {s.errors} errors"
        )

    def _tick(self) -> None:
        now = time.monotonic()
        interval = self.notifier.watchdog_interval_s()
        if interval is not None and now >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = now + interval
        if self.notifier.enabled and now >= self._next_status:
            self.notifier.status(self._status_line())
            self._next_status = now + 5.0
