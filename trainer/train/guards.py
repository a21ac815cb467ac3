"""Why a run stops instead of training silently wrong: the errors it ends with (each one
line for the user, a ``TrainingError``), the step counters that decide when (``Stopper``)
and the check that a resumed run has the target it was trained against (``check_target``).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: errnos of a failed write into the run folder (reported as one line, not a traceback)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM)


class TrainingError(ValueError):
    """A run that cannot go on, said in one line (the CLI prints it without a traceback)."""


class DivergedError(TrainingError):
    """Loss or gradients were not finite for ``max_nonfinite_steps`` steps in a row."""


class NoBlocksError(TrainingError):
    """No rank trained a block for ``max_empty_steps`` steps in a row."""


class LoaderFailedError(TrainingError):
    """The loader daemon stayed away past the timeout, refused, or spoke nonsense."""


class TargetMismatchError(TrainingError):
    """``--resume`` of a checkpoint trained against another target."""


class ServedSpecError(TrainingError, RuntimeError):
    """The loader serves batches this run cannot take (another grad_accum, another spec
    than the checkpoint's, different specs on different ranks). A ``RuntimeError`` too, as
    it was before it became one line."""


@dataclass
class Stopper:
    """Counts the steps in a row that diverged or trained nothing, and stops the run when
    there are too many (``max_nonfinite_steps``, ``max_empty_steps``)."""

    max_nonfinite_steps: int  # 0: never stop
    max_empty_steps: int  # 0: never stop
    lr: float  # the peak learning rate, named in the error
    block_size: int
    nonfinite_run: int = 0  # non-finite steps in a row (skipped)
    empty_run: int = 0  # steps in a row in which no rank trained a block

    def check(self, rec: dict[str, Any], step: int, spec: dict[str, Any]) -> None:
        """Stop a run that diverged or trains nothing (every rank decides alike: the record
        is made of all-reduced numbers)."""
        cfg = self
        self.nonfinite_run = self.nonfinite_run + 1 if rec.get("skipped_nonfinite") else 0
        self.empty_run = self.empty_run + 1 if rec["blocks"] == 0 else 0
        if cfg.max_nonfinite_steps and self.nonfinite_run >= cfg.max_nonfinite_steps:
            first = step - self.nonfinite_run + 1
            raise DivergedError(
                f"training diverged: the loss or the gradients were not finite (NaN or inf) "
                f"for {self.nonfinite_run} steps in a row (steps {first}-{step}, peak "
                f"--lr {cfg.lr:g}); those steps were skipped and no checkpoint holds non-finite "
                f"weights: lower --lr (or raise --warmup) and start a new --run-dir "
                f"(--max-nonfinite-steps {cfg.max_nonfinite_steps})"
            )
        if cfg.max_empty_steps and self.empty_run >= cfg.max_empty_steps:
            raise NoBlocksError(
                f"no rank trained a single block for {self.empty_run} steps in a row (up to "
                f"step {step}): {no_blocks_hint(cfg.block_size, spec)} "
                f"(--max-empty-steps {cfg.max_empty_steps})"
            )


def no_blocks_hint(block_size: int, spec: dict[str, Any]) -> str:
    """What a block needs and the spec fields to change when documents give none."""
    b = block_size
    fields = ", ".join(f"{k} {spec[k]}" for k in ("max_seq_len", "token_budget") if k in spec)
    return (
        f"a document needs {2 * b} supervised tokens (2 x --block-size {b}, loss mask 1) for "
        f"a block, and none served has them{f' ({fields})' if fields else ''}: lower "
        "--block-size, raise --max-seq-len (and --token-budget), or check the corpus's loss "
        "mask"
    )


@dataclass
class Tally:
    """What a run has trained, over all its resumes (kept in every checkpoint's meta as
    ``trained``): optimizer steps, supervised blocks, and steps in which no rank trained a
    block. ``blocks`` is None for a run resumed from a checkpoint older than the tally."""

    steps: int = 0
    blocks: int | None = 0
    empty_steps: int = 0

    def add(self, blocks: int) -> None:
        self.steps += 1
        self.empty_steps += blocks == 0
        if self.blocks is not None:
            self.blocks += blocks

    @classmethod
    def from_meta(cls, meta: dict[str, Any], step: int) -> Tally:
        d = meta.get("trained")
        if not isinstance(d, dict):  # a checkpoint from before the tally
            return cls(steps=step, blocks=None)
        return cls(int(d["steps"]), None if d["blocks"] is None else int(d["blocks"]),
                   int(d["empty_steps"]))  # fmt: skip

    def check(self, block_size: int, spec: dict[str, Any]) -> None:
        """At the end of a run: trained nothing is an error; mostly nothing, a warning."""
        if self.steps and self.blocks == 0:
            raise NoBlocksError(
                f"the run trained no block in its {self.steps} step(s): "
                f"{no_blocks_hint(block_size, spec)}; its checkpoints are marked untrained "
                "(export refuses them)"
            )
        if self.steps and self.empty_steps > self.steps / 2:
            log.warning(
                "%d of %d steps (%.0f%%) trained no block: %s", self.empty_steps, self.steps,
                100 * self.empty_steps / self.steps, no_blocks_hint(block_size, spec),
            )  # fmt: skip


def check_target(path: Path, meta: dict[str, Any], mine_meta: dict[str, Any]) -> None:
    """A checkpoint (``meta``) against this run (``mine_meta``): its drafter reads the same
    target layers of the same target shape (same-sized drafter configs can hide different
    ``--layers``) of the same target: its weights' fingerprint (``trainer.run.run_meta``)
    must match; a target that only moved (another path, the same weights) resumes with a
    warning."""
    for key in ("layer_ids", "target_config"):
        saved, mine = meta.get(key), mine_meta.get(key)
        if saved is not None and mine is not None and saved != mine:
            raise ValueError(f"{path}: {key} {saved} differs from this run's {mine}")
    saved_name, mine_name = _target_name(meta, mine_meta), _target_name(mine_meta, meta)
    saved_fp, mine_fp = meta.get("target_weights"), mine_meta.get("target_weights")
    if saved_fp is not None and mine_fp is not None:
        if saved_fp != mine_fp:
            raise TargetMismatchError(
                f"{path} was trained against target {saved_name}, this run's target is "
                f"{mine_name} (other weights: fingerprint {saved_fp} vs {mine_fp}): resume "
                "with the target it was trained against, or start a new --run-dir"
            )
        if meta.get("target") != mine_meta.get("target"):
            log.warning(
                "the checkpoint's target %s is now %s: the same weights, resuming",
                saved_name, mine_name,
            )  # fmt: skip
    elif "target" in meta and "target" in mine_meta and meta["target"] != mine_meta["target"]:
        log.warning(
            "%s was trained against target %s, this run's is %s; the checkpoint predates "
            "target fingerprints, so only their shapes were compared (equal): resuming",
            path, saved_name, mine_name,
        )  # fmt: skip


def _target_name(meta: dict[str, Any], other: dict[str, Any]) -> str:
    """How a run's target is named in messages: ``--target`` and, for tiny targets, the
    ``--tiny-*`` options that differ from ``other``'s."""
    name = str(meta.get("target", "?"))
    mine, theirs = meta.get("target_options") or {}, other.get("target_options") or {}
    diff = [f"--{k.replace('_', '-')} {v}" for k, v in sorted(mine.items()) if theirs.get(k) != v]
    return f"{name} ({', '.join(diff)})" if diff else name
