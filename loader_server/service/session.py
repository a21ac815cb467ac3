"""One trainer rank's session: its ring, where it is in the plan, and filling its slots.

A session produces this rank's micro-batches in plan order from a start position: for
each epoch, step and micro index, ``plan.micro(step, rank, micro)`` gives the sample ids,
which are copied straight from the memory-mapped corpus into slot ``n % slots`` (batch n of
the session). The client's ``consumed`` counter says which slots are free again, so at most
``num_slots`` batches are in flight and the daemon never runs ahead of a slow trainer by
more than the ring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from loader_server.data.dataset import ArrowDataset
from loader_server.planning.planner import EpochPlan
from loader_server.service.rings import ShmRing
from loader_server.wire import ring as R
from loader_server.wire.layouts import layout
from loader_server.wire.protocol import Leg
from loader_server.wire.ring import SlotLayout
from loader_server.wire.spec import BatchSpec

Position = tuple[int, int, int]


def shortest_sample(lengths: np.ndarray) -> int:
    """The shortest non-empty sample's length (1 if there is none)."""
    positive = lengths[lengths > 0]
    return int(positive.min()) if positive.size else 1


def slot_layout_for(spec: BatchSpec, shortest: int) -> SlotLayout:
    """Capacity for any micro-batch of ``spec``: rows*width <= budget; docs bounded by rows
    (padded) or by how many of the ``shortest`` non-empty samples fit a packed row."""
    docs = layout(spec.layout).max_docs(
        token_budget=spec.token_budget, max_batch_size=spec.max_batch_size, shortest=shortest
    )
    return SlotLayout.build(tokens=spec.token_budget, docs=docs)


@dataclass
class SessionStats:
    batches: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)


class Session:
    """State of one (job, rank) connection. Owns its ring; the server owns the sessions."""

    def __init__(
        self,
        sid: str,
        peer: bytes,
        *,
        job: str,
        rank: int,
        spec: BatchSpec,
        ring: ShmRing,
        start: Position,
        end_epoch: int | None,
        pad_id: int = 0,
        legs: tuple[Leg, ...] = (),
    ) -> None:
        self.sid = sid
        self.peer = peer
        self.job = job
        self.rank = rank
        self.spec = spec
        self.ring = ring
        self.pos: Position = start  # next micro-batch to produce
        self.legs = legs  # the shapes pos's epoch had before this one (elastic resume)
        self.end_epoch = end_epoch
        self.pad_id = pad_id
        self.produced = 0  # batches published into the ring
        self.consumed = 0  # batches the client is done with, as last read
        self.planned_ahead = -1  # the latest epoch whose plan this session asked for early
        self.last_seen = time.monotonic()
        # Wall-clock time of the open, for messages that name this session to an operator.
        self.opened_at = time.time()
        self.ended = False  # `end` was sent
        self.stats = SessionStats()

    @property
    def finished(self) -> bool:
        return self.end_epoch is not None and self.pos[0] >= self.end_epoch

    @property
    def can_fill(self) -> bool:
        return self.produced - self.consumed < self.ring.num_slots

    def sync(self) -> bool:
        """Read the client's ``consumed`` counter; True if it moved (the client is alive).

        Raises:
            ValueError: the counter went backwards or past what was produced (a client
                writing garbage into its control page).
        """
        consumed = self.ring.consumed()
        if consumed == self.consumed:
            return False
        if not self.consumed < consumed <= self.produced:
            raise ValueError(
                f"session {self.sid}: consumed counter {consumed} outside "
                f"[{self.consumed}, {self.produced}]"
            )
        self.consumed = consumed
        self.last_seen = time.monotonic()
        return True

    def nudge(self) -> None:
        """The daemon cannot fill this session now (say the next epoch's plan is not ready):
        a client asleep waiting for two batches while one is ready is woken to take it (it
        clears its threshold once awake, so this rings once)."""
        if self.produced > self.consumed and self.ring.client_wake() > self.produced:
            self.ring.ring_bell()

    def arm(self) -> None:
        """Before the daemon sleeps: ask for a doorbell when the client takes the last
        batch in the ring. Refilling earlier is the daemon's own job (it looks at the
        counters at least every millisecond while trainers consume), so a trainer that
        keeps up never pays for a message."""
        self.ring.wake_daemon_at(max(self.produced - 1, self.consumed + 1))

    def advance(self, plan: EpochPlan) -> Position:
        """Position after ``self.pos`` within ``plan`` (the plan of ``self.pos``'s epoch)."""
        e, s, m = self.pos
        if m + 1 < self.spec.grad_accum:
            return (e, s, m + 1)
        if s + 1 < plan.num_steps:
            return (e, s + 1, 0)
        return (e + 1, 0, 0)

    def fill(self, plan: EpochPlan, dataset: ArrowDataset) -> None:
        """Write and publish the micro-batch at ``self.pos`` into the next slot, and wake
        the client if it sleeps waiting for it."""
        _, s, m = self.pos
        slot = self.produced % self.ring.num_slots
        ids, width, bucket = plan.micro_parts(s, self.rank, m)
        rows = int(ids.size)
        out = self.ring.slot(slot)
        padded = not layout(self.spec.layout).packs
        tokens, maxlen = dataset.fill(
            ids,
            self.spec.max_seq_len,
            input_ids=out["input_ids"],
            loss_mask=out["loss_mask"],
            lengths=out["lengths"],
            sample_ids_out=out["sample_ids"],
            position_ids=None if padded else out["position_ids"],
            cu_seqlens=None if padded else out["cu_seqlens"],
            width=width if padded else 0,
            pad_id=self.pad_id,
        )
        if not padded:
            assert tokens == width, f"packed row {self.pos}: {tokens} tokens, plan says {width}"
        nxt = self.advance(plan)
        meta = R.SlotMeta(
            self.produced,
            *self.pos,
            *nxt,
            steps=plan.num_steps,
            bucket=bucket,
            rows=rows,
            width=width,
            tokens=tokens,
            maxlen=maxlen,
        )
        self.ring.publish(meta)
        self.produced += 1
        if nxt[0] != self.pos[0]:
            self.legs = ()  # a new epoch is planned whole for this shape
        self.pos = nxt
        self.stats.batches += 1
        self.stats.tokens += tokens
        if R.crossed(self.produced - 1, self.produced, self.ring.client_wake()):
            self.ring.ring_bell()
