"""Atomic, versioned checkpoints that carry the loader position with the weights.

Layout: ``RUN_DIR/checkpoints/step-00000100/`` holds

* ``model.pt`` (written by rank 0): drafter weights, optimizer and scheduler state, the
  step, and the configs needed to rebuild the drafter. Under DDP every rank holds the same
  replicated parameters and optimizer state, so one copy is complete (a sharded optimizer
  would need one file per rank: that is the "saved from one rank only" bug of some
  trainers, which DDP cannot have).
* ``rank-00000.pt`` ... one per rank: that rank's loader ``state_dict`` (the next batch it
  must be served) and its RNG states.

Every file is written as ``name.tmp``, fsynced and renamed; all ranks write into
``step-N.tmp/``; after a barrier rank 0 renames the folder to ``step-N`` and fsyncs the parent.
A crash at any point leaves either the previous complete checkpoint or the new one, never a
torn one; stale ``*.tmp`` folders are ignored and cleaned up by the next save. The newest
``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.files import fsync_dir
from trainer.options import RENAMED
from trainer.train.distributed import DistEnv, barrier

CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """What rank 0's ``model.pt`` holds besides the file header: the one place its keys are
    spelled. ``training`` (optimizer and scheduler state) is absent where only the drafter
    is read (``export``)."""

    step: int
    epoch: int
    drafter: dict[str, torch.Tensor]
    drafter_config: dict[str, Any]
    loss_config: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None

    def to_shared(self) -> dict[str, Any]:
        """The ``shared`` dict ``save_checkpoint`` writes (the step goes in the header)."""
        return {
            "drafter": self.drafter,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "drafter_config": self.drafter_config,
            "loss_config": self.loss_config,
            "meta": self.meta,
            "epoch": self.epoch,
        }

    @classmethod
    def from_shared(cls, shared: Mapping[str, Any], where: Path) -> CheckpointRecord:
        """The record of a loaded ``model.pt`` (``where`` names it in errors); loss configs
        written under the options' older names are read under the new ones."""
        missing = sorted({"step", "drafter", "drafter_config", "loss_config"} - set(shared))
        if missing:
            raise ValueError(f"{where}: not a drafter checkpoint (no {', '.join(missing)})")
        saved_loss: dict[str, Any] = dict(shared["loss_config"])
        loss = {RENAMED.get(k, k): v for k, v in saved_loss.items()}
        return cls(
            step=int(shared["step"]),
            epoch=int(shared.get("epoch", 0)),
            drafter=dict(shared["drafter"]),
            drafter_config=dict(shared["drafter_config"]),
            loss_config=loss,
            meta=dict(shared.get("meta") or {}),
            optimizer=shared.get("optimizer"),
            scheduler=shared.get("scheduler"),
        )


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` via a fsynced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    env: DistEnv,
    *,
    record: CheckpointRecord,
    per_rank: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Collective: every rank calls it with its own ``per_rank``; ``record`` is written by
    rank 0 only. Returns the final folder."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(env)
    head = {"version": CHECKPOINT_VERSION, "step": step, "world_size": env.world_size}
    atomic_save({**head, "rank": env.rank, **per_rank}, tmp / f"rank-{env.rank:05d}.pt")
    if env.is_main:
        atomic_save({**head, **record.to_shared()}, tmp / "model.pt")
    barrier(env)
    if env.is_main:
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        _prune(root, keep)
    barrier(env)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if _NAME.match(p.name))
    for old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(old)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path, env: DistEnv) -> tuple[CheckpointRecord, dict[str, Any]]:
    """``(record, per_rank)`` of this rank, checked for version and world size."""
    shared = _load(path / "model.pt")
    if shared.get("world_size") != env.world_size:
        raise ValueError(
            f"checkpoint {path} was written by {shared.get('world_size')} ranks; this job has "
            f"{env.world_size}: loader positions are per rank, resume with the same world size"
        )
    per_rank = _load(path / f"rank-{env.rank:05d}.pt")
    if per_rank["step"] != shared["step"]:
        raise ValueError(
            f"checkpoint {path}: rank file step {per_rank['step']} != {shared['step']}"
        )
    return CheckpointRecord.from_shared(shared, path / "model.pt"), per_rank


def _load(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {file}")
    # Our own files: RNG states include Python tuples, which weights_only allows.
    state = torch.load(file, map_location="cpu", weights_only=True)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"{file}: checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION}; "
            "it was written by another trainer version"
        )
    return state
