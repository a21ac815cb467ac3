"""The writer's side of ``--states-transport mooncake``: a document's states put into a
Mooncake store, in the memory (segment) of the trainer rank that asked for them. Imports
torch and mooncake only: the connector (in vLLM's interpreter) and the tests' stand-in
server use it alike; ``trainer.engine.mooncake`` is the reader's side.

The value is the arena's region layout (``dflash_states_shm``: a header keyed by the
trainer's request id, the token ids, the states), laid out in a staging buffer of the
writer thread's (registered with the store once, grown when a document needs more), then
sent with ``put_from`` under the request id as key, ``preferred_segment`` the rank's own
segment: the trainer then reads it with a local copy (``get_into``), and if the rank dies
its segment, and what was put there for it, goes with it. A store client whose master went
away is made again at the next put (a restarted master knows no client).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: The bytes each side keeps for the store's own transfers (puts and gets of unregistered
#: memory: we use none, registered buffers only).
LOCAL_BUFFER = 16 << 20


def connect(*, master: str, metadata: str, protocol: str, local_host: str, device: str = "",
            segment: int = 0) -> Any:  # fmt: skip
    """A store client (``segment`` bytes of this process's memory mounted as the store's:
    0 for a writer). ``RuntimeError`` naming the master when it cannot be set up: at once
    when nothing listens at the master's or the metadata server's address (the store's
    own set-up takes a minute and a half to give up on one)."""
    import os
    import socket
    from urllib.parse import urlsplit

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines: thousands a run
    from mooncake.store import MooncakeDistributedStore

    meta = urlsplit(metadata)
    for what, host, port in (("master", *master.rsplit(":", 1)),
                             ("metadata server", meta.hostname, meta.port or 80)):  # fmt: skip
        try:
            socket.create_connection((str(host), int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise RuntimeError(
                f"the Mooncake {what} at {host}:{port} does not answer ({e}): is "
                f"mooncake_master running there? (master {master}, metadata {metadata})"
            ) from None

    store = MooncakeDistributedStore()
    code = store.setup(local_host, metadata, segment, LOCAL_BUFFER, protocol, device, master)
    if code != 0:
        raise RuntimeError(
            f"the Mooncake store could not be set up (code {code}): master {master}, "
            f"metadata {metadata}, protocol {protocol}, this host {local_host}"
        )
    return store


class Writer:
    """Puts documents' states into the store for the trainer ranks that asked for them.
    Staging buffers are a pool: each put takes a free one large enough (or registers a new
    one) and gives it back; a registered buffer is never freed (the store refuses a new
    registration that overlaps an old one's memory)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self._store: Any = None
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._stale: list[torch.Tensor] = []  # kept: their memory may still be registered

    def _client(self) -> Any:
        with self._lock:
            if self._store is None:
                self._store = connect(**self.settings)
                self._free = []  # a new client: buffers registered anew
            return self._store

    def _take(self, store: Any, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [k for k, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # by index: list.remove compares tensors with ==, element by element
                return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        code = store.register_buffer(buf.data_ptr(), buf.numel())
        if code != 0:
            raise RuntimeError(f"the Mooncake store refused a buffer of {buf.numel()} bytes")
        return buf

    def _give(self, store: Any, buf: torch.Tensor) -> None:
        with self._lock:
            if store is self._store:
                self._free.append(buf)
            else:  # registered with a client that is gone
                self._stale.append(buf)

    def put(self, key: str, segment: str, tensors: dict[str, torch.Tensor]) -> None:
        """A document's ``tensors`` (``hidden_states [T, n, H]``, their ``token_ids`` and,
        fp8, their scales) under ``key``, in ``segment``. One that cannot be put has, in
        its place, a value that says why (the trainer stops naming it, not waiting out its
        deadline for a key that will never come), where the store still takes one."""
        try:
            self._put(key, segment, tensors)
        except Exception as e:
            self._put_failure(key, segment, f"{type(e).__name__}: {e}")
            raise

    def _put(self, key: str, segment: str, tensors: dict[str, torch.Tensor]) -> None:
        from dflash_states_shm import region_bytes, write_region  # beside it (vLLM's path)
        from dflash_states_wire import SCALES

        states = tensors["hidden_states"]
        t, n, h = states.shape
        size = region_bytes(t, n, h, states.element_size(), SCALES in tensors)
        for again in (False, True):
            store = self._client()
            buf = self._take(store, size)
            try:
                write_region(buf.numpy().data, 0, size, key, tensors)
                code = store.put_from(key, buf.data_ptr(), size, _config(segment))
            finally:
                self._give(store, buf)
            if code == 0:
                return
            if again:
                raise RuntimeError(f"Mooncake put of {key} ({size} bytes) failed: code {code}")
            with self._lock:  # the master may have been restarted: a new client, once
                if self._store is store:
                    self._store = None

    def _put_failure(self, key: str, segment: str, reason: str) -> None:
        """Best effort: the value saying why ``key`` could not be put."""
        import contextlib

        from dflash_states_shm import REASON_BYTES, write_failure

        with contextlib.suppress(Exception):
            store = self._client()
            buf = self._take(store, 4096 + REASON_BYTES)
            try:
                size = write_failure(buf.numpy().data, 0, buf.numel(), key, reason)
                store.put_from(key, buf.data_ptr(), size, _config(segment))
            finally:
                self._give(store, buf)


def _config(segment: str) -> Any:
    """One replica, in ``segment`` (the requesting rank's own memory)."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = segment
    return config
