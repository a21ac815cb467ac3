"""What one micro-batch costs the trainer: the model the planner cuts and balances by.

In data-parallel training every optimizer step waits for its slowest rank, so the plan
should balance *time*, not tokens. A DFlash micro-batch's time is modelled as

    cost = c0 + c_tok * tokens + c_attn * sq + c_slot * slots

over features the planner knows from sample lengths alone (``features``):

* ``tokens``: tokens as laid out: ``rows * L`` for a padded micro-batch (padding costs
  the linear layers as much as real tokens), the row's ``T`` for a packed one;
* ``sq``: attention work, the sum over documents of length squared as laid out:
  ``rows * L**2`` padded (each row attends over its padded length), ``sum(l_i**2)``
  packed (varlen attention stays inside each document);
* ``slots``: block slots through the drafter and the frozen LM head (the vocabulary
  projection, the largest single cost at a 151,936-token vocabulary): ``block_size`` times
  the sum of per-document anchors (``AnchorRule``), where a document of length ``l`` gets
  ``min(anchors_per_doc, ceil((l - block_size + 1) / tokens_per_anchor))`` anchors when
  ``l >= 2 * block_size`` and none otherwise, the sum capped at ``max_anchors`` per
  micro-batch only under the trainer's old per-micro-batch draw (``max_anchors`` 0: no
  cap, the default). That is the trainer's anchor rule (``trainer.model.blocks``) with
  every position supervised: the loader sees lengths, not loss masks, and calibration
  (``dflash-train calibrate``, which fits on these same features) absorbs the corpus's
  supervised fraction into ``c_slot``;
* ``c0``: the fixed cost of a micro-batch (kernel launches, its share of the optimizer
  step and of communication).

The coefficients live in the batch spec (``cost_c0``, ``cost_tok``, ``cost_attn``,
``cost_slot``, with the anchor rule ``block_size``, ``anchors_per_doc``,
``tokens_per_anchor``, ``max_anchors``);
the defaults (``c_tok = 1``, the rest 0) make the cost the token count, which is exactly
the planner without a cost model. A *cost profile* (JSON, written by ``dflash-train
calibrate``) carries fitted coefficients and the anchor rule they were fitted under;
``profile_fields`` turns one into spec fields.

This module is pure numpy and imports nothing from the service, so the daemon, the CLI
and the trainer's calibration all compute features the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

#: Spec fields of the coefficients, in the order of the feature columns.
COEFFICIENTS = ("cost_c0", "cost_tok", "cost_attn", "cost_slot")
#: Feature columns of ``features`` (what each coefficient multiplies).
FEATURES = ("one", "tokens", "sq", "slots")
PROFILE_VERSION = 1


class AnchorRule(NamedTuple):
    """How many anchors (blocks) the trainer draws: per document
    ``min(anchors_per_doc, ceil(candidates / tokens_per_anchor))``, where a document's
    candidates are its supervised positions with room for a block (``l - block_size + 1``
    for a document supervised everywhere) and a document needs ``2 * block_size``
    supervised tokens to draw any; per micro-batch at most ``max_anchors`` (0: no cap; only
    the trainer's old per-micro-batch draw caps, ``trainer.model.blocks``)."""

    block_size: int = 16
    anchors_per_doc: int = 512
    tokens_per_anchor: int = 32
    max_anchors: int = 0

    @classmethod
    def of(cls, values: Sequence[int]) -> AnchorRule:
        """A rule from its values in field order; the three of records written before
        ``tokens_per_anchor`` existed (block, per document, cap) mean one per token."""
        v = [int(x) for x in values]
        if len(v) == 3:
            return cls(v[0], v[1], 1, v[2])
        if len(v) != len(cls._fields):
            raise ValueError(f"an anchor rule has {len(cls._fields)} values, got {list(values)}")
        return cls(*v)

    def doc_anchors(self, lengths: np.ndarray) -> np.ndarray:
        """Anchors drawn from documents of these lengths, supervised everywhere (int64,
        vectorized)."""
        x = np.asarray(lengths, dtype=np.int64)
        cands = np.maximum(x - self.block_size + 1, 0)
        n = np.minimum(self.anchors_per_doc, -(-cands // self.tokens_per_anchor))
        return np.where(x >= 2 * self.block_size, n, 0)

    def slots(self, anchor_sums: np.ndarray) -> np.ndarray:
        """Block slots of micro-batches whose documents draw ``anchor_sums`` anchors in
        all (the cap applied)."""
        a = np.asarray(anchor_sums, dtype=np.int64)
        if self.max_anchors > 0:
            a = np.minimum(a, self.max_anchors)
        return a * self.block_size


#: Spec fields of the trainer's anchor rule, which ``slots`` follows.
ANCHOR_RULE = AnchorRule._fields


def features(
    doc_lengths: np.ndarray, starts: np.ndarray, *, layout: str, rule: AnchorRule
) -> np.ndarray:
    """[micro-batches, 4] float64 features (``FEATURES``) of micro-batches laid out as
    consecutive runs of ``doc_lengths`` beginning at ``starts`` (non-empty runs)."""
    x = np.asarray(doc_lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    out = np.empty((starts.size, len(FEATURES)), np.float64)
    if starts.size == 0:
        return out
    anchors = np.add.reduceat(rule.doc_anchors(x), starts)
    if layout == "packed":
        tokens = np.add.reduceat(x, starts)
        sq = np.add.reduceat(x * x, starts)
        slots = rule.slots(anchors)
    else:
        rows = np.diff(np.append(starts, x.size))
        tokens, sq, slots = padded_terms(rows, np.maximum.reduceat(x, starts), anchors, rule)
    out[:, 0] = 1.0
    out[:, 1] = tokens
    out[:, 2] = sq
    out[:, 3] = slots
    return out


def padded_terms(
    rows: np.ndarray, longest: np.ndarray, anchors: np.ndarray, rule: AnchorRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, sq, slots) of padded micro-batches of ``rows`` rows ``longest`` wide whose
    documents draw ``anchors`` anchors, elementwise: the one statement of the padded
    features (float64, exact below 2^53)."""
    tokens = rows * np.asarray(longest).astype(np.float64)
    return tokens, tokens * longest, rule.slots(anchors)


def modelled(
    coefficients: tuple[float, float, float, float],
    tokens: np.ndarray,
    sq: np.ndarray,
    slots: np.ndarray,
) -> np.ndarray:
    """The cost model itself: ``c0 + c_tok*tokens + c_attn*sq + c_slot*slots``."""
    c0, tok, attn, slot = coefficients
    return c0 + tok * tokens + attn * sq + slot * slots


def uniform_features(lengths: np.ndarray, rows: np.ndarray, *, rule: AnchorRule) -> np.ndarray:
    """Features of micro-batches of ``rows[i]`` documents all of length ``lengths[i]``
    (padded and packed alike: no padding)."""
    x = np.asarray(lengths, dtype=np.int64)
    n = np.asarray(rows, dtype=np.int64)
    out = np.empty((x.size, len(FEATURES)), np.float64)
    out[:, 0] = 1.0
    out[:, 1:] = np.stack(padded_terms(n, x, n * rule.doc_anchors(x), rule), 1)
    return out


def check_coefficients(values: dict[str, Any], where: str) -> None:
    """ValueError naming ``where`` and the field unless every coefficient is a finite
    number >= 0 and at least one is positive."""
    for name in COEFFICIENTS:
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {v!r}")
    if not any(values[name] > 0 for name in COEFFICIENTS):
        raise ValueError(f"{where}: every cost coefficient is 0 (at least one must be positive)")


def profile_text(
    coefficients: dict[str, float], rule: dict[str, int], *, where: str, **info: Any
) -> str:
    """A cost profile's JSON (``info``: fit report, source run, units...); ``where`` names
    it in errors. Writing it is the caller's (the trainer writes through ``trainer.files``)."""
    check_coefficients(coefficients, where)
    doc = {"version": PROFILE_VERSION, "coefficients": coefficients, "anchor_rule": rule, **info}
    return json.dumps(doc, indent=2) + "\n"


def write_profile(
    path: Path, coefficients: dict[str, float], rule: dict[str, int], **info: Any
) -> None:
    """Write a cost profile to ``path`` (tests and tools; the trainer uses ``profile_text``)."""
    Path(path).write_text(profile_text(coefficients, rule, where=str(path), **info))


def profile_fields(path: str | Path) -> dict[str, Any]:
    """The spec fields a cost profile sets: its four coefficients and its anchor rule.

    Every problem is a ValueError that names the file and the key: unreadable or not
    JSON, another version, a missing or negative coefficient, a missing anchor-rule field.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"cost profile {p}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cost profile {p}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"cost profile {p}: version must be {PROFILE_VERSION}, got {got!r}")
    coef, rule = doc.get("coefficients"), doc.get("anchor_rule")
    if not isinstance(coef, dict) or not isinstance(rule, dict):
        raise ValueError(f"cost profile {p}: needs 'coefficients' and 'anchor_rule' objects")
    fields: dict[str, Any] = {}
    for name in COEFFICIENTS:
        if name not in coef:
            raise ValueError(f"cost profile {p}: coefficient {name!r} is missing")
        fields[name] = coef[name]
    check_coefficients(fields, f"cost profile {p}")
    if "tokens_per_anchor" not in rule:  # a profile from before the field: one per token
        rule = {**rule, "tokens_per_anchor": 1}
    for name in ANCHOR_RULE:
        v = rule.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                f"cost profile {p}: anchor_rule.{name} must be an integer >= 0, got {v!r}"
            )
        fields[name] = v
    return fields
