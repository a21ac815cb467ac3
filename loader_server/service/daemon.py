"""Daemon lifecycle: starting -> serving -> draining -> stopped.

Starting: check the endpoint is ours to take and the shared-memory folder takes a ring
(``loader_server.service.endpoint``: no path the daemon did not create is ever removed), sweep
shared-memory segments of dead instances, open the dataset, bind, log one ``READY`` line
and tell systemd. A signal while starting (the corpus scan can take minutes) stops the
start at once: SIGINT as Ctrl-C (``Error: interrupted``, 130), SIGTERM as a stop (exit 0,
never ``READY``). Serving: the server loop; signal handlers only set a flag. Draining: say
``STOPPING=1``, tell clients ``bye``, unlink every ring (in ``finally``, so an error path
cleans up too). Exit status 0 after SIGTERM/SIGINT.

SIGHUP reloads the corpus: the dataset path is opened again on a background thread (the
server keeps serving meanwhile); an unchanged corpus changes nothing, another one (a new
file renamed over the old, or a corpus restored after the daemon stopped serving it)
replaces it and ends every session with ``bye`` (clients reconnect; a client whose position
belongs to the old corpus is refused by its fingerprint). A corpus that fails to open is
logged and the daemon keeps what it had. Systemd's ``ExecReload=kill -HUP $MAINPID`` fits.
"""

from __future__ import annotations

import enum
import grp
import logging
import os
import resource
import signal
import threading
import time
from concurrent.futures import Future
from types import FrameType
from typing import Any

from loader_server.data.dataset import ArrowDataset, DatasetError, open_dataset
from loader_server.planning.servable import why_unservable
from loader_server.service.config import DaemonConfig
from loader_server.service.endpoint import EndpointBusyError, check_endpoint, check_shm_dir
from loader_server.service.prometheus import start_exporter
from loader_server.service.rings import sweep_dead_segments
from loader_server.service.sdnotify import Notifier
from loader_server.service.server import LoaderServer

log = logging.getLogger(__name__)
# How often systemd's status line (``systemctl status``) is refreshed: fresh enough for a
# person looking, rare enough to cost nothing.
STATUS_EVERY_S = 5.0
# The open-file limit asked for when the hard limit is unlimited: one descriptor per shard
# stays open, and corpora of tens of thousands of shards exist.
FD_LIMIT_IF_UNLIMITED = 1 << 16
__all__ = ["Daemon", "EndpointBusyError", "State"]


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class _StoppedStarting(BaseException):
    """SIGTERM while starting: stop without serving (a BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way turns it into an error)."""


class Daemon:
    """Owns the server, the notifier and the signal flag."""

    def __init__(self, config: DaemonConfig) -> None:
        if config.dataset is None:
            raise ValueError("no dataset: pass --dataset or set dataset in the config file")
        self.config = config
        self.state = State.STARTING
        self.notifier = Notifier.from_env(unset_environment=True)
        self._stop = False
        self._reload_asked = False
        self._reloading: Future[ArrowDataset] | None = None
        self._next_watchdog = 0.0
        self._next_status = 0.0
        self.server: LoaderServer | None = None
        self._exporter: Any = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True
        if self.state is State.STARTING:  # nothing to drain: end the start where it is
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise _StoppedStarting

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self._reload_asked = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        try:
            self._start()
            assert self.server is not None
            self.server.serve_forever(lambda: self._stop, self._tick)
        except _StoppedStarting:
            log.info("SIGTERM while starting: stopped before READY")
            self.notifier.status("stopped while starting")
        except BaseException as e:
            if self.state is State.STARTING:
                # What `systemctl status` keeps showing after the unit failed: the reason,
                # not a "draining" that never happened.
                why = " ".join(str(e).split()) or type(e).__name__
                self.notifier.status(f"failed to start: {why}")
            raise
        finally:
            if self.state is not State.STARTING:
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
        if c.group is not None:
            try:
                grp.getgrnam(c.group)
            except KeyError:
                raise ValueError(f"group {c.group!r} does not exist on this machine") from None
        free = check_shm_dir(c.shm_dir)
        log.info("shm dir %s: %.1f MiB free", c.shm_dir, free / 2**20)
        sweep_dead_segments(c.shm_dir)
        self.notifier.status(f"opening {c.dataset}")
        t = time.perf_counter()
        assert c.dataset is not None
        _raise_fd_limit()  # one descriptor per shard stays open (the corpus watcher's)
        ds = self._open_dataset()
        log.info(
            "opened %s: %d samples, %d tokens, fingerprint %s in %.2f s",
            c.dataset,
            ds.num_samples,
            ds.num_tokens,
            ds.fingerprint,
            time.perf_counter() - t,
        )
        _check_servable(ds, c)
        self.server = LoaderServer(ds, c)
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

    def _open_dataset(self) -> ArrowDataset:
        c = self.config
        assert c.dataset is not None
        return open_dataset(
            c.dataset,
            vocab_size=c.vocab_size,
            check_values=c.check_values,
            scan_bytes=c.value_scan_bytes,
        )

    def _reload(self) -> None:
        """SIGHUP: open the corpus again off the serving thread; swap it in when ready."""
        if self._reload_asked and self._reloading is None:
            self._reload_asked = False
            log.info("SIGHUP: reopening %s", self.config.dataset)
            fut: Future[ArrowDataset] = Future()

            def work() -> None:
                try:
                    fut.set_result(self._open_dataset())
                except BaseException as e:
                    fut.set_exception(e)

            threading.Thread(target=work, name="reload", daemon=True).start()
            self._reloading = fut
        if self._reloading is not None and self._reloading.done():
            fut, self._reloading = self._reloading, None
            try:
                ds = fut.result()
                _check_servable(ds, self.config)
            except Exception as e:  # whatever it is, the corpus being served stays served
                why = (
                    str(e) if isinstance(e, DatasetError | OSError) else f"{type(e).__name__}: {e}"
                )
                log.error("reload failed: %s; the daemon keeps what it served before", why)
                return
            assert self.server is not None
            self.server.replace_dataset(ds)

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
        self._reload()
        now = time.monotonic()
        interval = self.notifier.watchdog_interval_s()
        if interval is not None and now >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = now + interval
        if self.notifier.enabled and now >= self._next_status:
            self.notifier.status(self._status_line())
            self._next_status = now + STATUS_EVERY_S


def _check_servable(ds: ArrowDataset, config: DaemonConfig) -> None:
    """A corpus no session could train on is refused (before READY, or before a reload
    swaps it in), naming why."""
    why = why_unservable(ds.lengths, config.spec)
    if why is not None:
        raise DatasetError(f"{config.dataset}: cannot be served under the daemon's [spec]: {why}")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, FD_LIMIT_IF_UNLIMITED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            log.debug("could not raise the open-file limit from %d", soft)
