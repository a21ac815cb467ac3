"""A dependency-free sd_notify: readiness, status and watchdog pings for systemd.

The protocol (systemd's ``sd_notify(3)``) is one datagram per call, sent to the
``AF_UNIX``/``SOCK_DGRAM`` socket named by ``$NOTIFY_SOCKET``. The payload is
newline-separated ``KEY=VALUE`` assignments:

- ``READY=1``: start-up finished; a ``Type=notify`` unit is "active" only from here on,
  so units ordered ``After=`` it wait for this, not for the process to exist.
- ``STATUS=text``: one free-form line shown by ``systemctl status``.
- ``WATCHDOG=1``: liveness ping. With ``WatchdogSec=`` set, systemd passes the deadline in
  ``$WATCHDOG_USEC`` and aborts the service (SIGABRT, then the ``Restart=`` policy) if no
  ping arrives in time; we ping at half of it, the margin ``sd_watchdog_enabled(3)``
  recommends. ``$WATCHDOG_PID``, when set, names the one process meant to ping.
- ``STOPPING=1``: shutdown has begun (so a slow drain is not mistaken for a hang).
- ``EXTEND_TIMEOUT_USEC=n``: "still starting/stopping, give me n more microseconds".

An address starting with ``@`` is in Linux's abstract namespace: the ``@`` becomes a NUL
byte and no file exists. Without ``$NOTIFY_SOCKET`` (not run by systemd, or a unit that is
not ``Type=notify``) every call is a no-op, so the daemon calls these unconditionally.

Sending never raises: a vanished or refusing socket (systemd restarted, a test harness
that went away) is logged once at warning and later failures are silent, because readiness
reporting must never take the data service down. Each call opens, uses and closes its own
socket; at one ping every ~15 s that costs nothing and leaves no descriptor to manage or
inherit. Sends time out after ``timeout_s`` so a wedged receiver cannot block the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# A datagram to a local socket goes at once or the receiver is wedged: do not wait longer.
SEND_TIMEOUT_S = 1.0
# Pings per watchdog period: every half of it, the margin sd_watchdog_enabled(3) recommends.
PINGS_PER_WATCHDOG = 2
_USEC_PER_S = 1_000_000


class Notifier:
    """Sends sd_notify datagrams to one address; a no-op when the address is ``None``.

    Build it with :meth:`from_env` in the daemon; the constructor exists for tests and
    for callers that already know the address.
    """

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
        timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        self._address = _parse_address(address)
        self._label = address or ""
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._watchdog_pid = watchdog_pid
        self._timeout_s = timeout_s
        self._warned = False

    @classmethod
    def from_env(
        cls,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> Notifier:
        """Read ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.

        ``unset_environment=True`` removes them afterwards (from ``environ``, default
        ``os.environ``) so child processes do not inherit them and ping on our behalf.
        """
        env = os.environ if environ is None else environ
        notifier = cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=_parse_int(env, "WATCHDOG_USEC"),
            watchdog_pid=_parse_int(env, "WATCHDOG_PID"),
        )
        if unset_environment:
            for name in _ENV_VARS:
                env.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """True when there is a socket to send to."""
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``, with an optional ``STATUS=`` line in the same datagram."""
        return self.send("READY=1", *_status_line(status))

    def status(self, text: str) -> bool:
        """``STATUS=text``: the line ``systemctl status`` shows. Newlines become spaces."""
        return self.send(*_status_line(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: call every :meth:`watchdog_interval_s` seconds."""
        return self.send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``, with an optional ``STATUS=`` line in the same datagram."""
        return self.send("STOPPING=1", *_status_line(status))

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for ``seconds`` more before the start/stop timeout."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * _USEC_PER_S))}")

    def watchdog_interval_s(self) -> float | None:
        """Seconds between watchdog pings (half of ``$WATCHDOG_USEC``), or ``None``.

        ``None`` means "do not ping": no socket, no (or a zero) ``$WATCHDOG_USEC``, or
        ``$WATCHDOG_PID`` names another process. The PID is compared on every call, so a
        forked child of the daemon correctly gets ``None``.
        """
        if self._address is None or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / PINGS_PER_WATCHDOG / _USEC_PER_S

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments as one datagram; True if it was sent.

        Raises ``ValueError`` only for malformed assignments (a programming error); socket
        failures are logged once and reported as False.
        """
        for item in assignments:
            if "=" not in item or "\n" in item:
                raise ValueError(f"sd_notify assignment must be one KEY=VALUE line: {item!r}")
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode("utf-8", errors="replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(self._timeout_s)
                sock.sendto(payload, self._address)
        except OSError as exc:
            self._warn_once(exc)
            return False
        return True

    def _warn_once(self, exc: OSError) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "sd_notify to NOTIFY_SOCKET=%s failed (%s); further failures are not logged",
            self._label,
            exc,
        )

    def __repr__(self) -> str:
        return f"Notifier(address={self._label!r}, watchdog_usec={self._watchdog_usec})"


def _parse_address(address: str | None) -> str | bytes | None:
    """``/path`` stays a path; ``@name`` becomes the abstract address ``\\0name``."""
    if not address:
        return None
    if address.startswith("@") and len(address) > 1:
        return b"\0" + address[1:].encode()
    if address.startswith("/"):
        return address
    # e.g. systemd >= 254's "vsock:" addresses, which an AF_UNIX socket cannot reach.
    log.warning("NOTIFY_SOCKET=%r is not a unix socket address; sd_notify disabled", address)
    return None


def _parse_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return None


def _status_line(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    return ("STATUS=" + " ".join(text.splitlines()),)
