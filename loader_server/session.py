"""One trainer rank's session: its ring, where it is in the plan, and filling its slots.

A session produces this rank's micro-batches in plan order from a start position: for
each epoch, step and micro index, ``plan.micro(step, rank, micro)`` gives the sample ids,
which are copied straight from the memory-mapped corpus into a free slot. The client
releases a slot when it asks for the next batch, so at most ``num_slots`` batches are
in flight and the daemon never runs ahead of a slow trainer by more than the ring.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client.protocol import SlotLayout
from loader_server.dataset import ArrowDataset
from loader_server.planner import EpochPlan
from loader_server.shm import ShmRing
from loader_server.spec import BatchSpec

Position = tuple[int, int, int]


def slot_layout_for(spec: BatchSpec, lengths: np.ndarray) -> SlotLayout:
    """Capacity for any micro-batch of ``spec``: rows*width <= budget; docs bounded by rows
    (padded) or by how many of the shortest non-empty samples fit a packed row."""
    if spec.layout == "padded":
        docs = spec.max_batch_size
    else:
        positive = lengths[lengths > 0]
        shortest = int(positive.min()) if positive.size else 1
        docs = max(1, spec.token_budget // shortest)
    return SlotLayout.build(tokens=spec.token_budget, docs=min(docs, spec.token_budget))


@dataclass
class SessionStats:
    batches: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    client_wait_s: float = 0.0


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
    ) -> None:
        self.sid = sid
        self.peer = peer
        self.job = job
        self.rank = rank
        self.spec = spec
        self.ring = ring
        self.pos: Position = start  # next micro-batch to produce
        self.end_epoch = end_epoch
        self.pad_id = pad_id
        self.free: deque[int] = deque(range(ring.num_slots))
        self.inflight: dict[int, Position] = {}
        self.last_seen = time.monotonic()
        self.ended = False  # `end` was sent
        self.stats = SessionStats()

    @property
    def finished(self) -> bool:
        return self.end_epoch is not None and self.pos[0] >= self.end_epoch

    def release(self, slot: int) -> None:
        if slot not in self.inflight:
            raise ValueError(f"slot {slot} is not in flight for session {self.sid}")
        del self.inflight[slot]
        self.free.append(slot)

    def advance(self, plan: EpochPlan) -> Position:
        """Position after ``self.pos`` within ``plan`` (the plan of ``self.pos``'s epoch)."""
        e, s, m = self.pos
        if m + 1 < self.spec.grad_accum:
            return (e, s, m + 1)
        if s + 1 < plan.num_steps:
            return (e, s + 1, 0)
        return (e + 1, 0, 0)

    def fill(self, plan: EpochPlan, dataset: ArrowDataset) -> dict[str, Any]:
        """Write the micro-batch at ``self.pos`` into a free slot; return the announcement."""
        _, s, m = self.pos
        slot = self.free.popleft()
        ids = plan.micro(s, self.rank, m)
        width = int(plan.micro_len(s, self.rank, m))
        lens = np.minimum(dataset.lengths[ids], self.spec.max_seq_len).astype(np.int32)
        rows = int(ids.size)
        ring, cap = self.ring, self.spec.max_seq_len
        ring.field(slot, "sample_ids", rows)[:] = ids
        ring.field(slot, "lengths", rows)[:] = lens
        if self.spec.layout == "padded":
            out_ids = ring.field(slot, "input_ids", rows * width, (rows, width))
            out_mask = ring.field(slot, "loss_mask", rows * width, (rows, width))
            out_ids.fill(self.pad_id)
            out_mask.fill(0)
            dataset.write_rows(ids, out_ids, out_mask, cap)
            tokens = int(lens.sum())
        else:
            tokens = int(lens.sum())
            assert tokens == width, f"packed row {self.pos}: {tokens} tokens, plan says {width}"
            dataset.write_packed(
                ids, ring.field(slot, "input_ids", width), ring.field(slot, "loss_mask", width), cap
            )
            cu = ring.field(slot, "cu_seqlens", rows + 1)
            cu[0] = 0
            np.cumsum(lens, out=cu[1:])
            starts = np.repeat(cu[:-1], lens)
            np.subtract(
                np.arange(width, dtype=np.int32),
                starts,
                out=ring.field(slot, "position_ids", width),
            )
        nxt = self.advance(plan)
        self.inflight[slot] = self.pos
        msg = {
            "s": self.sid,
            "slot": slot,
            "pos": list(self.pos),
            "next": list(nxt),
            "steps": plan.num_steps,
            "bucket": int(plan.micro_bucket(s, self.rank, m)),
            "rows": rows,
            "width": width,
            "tokens": tokens,
            "maxlen": int(lens.max()) if rows else 0,
        }
        self.pos = nxt
        self.stats.batches += 1
        self.stats.tokens += tokens
        return msg
