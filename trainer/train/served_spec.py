"""The batch spec the loader actually serves, adopted by the run, and the checks that keep
every rank and a resumed checkpoint in one plan.

The daemon's configured spec supplies every field the trainer did not set, so the run
learns its ``grad_accum`` (and the rest) from the first batch's session. Then:

* every rank must be served one spec and start at one place of the plan (one daemon per
  node: their configs could differ, and ranks with different ``grad_accum`` would hang in
  the all-reduce; ranks resumed from different checkpoints would train different plans);
* a resumed run must be served the checkpoint's spec, except its shape (``SHAPE``): a run
  resumes on another world size or ``grad_accum`` (the loader plans the rest of the epoch
  for it, ``loader_server.planning.elastic``), never in another plan;
* a loader whose cost model counts another anchor rule than this trainer draws is warned
  about (its plans balance a cost the trainer does not pay).

The adopted spec goes into the checkpoints' meta and ``RUN_DIR/loader_spec.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.model.blocks import LossConfig
from trainer.train.batches import Batch
from trainer.train.distributed import DistEnv, all_reduce
from trainer.train.guards import ServedSpecError

log = logging.getLogger(__name__)

#: The spec fields of a job's shape: a checkpoint resumes under another (the rest of the
#: epoch is planned for it, ``loader_server.planning.elastic``).
SHAPE = ("world_size", "grad_accum")


def served_grad_accum(spec: dict[str, Any], asked: int | None) -> int:
    """The ``grad_accum`` the loader serves; one the trainer was told must be it."""
    served = int(spec.get("grad_accum", asked or 1))
    if asked is not None and served != asked:
        raise ServedSpecError(
            f"the loader serves grad_accum {served}, the trainer was told {asked}"
        )
    return served


def start_place(first: Batch | None, legs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Where a rank starts in the plan: its first batch's position and the epoch's shape
    changes (``legs``)."""
    return {
        "epoch": None if first is None else int(first.epoch),
        "step": None if first is None else int(first.step),
        "leg": None if first is None else int(first.leg),
        "legs": [list(x) for x in legs],
    }


def check_ranks_agree(spec: dict[str, Any], where: dict[str, Any], env: DistEnv) -> None:
    """Every rank was served ``spec`` and starts at ``where`` (two digests, one all-reduce
    of their maxima and negated minima)."""
    if not env.distributed:
        return
    keys = [_digest(spec), _digest(where)]
    t = torch.tensor([*keys, *(-k for k in keys)], dtype=torch.float64, device=env.device)
    hi_spec, hi_where, neg_lo_spec, neg_lo_where = all_reduce(t, env, op="max").tolist()
    if hi_spec != -neg_lo_spec:
        raise ServedSpecError(
            f"ranks were served different batch specs (rank {env.rank}: "
            f"{json.dumps(spec, sort_keys=True)}); give every node's daemon the same [spec]"
        )
    if hi_where != -neg_lo_where:
        raise ServedSpecError(
            f"ranks start at different places of the plan (rank {env.rank}: "
            f"{json.dumps(where)}): they resumed from different checkpoints or loader "
            "states; every rank must resume from the same checkpoint"
        )


#: Spec fields newer than some checkpoints, with the value those checkpoints were served.
SPEC_ADDED_LATER = {"tokens_per_anchor": 1, "packed_attention": "documents"}


def check_checkpoint_spec(spec: dict[str, Any], saved: dict[str, Any] | None) -> None:
    """A resumed run is served the spec its checkpoint was (``SHAPE`` aside)."""
    if saved is None:
        return
    saved = {**{k: v for k, v in SPEC_ADDED_LATER.items() if k in spec}, **saved}
    diff = {
        k: (saved.get(k), spec.get(k))
        for k in sorted(set(spec) | set(saved))
        if k not in SHAPE and saved.get(k) != spec.get(k)
    }
    if diff:
        raise ServedSpecError(
            f"the loader now serves another batch spec than the checkpoint was trained on "
            f"(field: (checkpoint, served)): {diff}; resuming would replay the saved position "
            "in a different plan. Set those fields on the trainer (--spec KEY=VALUE) or "
            "restore the daemon's [spec]"
        )


def warn_other_anchor_rule(spec: dict[str, Any], loss: LossConfig, env: DistEnv) -> None:
    """Warn (rank 0) when the loader's slot cost counts another anchor rule than ``loss``."""
    rule = loss.anchor_rule._asdict()
    planned = {k: spec.get(k, v) for k, v in rule.items()}
    if spec.get("cost_slot") and planned != rule and env.is_main:
        log.warning(
            "the loader's cost model counts block slots with anchor rule %s, this trainer "
            "draws %s: its plans balance a cost this trainer does not pay (pass "
            "--spec KEY=VALUE or calibrate with this trainer's settings)", planned, rule
        )  # fmt: skip


def record_spec(spec: dict[str, Any], run_dir: Path, env: DistEnv) -> None:
    """Log the adopted spec and write ``RUN_DIR/loader_spec.json`` (rank 0)."""
    log.info("rank %d: loader spec %s", env.rank, json.dumps(spec, sort_keys=True))
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "loader_spec.json"
        path.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def _digest(obj: Any) -> float:
    """48 bits of a JSON value's hash, exact in float64 (all-reduced to compare ranks)."""
    digest = hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=6)
    return float(int.from_bytes(digest.digest(), "little"))
