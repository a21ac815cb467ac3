"""The daemon's one ZeroMQ ROUTER socket: binding (ipc or tcp, CURVE), sending, receiving.

ROUTER_MANDATORY turns a send to a vanished client into an error (ZeroMQ would otherwise
drop it silently), so ``send`` tells whether the client is still there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.auth

from loader_server.service.config import DaemonConfig
from loader_server.service.endpoint import IpcAddress, listen_ipc, remove_socket, socket_identity
from loader_server.wire import protocol as P

log = logging.getLogger(__name__)
# Queued messages per peer each way; control messages are tiny and a client has a handful
# in flight, so only a client that stopped reading ever reaches this (its sends then fail).
HIGH_WATER_MARK = 10_000
# At shutdown, how long the last messages (``bye``) may take to leave.
CLOSE_LINGER_MS = 200
# Hex characters of a peer's routing id in log lines: enough to tell clients apart.
PEER_LOG_CHARS = 12


def peer_name(peer: bytes) -> str:
    """A client's routing id as log lines show it."""
    return peer.hex()[:PEER_LOG_CHARS]


class ControlSocket:
    """Owns the ZeroMQ context and ROUTER socket (and the ipc socket file it binds)."""

    def __init__(self, config: DaemonConfig) -> None:
        self._config = config
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._ipc: tuple[IpcAddress, tuple[int, int] | None] | None = None

    def bind(self) -> None:
        key_file = self._config.curve_secret_key_file
        if key_file is not None:
            # CURVE: clients must know our public key; traffic is encrypted and only
            # clients holding it can complete the handshake.
            public, secret = zmq.auth.load_certificate(key_file)
            if secret is None:
                raise ValueError(f"{key_file} holds no secret key")
            self._sock.curve_server = True
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        if self._config.endpoint.startswith("ipc://"):
            self._bind_ipc()
        else:
            self._sock.bind(self._config.endpoint)

    def _bind_ipc(self) -> None:
        """Bind the socket file ourselves (``bind(2)`` never replaces a path, unlike
        ZeroMQ's ipc bind) and hand the descriptor to ZeroMQ. The file gets the rings'
        access rule: who may read rings may connect (connecting needs write permission)."""
        c = self._config
        addr = IpcAddress.parse(c.endpoint)
        mode = c.shm_mode | (c.shm_mode & 0o444) >> 1
        fd = listen_ipc(addr, mode, c.group)
        self._ipc = (addr, socket_identity(addr))
        try:
            self._sock.setsockopt(zmq.USE_FD, fd)
            self._sock.bind(c.endpoint)
        except zmq.ZMQError as e:
            os.close(fd)
            remove_socket(*self._ipc)
            raise ValueError(f"cannot bind {c.endpoint}: {e}") from None

    def poll(self, timeout_ms: int) -> bool:
        """True when a message is waiting (after at most ``timeout_ms``)."""
        return bool(self._poller.poll(timeout_ms))

    def received(self, limit: int) -> Iterator[list[bytes]]:
        """Up to ``limit`` waiting messages' frames (routing id first), without blocking."""
        for _ in range(limit):
            try:
                yield self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return

    def send(self, peer: bytes, kind: str, **fields: Any) -> bool:
        """Send one message; False when the client cannot be reached."""
        try:
            self._sock.send_multipart([peer, P.encode(kind, **fields)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            log.info("cannot reach client %s (%s)", peer_name(peer), e.strerror)
            return False

    def close(self) -> None:
        """Close the socket and context; unlink the ipc socket file if it is still ours."""
        self._sock.close(linger=CLOSE_LINGER_MS)
        self._ctx.term()
        if self._ipc is not None:
            remove_socket(*self._ipc)
