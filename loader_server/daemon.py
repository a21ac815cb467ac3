"""Daemon lifecycle: starting -> serving -> draining -> stopped.

Starting: check the endpoint is ours to take (binding an ipc path silently unlinks another
daemon's socket, so we ask first whether anyone answers there), sweep shared-memory
segments of dead instances, open the dataset, bind, log one ``READY`` line and tell
systemd. Serving: the server loop; signal handlers only set a flag. Draining: say
``STOPPING=1``, tell clients ``bye``, unlink every ring (in ``finally``, so an error path
cleans up too). Exit status 0 after SIGTERM/SIGINT.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from client import protocol as P
from loader_server.config import DaemonConfig
from loader_server.dataset import open_dataset
from loader_server.prometheus import start_exporter
from loader_server.sdnotify import Notifier
from loader_server.server import LoaderServer, ServerConfig
from loader_server.shm import sweep_dead_segments

log = logging.getLogger(__name__)
_IPC_PATH_MAX = 107


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class EndpointBusyError(RuntimeError):
    """Another live daemon answers on the endpoint."""


def check_endpoint(config: DaemonConfig) -> None:
    """Refuse endpoints we must not take: a live daemon's, too long, or insecure tcp."""
    ep = config.endpoint
    if ep.startswith("ipc://"):
        path = Path(ep[len("ipc://") :])
        if len(str(path)) > _IPC_PATH_MAX:
            raise ValueError(f"ipc path {path} is longer than {_IPC_PATH_MAX} characters")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            pid = ping(ep, timeout_s=0.5)
            if pid is not None:
                raise EndpointBusyError(
                    f"another dflash-loader daemon (pid {pid}) is serving on {ep}; stop it "
                    f"first or choose another --endpoint"
                )
            log.info("removing stale socket %s (nobody answers there)", path)
    elif ep.startswith("tcp://"):
        host = ep[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if config.curve_secret_key_file is None:
            if not config.insecure_tcp:
                raise ValueError(
                    f"refusing tcp endpoint {ep} without CURVE keys: anyone who can connect "
                    f"could read the corpus. Set curve_secret_key_file, or --insecure-tcp on "
                    f"loopback for testing"
                )
            if not _is_loopback(host):
                raise ValueError(f"--insecure-tcp is allowed on loopback only, not {host!r}")
    else:
        raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {ep!r}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ping(endpoint: str, timeout_s: float = 1.0) -> int | None:
    """The pid of the daemon answering on ``endpoint``, or None if nobody answers in time."""
    ctx: zmq.Context = zmq.Context.instance()
    sock: zmq.Socket = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encode("ping"))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        msg = P.decode(sock.recv())
        return int(msg.get("pid", -1)) if msg["t"] == "pong" else None
    except (zmq.ZMQError, P.ProtocolError):
        return None
    finally:
        sock.close()


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
        check_endpoint(c)
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
                spec_defaults=c.spec,
                curve_secret_key_file=c.curve_secret_key_file,
            ),
        )
        self.server.bind()
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
