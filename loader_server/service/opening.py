"""Opening a session without stalling anyone: check at once, plan and map in the background.

An ``open`` is checked on the serving thread as soon as it arrives (``parse_open``: every
field's type and range, the daemon's spec limits, a resumed position's spec and corpus) and
refused at once when something is wrong. What can take time runs elsewhere: the start
epoch's plan on the planner thread (``PlanCache``), a large ring's creation (reserving up
to ``max_ring_bytes`` of shared memory) on a helper thread. Meanwhile the client hears
``pending`` every second and every other session is served as usual; once both are ready
the server checks the start position against the plan and sends ``welcome``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loader_server.planning.elastic import shaped
from loader_server.planning.planner import EpochPlan
from loader_server.planning.servable import why_unservable
from loader_server.service.limits import SpecLimits
from loader_server.service.rings import ShmRing
from loader_server.wire import protocol as P
from loader_server.wire.spec import BatchSpec

Position = tuple[int, int, int]
#: Rings up to this size are made on the serving thread (reserving them takes ~1 ms).
SYNC_RING_BYTES = 64 << 20
#: A job name is a label in logs and stats: long enough for any run name, short enough to
#: keep those lines readable.
MAX_JOB_CHARS = 128
#: Ranks per job: far above any real cluster, low enough to keep a bogus open cheap to refuse.
MAX_WORLD_SIZE = 65536
#: How often a client waiting for its session hears ``pending``: well within the silence
#: after which a client presumes the daemon gone (``dead_after_s``, 5 s by default).
PENDING_EVERY_S = 1.0


class SpecMismatch(ValueError):
    """A job's ranks, or a resumed position, disagree with this open's spec or corpus."""


@dataclass(frozen=True)
class OpenRequest:
    job: str
    rank: int
    world_size: int
    spec: BatchSpec
    start: Position
    epochs: int | None
    legs: tuple[P.Leg, ...] = ()  # the shapes the start epoch had before this one


def parse_open(
    msg: dict[str, Any], defaults: BatchSpec, limits: SpecLimits, num_samples: int,
    fingerprint: str,
) -> OpenRequest:  # fmt: skip
    """The request an ``open`` message makes, fully checked (ValueError says what is wrong;
    SpecMismatch when the position it resumes belongs to another spec or corpus)."""
    job, rank, world = msg.get("job"), msg.get("rank"), msg.get("world_size")
    if not isinstance(job, str) or not job or len(job) > MAX_JOB_CHARS or not job.isprintable():
        raise ValueError(
            f"job must be a non-empty printable string of <= {MAX_JOB_CHARS} chars, got {job!r}"
        )
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    overrides = msg.get("spec") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"spec must be a map of BatchSpec fields, got {type(overrides)}")
    spec = BatchSpec.from_dict({**defaults.to_dict(), **overrides, "world_size": world})
    limits.check(spec, num_samples)
    start = P.position(msg.get("pos", [0, 0, 0]))
    if start[2] >= spec.grad_accum:
        raise ValueError(f"pos micro {start[2]} >= grad_accum {spec.grad_accum}")
    legs = P.legs(msg.get("legs"))
    for k, leg in enumerate(legs, 1):
        if leg.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"legs: shape change {k} has world_size {leg.world_size}, beyond "
                f"{MAX_WORLD_SIZE} ranks"
            )
        try:  # each leg was once a spec this daemon had to accept
            limits.check(shaped(spec, leg.world_size, leg.grad_accum), num_samples)
        except ValueError as e:
            raise ValueError(f"legs: shape change {k}: {e}") from None
    epochs = msg.get("epochs")
    if epochs is not None and (
        not isinstance(epochs, int) or isinstance(epochs, bool) or not 0 <= epochs <= P.MAX_INDEX
    ):
        raise ValueError(f"epochs must be an int in [0, {P.MAX_INDEX}] or nil, got {epochs!r}")
    _check_expected(msg, spec, fingerprint, start)
    return OpenRequest(job, rank, world, spec, start, epochs, legs)


def _check_expected(
    msg: dict[str, Any], spec: BatchSpec, fingerprint: str, start: Position
) -> None:
    """A position saved with a state_dict is only meaningful under its spec and corpus."""
    want_fp = msg.get("expect_fingerprint")
    if want_fp is not None and want_fp != fingerprint:
        raise SpecMismatch(
            f"position {list(start)} belongs to corpus {want_fp!r}, but this daemon serves "
            f"{fingerprint}; resuming would replay other data"
        )
    want = msg.get("expect_spec")
    if want is None:
        return
    if not isinstance(want, dict):
        raise ValueError(f"expect_spec must be a map of BatchSpec fields, got {type(want)}")
    try:
        saved = BatchSpec.from_dict(want).to_dict()
    except (TypeError, ValueError) as e:
        raise ValueError(f"expect_spec is not a valid spec: {e}") from None
    now = spec.to_dict()
    diff = {k: (saved[k], now[k]) for k in now if saved[k] != now[k]}
    if diff:
        raise SpecMismatch(
            f"position {list(start)} was saved under another spec; differences "
            f"(saved, now): {diff}. Resume with the saved spec, or start the job afresh"
        )


def no_steps(epoch: int, plan: EpochPlan, lengths: np.ndarray) -> str:
    """Why epoch ``epoch``'s ``plan`` has no step, for the client: the corpus's reason
    under this spec (every sample too long and dropped, all empty...) where there is one."""
    why = why_unservable(lengths, plan.spec)
    if why is None:
        why = f"{len(lengths)} samples are too few for {plan.spec.micro_per_step} micro-batches"
        why += " per step"
    return f"epoch {epoch} has no steps under this spec: {why}"


def check_start(start: Position, plan: EpochPlan, lengths: np.ndarray) -> None:
    """ValueError unless ``start`` lies inside ``plan`` (the plan of its epoch, or of what is
    left of it after a shape change)."""
    e, s, m = start
    spec = plan.spec
    if plan.num_steps == 0 and plan.leg:
        left = plan.stats["served"] + plan.stats["dropped_leftover"]
        raise ValueError(
            f"the rest of epoch {e} is {left} samples and none of them makes a micro-batch "
            f"under this spec (world_size {spec.world_size} x grad_accum {spec.grad_accum}): "
            f"a position saved under another corpus? The checkpoint is unchanged"
        )
    if plan.num_steps == 0:
        raise ValueError(no_steps(e, plan, lengths))
    if s >= plan.num_steps:
        raise ValueError(
            f"position {[e, s, m]} is past the end of epoch {e}"
            + (f" (after {plan.leg} shape change(s))" if plan.leg else "")
            + f", whose steps are 0..{plan.num_steps - 1} with this spec, world size and corpus "
            "(a position saved under another spec, world size or corpus?)"
        )


@dataclass
class Opening:
    """An accepted ``open`` waiting for its plan (and maybe its ring)."""

    sid: str
    peer: bytes
    req: OpenRequest
    nbytes: int  # shared memory reserved for it
    plan: Future[EpochPlan]
    ring: Future[ShmRing]
    next_notice: float = field(default_factory=lambda: time.monotonic() + PENDING_EVERY_S)
    opened_at: float = field(default_factory=time.time)  # wall clock, for messages

    def ready(self) -> bool:
        return self.plan.done() and self.ring.done()
