"""``--resume``: find the newest checkpoint every rank can load, check that it belongs to
this run, and put it back.

* **Finding** (``newest_complete``): checkpoints are tried newest first. Rank 0 checks the
  file digests, the others the sizes; the ranks agree on each candidate with one
  all-reduce, so all resume from the same one. A torn checkpoint (a kill while writing) is
  skipped with a warning; one that is refused (another world size it cannot take, another
  version) stops the run.
* **Checking** (``check_compatible``): the drafter config (fields a checkpoint predates
  count with their defaults), the loss config and the target (``guards.check_target``)
  must be this run's.
* **Restoring** (``restore``): weights, optimizer and scheduler state, the step and epoch,
  the clock (``trainer.train.clock``), this rank's loader position and RNG states (a rank
  the checkpoint did not have is seeded from the run, never at random).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from loader_server.wire.spec import ANCHOR_RULE
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.train import checkpoint as ckpt
from trainer.train.batches import BatchSource
from trainer.train.clock import SavedClock
from trainer.train.distributed import DistEnv, all_reduce
from trainer.train.guards import TrainingError, check_target
from trainer.train.optimizers import optimizer_kind

log = logging.getLogger(__name__)

# Drafter config fields newer than some checkpoints, with the value those checkpoints mean
# (every field added since the first has a default: no sliding layers, DFlash v1).
_DRAFTER_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(DrafterConfig) if f.default is not MISSING
}


@dataclass(frozen=True)
class Found:
    """A checkpoint every rank verified and loaded: the shared record and this rank's part
    (``loader``: its client's state; ``rng``: its RNG states, None for a rank it lacks)."""

    path: Path
    record: ckpt.CheckpointRecord
    mine: dict[str, Any]


@dataclass(frozen=True)
class Restored:
    """What the loop continues from after ``restore``."""

    step: int
    epoch: int
    scheduler_state: dict[str, Any]
    clock: SavedClock
    loader_spec: dict[str, Any] | None  # the spec the checkpoint was served


def newest_complete(found: Sequence[Path], env: DistEnv, run_dir: Path) -> Found:
    """The newest of ``found`` that every rank verified and loaded; torn ones are skipped."""
    skipped: list[str] = []
    for path in reversed(found):
        why, loaded, fatal = None, None, None
        try:
            ckpt.verify_checkpoint(path, digests=env.is_main)
            loaded = ckpt.load_checkpoint(path, env)
        except ckpt.TornCheckpointError as e:
            why = str(e)
        except ValueError as e:  # not torn but refused (world size, version): stop
            fatal = e
        code = 2.0 if fatal is not None else 0.0 if why is None else 1.0
        agreed = all_reduce(torch.tensor([code], device=env.device), env, op="max")
        if agreed.item() == 2:
            raise fatal or TrainingError(f"{path}: another rank refused this checkpoint")
        if agreed.item() == 0 and loaded is not None:
            if skipped:
                log.warning(
                    "rank %d: resuming from %s, the newest complete checkpoint (skipped: %s)",
                    env.rank, path.name, "; ".join(skipped),
                )  # fmt: skip
            return Found(path, *loaded)
        why = why or "another rank could not read its part"
        log.warning("rank %d: skipping checkpoint %s: %s", env.rank, path, why)
        skipped.append(f"{path.name}: {why}")
    raise ckpt.TornCheckpointError(
        f"--resume: no complete checkpoint in {ckpt.checkpoint_dir(run_dir)} "
        f"({'; '.join(skipped)}); start a new --run-dir"
    )


def check_compatible(
    found: Found, *, drafter_config: dict[str, Any], loss_config: dict[str, Any],
    meta: dict[str, Any],
) -> None:  # fmt: skip
    """Refuse a checkpoint of another drafter, loss or target, naming what differs."""
    path, saved = found.path, found.record
    # Fields a checkpoint predates have their defaults (no sliding layers).
    theirs = {**_DRAFTER_DEFAULTS, **saved.drafter_config}
    if theirs["layer_types"] is not None:
        theirs["layer_types"] = tuple(theirs["layer_types"])
    for what, old, new in (("drafter config", theirs, drafter_config),
                           ("loss config", saved.loss_config, loss_config)):  # fmt: skip
        differ = sorted(k for k in {*new, *old} if new.get(k) != old.get(k))
        if differ:
            raise ValueError(
                f"{path}: {what} differs from this run's in "
                + ", ".join(f"{k} ({old.get(k)!r} vs {new.get(k)!r})" for k in differ)
                + _objective_hint(differ, old)
            )
    check_target(path, saved.meta, meta)
    check_schedule(path, saved.meta, saved.scheduler, meta.get("schedule") or {})


#: The LR schedule's options a resume restores, and their flags.
SCHEDULE_FLAGS = {"lr": "--lr", "lr_schedule": "--lr-schedule", "warmup": "--warmup"}


def check_schedule(
    path: Path, saved_meta: dict[str, Any], scheduler: dict[str, Any] | None,
    mine: dict[str, Any],
) -> None:  # fmt: skip
    """A resume restores the LR schedule exactly (the scheduler's saved peak rate, the
    schedule rebuilt from the options): refuse one whose options would train at another
    rate than they say (``config.json`` records them), naming the flags that continue it.
    Checkpoints from before the schedule was recorded give their peak rate only."""
    was = dict(saved_meta.get("schedule") or {})
    if not was and scheduler and scheduler.get("base_lrs"):
        was = {"lr": float(scheduler["base_lrs"][0])}
    differ = [k for k in SCHEDULE_FLAGS if k in was and k in mine and was[k] != mine[k]]
    if differ:

        def flags(d: dict[str, Any]) -> str:
            return " ".join(f"{SCHEDULE_FLAGS[k]} {d[k]}" for k in differ)

        raise ValueError(
            f"{path}: trained with {flags(was)}, this run asks for {flags(mine)}: pass "
            f"{flags(was)} to continue it (a resume restores its LR schedule; for another, "
            "`dflash-train export` the checkpoint and start a new run with --init-drafter)"
        )


def _objective_hint(differ: list[str], saved: dict[str, Any]) -> str:
    """How to continue a checkpoint trained under another objective (the flags to give)."""
    flags = {"tokens_per_anchor": "--tokens-per-anchor", "weighting": "--loss-weighting",
             "dpace_alpha": "--dpace-alpha", "normalization": "--loss-normalization",
             "divisor": "--loss-divisor",
             "anchor_draw": "--anchor-draw", "max_anchors": "--max-anchors"}  # fmt: skip
    given = [f"{flags[k]} {saved[k]}" for k in differ if k in flags]
    if not given:
        return ""
    return f"; to continue it under the objective it was trained with, pass {' '.join(given)}"


def restore(
    found: Found, *, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer,
    source: BatchSource, env: DistEnv, seed: int, grad_accum: int,
) -> Restored:  # fmt: skip
    """Put ``found`` back into the drafter, the optimizer, the loader client and the RNGs.
    ``grad_accum`` is what this run asked for: a checkpoint whose spec does not record one
    was trained with it."""
    saved, mine = found.record, found.mine
    drafter.load_state_dict(saved.drafter)
    if saved.optimizer is None or saved.scheduler is None:
        raise ValueError(f"{found.path}: the checkpoint holds no optimizer or scheduler state")
    was, now = optimizer_kind(saved.optimizer), optimizer_kind(optimizer.state_dict())
    if was != now:
        raise ValueError(
            f"{found.path}: trained with --optimizer {was}, this run asks for {now}: pass "
            f"--optimizer {was} to continue it (or start a new run)"
        )
    optimizer.load_state_dict(saved.optimizer)
    spec = saved.meta.get("loader_spec")
    spec_ga = (spec or {}).get("grad_accum", grad_accum)
    keep_saved_anchor_rule(spec, source)
    source.load_state_dict(mine["loader"])
    if mine["rng"] is not None:
        ckpt.set_rng_state(mine["rng"])
    else:  # a rank the checkpoint did not have: seeded from the run, never at random
        ckpt.seed_rng(seed, env.rank, saved.step)
    clock = SavedClock(saved.clock, saved.world_size, int(spec_ga))
    return Restored(saved.step, saved.epoch, saved.scheduler, clock, spec)


def keep_saved_anchor_rule(saved: dict[str, Any] | None, source: BatchSource) -> None:
    """Checkpoints from before the trainer sent its anchor rule recorded the daemon's
    (16, 512, 2048). Without a slot cost (``cost_slot`` 0) those fields do not enter
    the plan: ask for the saved ones, so the saved position resumes in the same plan."""
    saved = saved or {}
    asked = getattr(source, "spec", None)
    if not isinstance(asked, dict) or saved.get("cost_slot"):
        return
    old = {k: saved[k] for k in ANCHOR_RULE if k in saved and asked.get(k) != saved[k]}
    if old:
        log.warning(
            "the checkpoint's loader spec records anchor rule %s (saved before the trainer "
            "sent its own); with no slot cost it does not change the plan, so it is kept "
            "for this run", old,
        )  # fmt: skip
        source.spec = {**asked, **old}  # type: ignore[attr-defined]
