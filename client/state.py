"""A rank's saved position (``LoaderClient.state_dict``) and how it resumes: pure logic.

A state holds the next batch's ``[epoch, step, micro]``, the shape changes its epoch went
through (``legs``), the corpus fingerprint and the effective spec it belongs to. It
resumes under the shape it was saved under (then it must be this rank's), or under another
world size or ``grad_accum`` at a step boundary: the steps it served become a leg of the
epoch and the rest is planned afresh for the new shape (``loader_server.planning.elastic``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loader_server.wire import protocol as P

# 2: the effective spec is recorded; 3: the legs (shape changes) of the position's epoch.
# Versions 1 and 2 still load.
STATE_VERSION = 3
_LOADS = (1, 2, STATE_VERSION)


@dataclass(frozen=True)
class Resume:
    """Where a loaded state puts a client: ``resized`` says in words what a shape change
    did (None: same shape); ``spec`` is the one the daemon must serve (None: not saved)."""

    position: tuple[int, int, int]
    legs: tuple[P.Leg, ...]
    fingerprint: str | None
    spec: dict[str, Any] | None
    resized: str | None


def saved_state(
    *,
    job: str,
    rank: int,
    world_size: int,
    position: tuple[int, int, int],
    legs: tuple[P.Leg, ...],
    fingerprint: str | None,
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
    """The ``state_dict`` of a client at ``position`` (plain lists and maps: JSON-safe)."""
    return {
        "version": STATE_VERSION,
        "job": job,
        "rank": rank,
        "world_size": world_size,
        "position": list(position),
        "legs": [list(leg) for leg in legs],
        "fingerprint": fingerprint,
        "spec": spec,
    }


def resume(state: Any, *, job: str, rank: int, world_size: int, grad_accum: int | None) -> Resume:
    """Check ``state`` and say where it resumes for this client (``grad_accum``: the one
    this client asks for, None: the saved one). Raises ``ValueError`` naming what is
    wrong: another version, job or rank, a malformed field, a position inside a step."""
    if not isinstance(state, dict) or state.get("version") not in _LOADS:
        version = state.get("version") if isinstance(state, dict) else state
        raise ValueError(
            f"loader state version {version!r} is not {STATE_VERSION}; "
            f"it was saved by an incompatible dflash-loader"
        )
    fingerprint, spec = state.get("fingerprint"), state.get("spec")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(f"loader state fingerprint must be a string, got {fingerprint!r}")
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"loader state spec must be a map, got {spec!r}")
    if state.get("job") != job:
        raise ValueError(
            f"loader state is for job={state.get('job')!r}, this client has job="
            f"{job!r}: a position resumes only in its own job"
        )
    position = P.position(state.get("position"), "state position")
    legs = P.legs(state.get("legs"), "state legs")
    old = _shape(state.get("world_size"), spec, grad_accum)
    new = (world_size, grad_accum if grad_accum is not None else old[1])
    resized = None
    if old == new:
        for key, mine in (("rank", rank), ("world_size", world_size)):
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state is for {key}={state.get(key)!r}, this client has {key}={mine!r}"
                )
    else:
        if spec is None:
            raise ValueError(
                f"loader state of world_size {old[0]} was saved without its spec (version "
                f"{state.get('version')}): it resumes only under the same world size"
            )
        position, legs, resized = _reshape(position, legs, old, new)
        spec = {**spec, "world_size": new[0], "grad_accum": new[1]}
    return Resume(position, legs, fingerprint or None, spec, resized)


def _shape(world_size: Any, spec: dict[str, Any] | None, asked: Any) -> tuple[int, int]:
    """The (world_size, grad_accum) a state was saved under (a state without its spec,
    version 1, is taken to have the ``grad_accum`` asked for now)."""
    grad_accum = spec.get("grad_accum", 1) if spec is not None else asked or 1
    for name, value in (("world_size", world_size), ("spec grad_accum", grad_accum)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"loader state {name} must be a positive int, got {value!r}")
    return world_size, grad_accum


def _reshape(
    position: tuple[int, int, int],
    legs: tuple[P.Leg, ...],
    old: tuple[int, int],
    new: tuple[int, int],
) -> tuple[tuple[int, int, int], tuple[P.Leg, ...], str]:
    """``(position, legs, what changed)`` of a position saved under shape ``old`` resumed
    under ``new``: the steps served under ``old`` become a leg of the epoch (none if it
    served none), and the new shape starts the rest of the epoch at its step 0."""
    epoch, step, micro = position
    if micro:
        raise ValueError(
            f"loader position {list(position)} is inside step {step} (micro-batch {micro} of "
            f"{old[1]}); a resume under another world size or grad_accum starts at a step "
            f"boundary (a checkpoint taken after an optimizer step)"
        )
    if step:
        legs = (*legs, P.Leg(old[0], old[1], step))
    if len(legs) > P.MAX_LEGS:
        raise ValueError(f"epoch {epoch} changed shape {len(legs)} times; at most {P.MAX_LEGS}")
    what = (
        f"world_size {old[0]} x grad_accum {old[1]} -> {new[0]} x {new[1]} at epoch {epoch} "
        f"step {step}: the rest of the epoch is planned afresh for the new shape"
        + (f" ({len(legs)} shape change(s) in this epoch)" if legs else "")
    )
    return (epoch, 0, 0), legs, what
