"""The rest of an epoch under another shape: resuming a job on other ranks, exactly once.

A job's *shape* is ``(world_size, grad_accum)``: a step is ``world_size * grad_accum``
micro-batches. A position taken at step ``s`` of epoch ``e`` under one shape can resume
under another: the samples served by steps ``< s`` are consumed; everything else of the
epoch (the rest of that plan, and the leftover it could not fit into a last step) is
planned afresh for the new shape, with every guarantee of a fresh epoch (token and cost
budgets, buckets, stratified steps, rank balance, equal step counts per rank). Later epochs
are plain plans of the new shape.

A change that keeps ``world_size x grad_accum`` (a lost node made up by accumulation:
4 x 2 -> 2 x 4, as DeepSpeed's elasticity keeps the global batch) keeps the rest of the
epoch's steps instead: each step's micro-batches as they were, dealt afresh to the new
ranks and micro indices (``planner.redeal_rest``), so with the trainer's step-normalized
loss the resumed run trains the uninterrupted run's steps (docs/TRAINER.md).

The position records the *legs* of its epoch: ``Leg(world_size, grad_accum, steps)`` for
each shape that served part of it, in order. The plan of the current leg is a pure function
of ``(lengths, spec, epoch, legs)`` (``plan_rest``): leg ``k``'s plan is made from what legs
``< k`` left, its randomness drawn from seeds no whole-epoch plan uses
(``planner._Seeds``). So every daemon on every node computes the same rest of the epoch
without talking to the others, and a second or third change in one epoch works the same
way. With no legs it is ``plan_epoch``, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from loader_server.planning.planner import EpochPlan, plan_epoch, redeal_rest
from loader_server.wire.protocol import MAX_LEGS, Leg
from loader_server.wire.spec import BatchSpec

__all__ = ["ChainMismatch", "Leg", "consumed", "plan_rest", "rest_after", "shaped"]


class ChainMismatch(ValueError):
    """A position's legs do not fit this corpus and spec (a leg served more steps than its
    plan has)."""


def shaped(spec: BatchSpec, world_size: int, grad_accum: int) -> BatchSpec:
    """``spec`` with another shape (every other field the same)."""
    if (spec.world_size, spec.grad_accum) == (world_size, grad_accum):
        return spec
    return dataclasses.replace(spec, world_size=world_size, grad_accum=grad_accum)


def consumed(plan: EpochPlan, steps: int) -> np.ndarray:
    """Sample ids served by steps ``< steps`` of ``plan`` (a view)."""
    if not 0 <= steps <= plan.num_steps:
        raise ValueError(f"steps {steps} outside 0..{plan.num_steps}")
    return plan.sample_ids[: plan.offsets[steps * plan.spec.micro_per_step]]


def rest_after(plan: EpochPlan, steps: int) -> np.ndarray:
    """Bool per sample: still to be served in ``plan``'s epoch once its steps ``< steps``
    are (nothing the legs before ``plan`` consumed)."""
    keep = np.ones(plan.stats["samples"], np.bool_) if plan.keep is None else plan.keep.copy()
    keep[consumed(plan, steps)] = False
    return keep


def plan_rest(
    lengths: np.ndarray,
    spec: BatchSpec,
    *,
    epoch: int,
    legs: Sequence[Leg] = (),
    prior: EpochPlan | None = None,
) -> EpochPlan:
    """The plan of what ``legs`` left of ``epoch``, for ``spec``'s shape.

    ``prior``, when the caller has it (a daemon's plan cache), is the plan of the last leg:
    ``plan_rest(lengths, shaped(spec, *legs[-1][:2]), epoch=epoch, legs=legs[:-1])``;
    otherwise it is computed (each earlier leg costs one plan).

    Raises:
        ChainMismatch: a leg served more steps than its plan has on this corpus and spec.
        ValueError: more than ``MAX_LEGS`` legs, or a ``prior`` of another leg.
    """
    legs = tuple(Leg(*leg) for leg in legs)
    if not legs:
        return plan_epoch(lengths, spec, epoch=epoch)
    if len(legs) > MAX_LEGS:
        raise ValueError(f"{len(legs)} shape changes in epoch {epoch}; at most {MAX_LEGS}")
    last = legs[-1]
    before = shaped(spec, last.world_size, last.grad_accum)
    if prior is None:
        prior = plan_rest(lengths, before, epoch=epoch, legs=legs[:-1])
    elif (prior.spec.key(), prior.epoch, prior.leg) != (before.key(), epoch, len(legs) - 1):
        raise ValueError(
            f"prior is the plan of epoch {prior.epoch} leg {prior.leg}, not of epoch {epoch} "
            f"leg {len(legs) - 1} under world_size {last.world_size} x grad_accum "
            f"{last.grad_accum}"
        )
    if last.steps > prior.num_steps:
        raise ChainMismatch(
            f"the position's epoch {epoch} ran {last.steps} steps under world_size "
            f"{last.world_size} x grad_accum {last.grad_accum} (shape change {len(legs)}), but "
            f"that part of the epoch has only {prior.num_steps} steps on this corpus and spec: "
            "the position belongs to another corpus or spec"
        )
    keep = rest_after(prior, last.steps)
    if spec.micro_per_step == prior.spec.micro_per_step and last.steps < prior.num_steps:
        return redeal_rest(lengths, prior, last.steps, spec, leg=len(legs), keep=keep)
    return plan_epoch(lengths, spec, epoch=epoch, keep=keep, leg=len(legs))
