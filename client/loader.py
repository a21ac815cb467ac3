"""``LoaderClient``: the iterator a trainer rank uses to receive batches from the daemon.

Each ``next()`` releases the previous batch's slot, then waits for the daemon to announce
the next one and wraps the slot's bytes as torch tensors over a read-only mapping of the
ring (no copy). A batch's tensors are valid until the next ``next()``: copy them (for
example ``batch.to("cuda", non_blocking=True)``) to keep them longer.

CUDA copy rule: ``batch.to("cuda", non_blocking=True)`` only queues a DMA from the ring,
which the GPU performs later. It records a CUDA event after the copies on the slot's guard,
and the client never hands a slot back to the daemon (the ``consumed`` store in ``next()``)
nor unmaps the ring (``close``, reconnects) before every event recorded on it has completed.
Synchronous copies and CPU targets record nothing, and with no event pending a release makes
no CUDA call at all.

The client holds the position (``[epoch, step, micro]`` of the next batch); the daemon holds
nothing a restart could lose. If the daemon goes away (no message for ``dead_after_s``, a
``bye``, or "unknown session" after a daemon restart) the client reconnects with backoff
and reopens its session at its own position, so nothing is lost or repeated; after
``timeout_s`` without a daemon it raises ``LoaderUnavailableError``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import zmq

from client import _ring, cuda
from client import protocol as P

log = logging.getLogger(__name__)

STATE_VERSION = 1
# After the bell rang for a message rather than a batch: how long to wait for it to arrive.
_MESSAGE_IN_FLIGHT_S = 0.1
_TORCH_DTYPES = {"int32": torch.int32, "uint8": torch.uint8, "int64": torch.int64}


@dataclass(eq=False)
class _SlotGuard:
    """One ring slot's pending asynchronous copies: CUDA events recorded by ``Batch.to``.

    Shared by the client and the batches that view the slot; the client waits on it before
    the slot is released or the ring unmapped.
    """

    pending: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        """Block until every recorded copy has finished, then forget them."""
        for event in self.pending:
            event.synchronize()
        self.pending.clear()


@dataclass(frozen=True)
class Batch:
    """One micro-batch for this rank. Tensors are CPU views of shared memory until ``to``.

    Padded: ``input_ids``/``loss_mask`` ``[B, L]``, ``lengths``/``sample_ids`` ``[B]``.
    Packed: ``input_ids``/``loss_mask``/``position_ids`` ``[1, T]``, ``cu_seqlens`` ``[n+1]``,
    ``lengths``/``sample_ids`` ``[n]``, ``max_seqlen``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    sample_ids: torch.Tensor
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    epoch: int
    step: int
    micro: int
    bucket: int
    layout: str
    steps_per_epoch: int
    num_tokens: int  # real (unpadded) tokens: the sum of ``lengths``
    # The ring slot's guard while the tensors are views of the ring; None for copies.
    _guard: _SlotGuard | None = field(default=None, repr=False, compare=False)

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.epoch, self.step, self.micro)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy of every tensor on ``device`` (DMA from the registered ring on CUDA).

        With ``non_blocking=True`` to a CUDA device from the ring, the copies are only queued:
        a CUDA event recorded on the current stream right after them is attached to the
        slot's guard, and the client waits for it before the slot goes back to the daemon
        (the next ``next()``) or the ring is unmapped, so the DMA never reads a slot the
        daemon is refilling. The GPU tensors themselves follow the usual stream semantics.
        A CPU target returns the ring views themselves (still valid only until ``next()``).
        """
        dev = torch.device(device)
        out = self._map(lambda t: t.to(dev, non_blocking=non_blocking))
        guard = self._guard
        if guard is None:
            return out
        if dev.type == "cpu":
            return replace(out, _guard=guard)  # still views of the ring
        if non_blocking and dev.type == "cuda":
            guard.pending.append(cuda.record_copy_event(dev))
        return out

    def clone(self) -> Batch:
        """A private CPU copy that outlives the slot."""
        return self._map(torch.Tensor.clone)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        present = {k: getattr(self, k) for k in _TENSOR_FIELDS}
        moved: dict[str, Any] = {k: fn(t) for k, t in present.items() if t is not None}
        return replace(self, _guard=None, **moved)


_TENSOR_FIELDS = ("input_ids", "loss_mask", "lengths", "sample_ids", "position_ids", "cu_seqlens")


class _Ring:
    """A session's ring mapped read-only, and its control page mapped read-write."""

    def __init__(self, path: str, control: str, slots: int, layout: P.SlotLayout) -> None:
        header = P.header_bytes(slots)
        self._mm = _map(path, header + slots * layout.slot_bytes, mmap.PROT_READ)
        self._ctl = _map(control, P.CONTROL_BYTES, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        meta = self.buf[P.META : P.META + slots * P.META_STRIDE].view(np.int64)
        self._meta = meta.reshape(slots, P.META_STRIDE // 8)[:, : len(P.META_FIELDS)]
        with warnings.catch_warnings():  # read-only by design: a write faults, never corrupts
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.from_numpy(self.buf)
        # The ring as one tensor per dtype, and where each field of each slot starts in it:
        # a batch tensor is then one ``as_strided`` call (no slicing, no reshape).
        typed = {d: whole.view(t) for d, t in _TORCH_DTYPES.items()}
        self._fields: list[dict[str, tuple[torch.Tensor, int, int]]] = []
        for k in range(slots):
            views = {}
            for name, (dtype, offset, capacity) in layout.fields.items():
                start = header + k * layout.slot_bytes + offset
                views[name] = (typed[dtype], start // np.dtype(dtype).itemsize, capacity)
            self._fields.append(views)
        self.slots = slots
        self.guards = [_SlotGuard() for _ in range(slots)]
        self._registered = cuda.register(self.buf)

    def produced(self) -> int:
        return int(_ring.load(self._mm, P.PRODUCED))

    def bell(self) -> int:
        return int(_ring.bell(self._mm, P.BELL))

    def wait(self, bell: int, timeout_s: float) -> bool:
        """Sleep until the daemon rings the bell past ``bell`` (True) or the timeout."""
        return bool(_ring.wait(self._mm, P.BELL, bell, timeout_s))

    def daemon_wake(self) -> int:
        return int(_ring.load(self._mm, P.WAKE_DAEMON))

    def _store(self, offset: int, value: int) -> None:
        try:
            _ring.store(self._ctl, offset, value)
        except OSError as e:  # EFAULT: someone truncated the file under this mapping
            raise P.ProtocolError(
                f"this session's control page was truncated under the client ({e.strerror})"
            ) from None

    def set_consumed(self, n: int) -> None:
        self._store(P.CONSUMED, n)

    def wake_client_at(self, n: int) -> None:
        self._store(P.WAKE_CLIENT, n)

    def set_wait(self, seconds: float) -> None:
        self._store(P.WAIT_US, int(seconds * 1e6))

    def meta(self, slot: int) -> list[int]:
        """Slot ``slot``'s batch description (``P.META_FIELDS``); read after ``produced``."""
        return self._meta[slot].tolist()

    def tensor(self, slot: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Field ``name`` of ``slot`` as a ``shape`` tensor (1-D or 2-D, C order)."""
        base, offset, capacity = self._fields[slot][name]
        count = shape[0] * shape[1] if len(shape) == 2 else shape[0]
        if count > capacity:
            raise P.ProtocolError(f"field {name}: {count} elements > capacity {capacity}")
        return base.as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), offset)

    def settle(self) -> None:
        """Wait for every asynchronous copy still reading any slot (see ``Batch.to``)."""
        for guard in self.guards:
            if guard.pending:
                guard.wait()

    def close(self) -> None:
        self.settle()  # a DMA must not outlive the mapping or its registration
        if self._registered:
            cuda.unregister(self.buf)
        self.buf = np.zeros(0, np.uint8)
        self._meta = np.zeros((0, 0), np.int64)
        self._fields = []
        # A batch tensor may still reference the mapping; then GC unmaps it later.
        for mm in (self._mm, self._ctl):
            with contextlib.suppress(BufferError):
                mm.close()


def _map(path: str, size: int, prot: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if prot & mmap.PROT_WRITE else os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise P.ProtocolError(f"{path} is {actual} bytes, expected {size}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


class LoaderClient:
    """Iterate micro-batches of one rank of a job from the loader daemon.

    Args:
        endpoint: the daemon's ZeroMQ endpoint.
        job: job name; all ranks of a job must agree on ``world_size`` and ``spec``.
        rank, world_size: this process's place in the job.
        spec: BatchSpec fields overriding the daemon's defaults (``world_size`` is set
            from the argument).
        epochs: total epochs to serve (iteration stops at epoch ``epochs``); None: forever.
        timeout_s: how long to keep trying to reach a daemon before raising
            ``LoaderUnavailableError``.
        dead_after_s: silence (heartbeats unanswered) after which the daemon is presumed gone.
        curve_server_key: the daemon's CURVE public key (Z85 text) for a tcp:// endpoint
            secured with ``curve_secret_key_file``; the client uses an ephemeral key pair.
    """

    def __init__(
        self,
        endpoint: str = P.DEFAULT_ENDPOINT,
        *,
        job: str,
        rank: int,
        world_size: int,
        spec: dict[str, Any] | None = None,
        epochs: int | None = None,
        timeout_s: float = 60.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        curve_server_key: str | bytes | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        spec = dict(spec or {})
        if spec.get("world_size", world_size) != world_size:
            raise ValueError(f"spec world_size {spec['world_size']} != world_size {world_size}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
        self.endpoint = endpoint
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.spec = spec
        self.epochs = epochs
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.curve_server_key = (
            curve_server_key.encode() if isinstance(curve_server_key, str) else curve_server_key
        )
        self.position: tuple[int, int, int] = (0, 0, 0)
        self.wait_s = 0.0  # total time blocked waiting for data
        self.steps_per_epoch: int | None = None
        self.fingerprint: str | None = None
        self.effective_spec: dict[str, Any] | None = None
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._sid: str | None = None
        self._ring: _Ring | None = None
        self._n = 0  # index in the session of the next batch to receive
        self._consumed = 0  # batches released to the daemon (the control page's counter)
        self._held = False  # the batch last returned (index _n - 1) is still in use

    # --- public API -----------------------------------------------------------------------

    def __iter__(self) -> LoaderClient:
        return self

    def __next__(self) -> Batch:
        self._release_held()
        if self.epochs is not None and self.position[0] >= self.epochs:
            self.close()  # done: free the daemon's ring now rather than at session timeout
            raise StopIteration
        deadline = None
        while True:
            try:
                if self._sid is None:
                    self._open()
                batch = self._receive()
                if batch is None:
                    self.close()
                    raise StopIteration
                return batch
            except _Reconnect as why:
                deadline = deadline or time.monotonic() + self.timeout_s
                self._reset(str(why), deadline)

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the next batch this rank should receive."""
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "position": list(self.position),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (reopening the session if one is open)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not {STATE_VERSION}; "
                f"it was saved by an incompatible dflash-loader"
            )
        for key in ("job", "rank", "world_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"loader state is for {key}={state.get(key)!r}, this client has "
                    f"{key}={getattr(self, key)!r}"
                )
        self.position = P.position(state.get("position"), "state position")
        if state.get("fingerprint"):
            self.fingerprint = state["fingerprint"]
        if self._sid is not None:
            self._close_session()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.settle()  # copies from the ring finish before the daemon drops it
        if self._sid is not None and self._sock is not None:
            self._sock.send(P.encode("close", s=self._sid), zmq.NOBLOCK)
        self._close_session()

    def __enter__(self) -> LoaderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._close_session()

    # --- session ---------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(8))
            sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
            if self.curve_server_key is not None:
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey = self.curve_server_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _open(self) -> None:
        sock = self._socket()
        sock.send(
            P.encode(
                "open",
                job=self.job,
                rank=self.rank,
                world_size=self.world_size,
                spec=self.spec,
                pos=list(self.position),
                epochs=self.epochs,
            )
        )
        end = time.monotonic() + self.dead_after_s
        while True:
            msg = self._recv(end - time.monotonic())
            if msg is None:
                raise _Reconnect(f"no answer to open from {self.endpoint}")
            if msg["t"] == "welcome":
                break
            if msg["t"] == "error" and "s" not in msg:
                raise P.LoaderRequestError(str(msg.get("code")), str(msg.get("msg")))
        self._welcome(msg)

    def _welcome(self, msg: dict[str, Any]) -> None:
        fingerprint = msg.get("fingerprint")
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            raise P.LoaderRequestError(
                P.E_MISMATCH,
                f"daemon serves dataset {fingerprint}, but this position belongs to "
                f"{self.fingerprint}; resuming would replay the wrong data",
            )
        if self.effective_spec is not None and msg.get("spec") != self.effective_spec:
            raise P.LoaderRequestError(
                P.E_MISMATCH, "daemon now serves another spec than this client's session had"
            )
        layout = P.SlotLayout.from_wire(msg.get("layout"), msg.get("slot_bytes"))
        self._ring = _Ring(str(msg["shm"]), str(msg["ctl"]), int(msg["slots"]), layout)
        self._sid = str(msg["s"])
        self._n = self._consumed = 0
        self.fingerprint = fingerprint
        self.effective_spec = msg.get("spec")
        self.steps_per_epoch = int(msg["steps"])
        log.debug("session %s open at %s", self._sid, self.position)

    def _receive(self) -> Batch | None:
        """This session's next batch (None: the requested epochs are done).

        A batch already in the ring is taken without a system call. Otherwise the client
        sets its wake threshold and sleeps on the ring's bell, which the daemon rings for
        the batch and after any message it sends this session; heartbeats go out every
        ``heartbeat_s``, and silence for ``dead_after_s`` means the daemon is gone.
        """
        ring, n = self._ring, self._n
        assert ring is not None
        if ring.produced() > n:
            return self._batch(n)
        t0 = time.monotonic()
        last_heard = t0
        next_hb = t0 + self.heartbeat_s
        # Waiting means the daemon is the slow side: ask to be woken when two batches are
        # ready, halving wake-ups at no cost in throughput (the second is taken at once).
        # The daemon also rings after any message, such as "end" after the last batch.
        ring.wake_client_at(n + min(2, ring.slots))
        try:
            while True:
                bell = ring.bell()  # before looking: a ring after this read wakes the wait
                if ring.produced() > n:
                    return self._batch(n)
                msg = self._recv(0)
                if msg is None:
                    now = time.monotonic()
                    timeout = min(next_hb, last_heard + self.dead_after_s) - now
                    if timeout > 0 and ring.wait(bell, timeout):
                        if ring.produced() > n:
                            continue
                        # Rung for a message, which may still be in flight through ZeroMQ.
                        msg = self._recv(_MESSAGE_IN_FLIGHT_S)
                        if msg is None:
                            continue
                    else:
                        now = time.monotonic()
                        if now - last_heard >= self.dead_after_s:
                            raise _Reconnect(
                                f"no message from the daemon for {self.dead_after_s:.1f} s"
                            )
                        if now < next_hb:
                            continue
                        self._send("heartbeat", s=self._sid)
                        next_hb = now + self.heartbeat_s
                        # The answer rings the bell, but a daemon that no longer knows this
                        # session (restarted, or it expired) answers without one.
                        msg = self._recv(_MESSAGE_IN_FLIGHT_S)
                        if msg is None:
                            continue
                last_heard = time.monotonic()
                if msg.get("s") not in (None, self._sid):
                    continue  # stale: from a session we already left
                kind = msg["t"]
                if kind == "end":  # sent after the last batch was published
                    return self._batch(n) if ring.produced() > n else None
                if kind == "bye":
                    raise _Reconnect("daemon is shutting down")
                if kind == "error":
                    code = str(msg.get("code"))
                    if code in (P.E_UNKNOWN_SESSION, P.E_REPLACED):
                        raise _Reconnect(f"session lost: {msg.get('msg')}")
                    raise P.LoaderRequestError(code, str(msg.get("msg")))
                # "hb": the daemon is alive; look at the ring again
        finally:
            ring.wake_client_at(0)  # awake again: no bells wanted (see Session.nudge)
            self.wait_s += time.monotonic() - t0
            ring.set_wait(self.wait_s)

    def _batch(self, n: int) -> Batch:
        ring = self._ring
        assert ring is not None
        slot = n % ring.slots
        seq, e, s, m, ne, ns, nm, steps, bucket, rows, width, tokens, maxlen = ring.meta(slot)
        if seq != n or (e, s, m) != self.position:
            raise _Reconnect(
                f"slot {slot} holds batch {seq} at {(e, s, m)}, expected {n} at {self.position}"
            )
        layout = (self.effective_spec or {}).get("layout", "padded")
        if layout == "packed":
            shape = (1, width)
            position_ids = ring.tensor(slot, "position_ids", shape)
            cu = ring.tensor(slot, "cu_seqlens", (rows + 1,))
        else:
            shape = (rows, width)
            position_ids = cu = None  # type: ignore[assignment]
        batch = Batch(
            input_ids=ring.tensor(slot, "input_ids", shape),
            loss_mask=ring.tensor(slot, "loss_mask", shape),
            lengths=ring.tensor(slot, "lengths", (rows,)),
            sample_ids=ring.tensor(slot, "sample_ids", (rows,)),
            position_ids=position_ids,
            cu_seqlens=cu,
            max_seqlen=maxlen,
            epoch=e,
            step=s,
            micro=m,
            bucket=bucket,
            layout=layout,
            steps_per_epoch=steps,
            num_tokens=tokens,
            _guard=ring.guards[slot],
        )
        self.steps_per_epoch = steps
        self.position = (ne, ns, nm)
        self._n = n + 1
        self._held = True
        return batch

    def _release_held(self) -> None:
        """Give the held batch's slot back: a counter store, and a doorbell only if the
        daemon sleeps waiting for exactly this. Asynchronous CUDA copies from the slot
        (``Batch.to``) are waited for first; with none pending this costs no CUDA call."""
        if self._held and self._ring is not None:
            guard = self._ring.guards[(self._n - 1) % self._ring.slots]
            if guard.pending:
                guard.wait()
            old, self._consumed = self._consumed, self._n
            self._ring.set_consumed(self._n)
            if P.crossed(old, self._n, self._ring.daemon_wake()):
                self._send("release", s=self._sid)
        self._held = False

    def _send(self, kind: str, **fields: Any) -> None:
        # zmq.Again: no daemon connected right now; the receive side notices and reconnects.
        with contextlib.suppress(zmq.Again):
            self._socket().send(P.encode(kind, **fields), zmq.NOBLOCK)

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        sock = self._socket()
        if not sock.poll(max(0, int(timeout_s * 1000))):
            return None
        return P.decode(sock.recv())

    def _close_session(self) -> None:
        self._sid = None
        self._held = False
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def _reset(self, why: str, deadline: float) -> None:
        """Drop socket and session; back off before the next open attempt."""
        self._close_session()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        left = deadline - time.monotonic()
        if left <= 0:
            raise P.LoaderUnavailableError(
                f"no loader daemon answered on {self.endpoint} for {self.timeout_s:.0f} s "
                f"(last problem: {why}); is `dflash-loader serve` running?"
            )
        log.warning("loader connection lost (%s); reconnecting to %s", why, self.endpoint)
        time.sleep(min(0.2, left))


class _Reconnect(Exception):
    pass
