"""What one micro-batch costs the trainer: the model the planner cuts and balances by.

In data-parallel training every optimizer step waits for its slowest rank, so the plan
should balance *time*, not tokens. A DFlash micro-batch's time is modelled as

    cost = c0 + c_tok * tokens + c_attn * sq + c_slot * slots + c_doc * documents

over features the planner knows from sample lengths alone (``features``):

* ``tokens``: tokens as laid out: ``rows * L`` for a padded micro-batch (padding costs
  the linear layers as much as real tokens), the row's ``T`` for a packed one;
* ``sq``: attention work, the pairs of positions attention computes: ``rows * L**2``
  padded (each row attends over its padded length); packed, ``sum(l_i**2)`` under a
  kernel that stays inside each document (``packed_attention="documents"``: the
  trainer's flex attention, and its SDPA, which runs a forward per document) or ``T**2``
  under a dense mask over the row (``"row"``: what the trainer's SDPA did before, where a
  packed row of 4,096 tokens cost several times its documents padded);
* ``slots``: block slots through the drafter and the frozen LM head (the vocabulary
  projection, the largest single cost at a 151,936-token vocabulary): ``block_size`` times
  the sum of per-document anchors (``doc_anchors``), where a document of length ``l`` gets
  ``min(anchors_per_doc, ceil((l - block_size + 1) / tokens_per_anchor))`` anchors when
  ``l >= 2 * block_size`` and none otherwise, the sum capped at ``max_anchors`` per
  micro-batch only under the trainer's old per-micro-batch draw (``max_anchors`` 0: no
  cap, the default). That is the trainer's anchor rule (``trainer.model.blocks``) with
  every position supervised: the loader sees lengths, not loss masks, and calibration
  (``dflash-train calibrate``, which fits on these same features) absorbs the corpus's
  supervised fraction into ``c_slot``;
* ``documents``: the documents of a packed row, the rows of a padded micro-batch. Under
  SDPA the trainer runs the target once per packed document (``Target._per_document``),
  so each document carries a forward's fixed cost (measured on this CPU at a hidden-64
  target: about 6 ms a document, ``docs/PLANNER.md``); a padded
  micro-batch's rows run in one forward, where the term is near 0 and the fit says so.
  Where every document draws one anchor it equals ``slots / block_size`` and a fit cannot
  tell the two apart (either carries it);
* ``c0``: the fixed cost of a micro-batch (kernel launches, its share of the optimizer
  step and of communication).

The coefficients live in the batch spec (``loader_server.wire.spec``: ``cost_c0``,
``cost_tok``, ``cost_attn``, ``cost_slot``, ``cost_doc``, with the anchor rule ``block_size``,
``anchors_per_doc``, ``tokens_per_anchor``, ``max_anchors``);
the defaults (``c_tok = 1``, the rest 0) make the cost the token count, which is exactly
the planner without a cost model. A *cost profile* (JSON, written by ``dflash-train
calibrate``) carries fitted coefficients and the anchor rule they were fitted under;
``loader_server.wire.spec.profile_fields`` turns one into spec fields.

This module is pure numpy and imports nothing from the service, so the daemon, the CLI
and the trainer's calibration all compute features the same way.
"""

from __future__ import annotations

import numpy as np

from loader_server.wire import layouts
from loader_server.wire.spec import COEFFICIENTS, AnchorRule, Coefficients

#: Feature columns of ``features`` (what each coefficient of ``COEFFICIENTS`` multiplies).
FEATURES = ("one", "tokens", "sq", "slots", "documents")
assert len(FEATURES) == len(COEFFICIENTS)


def doc_anchors(rule: AnchorRule, lengths: np.ndarray) -> np.ndarray:
    """Anchors drawn from documents of these lengths, supervised everywhere (int64,
    vectorized ``AnchorRule.anchors``)."""
    x = np.asarray(lengths, dtype=np.int64)
    cands = np.maximum(x - rule.block_size + 1, 0)
    n = np.minimum(rule.anchors_per_doc, -(-cands // rule.tokens_per_anchor))
    return np.where(x >= 2 * rule.block_size, n, 0)


def slots(rule: AnchorRule, anchor_sums: np.ndarray) -> np.ndarray:
    """Block slots of micro-batches whose documents draw ``anchor_sums`` anchors in all
    (the cap applied)."""
    a = np.asarray(anchor_sums, dtype=np.int64)
    if rule.max_anchors > 0:
        a = np.minimum(a, rule.max_anchors)
    return a * rule.block_size


def features(
    doc_lengths: np.ndarray,
    starts: np.ndarray,
    *,
    layout: str,
    rule: AnchorRule,
    packed_attention: str = "documents",
) -> np.ndarray:
    """[micro-batches, 5] float64 features (``FEATURES``) of micro-batches laid out as
    consecutive runs of ``doc_lengths`` beginning at ``starts`` (non-empty runs), packed
    rows' attention counted as ``packed_attention`` says."""
    x = np.asarray(doc_lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    out = np.empty((starts.size, len(FEATURES)), np.float64)
    if starts.size == 0:
        return out
    anchors = np.add.reduceat(doc_anchors(rule, x), starts)
    docs = np.diff(np.append(starts, x.size))
    if layouts.layout(layout).packs:
        tokens = np.add.reduceat(x, starts)
        sq = tokens * tokens if packed_attention == "row" else np.add.reduceat(x * x, starts)
        terms = (tokens, sq, slots(rule, anchors), docs)
    else:
        terms = padded_terms(docs, np.maximum.reduceat(x, starts), anchors, rule)
    out[:, 0] = 1.0
    out[:, 1:] = np.stack(terms, 1)
    return out


def padded_terms(
    rows: np.ndarray, longest: np.ndarray, anchors: np.ndarray, rule: AnchorRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, sq, slots, documents) of padded micro-batches of ``rows`` rows ``longest``
    wide whose documents draw ``anchors`` anchors, elementwise: the one statement of the
    padded features (float64, exact below 2^53)."""
    tokens = rows * np.asarray(longest).astype(np.float64)
    return tokens, tokens * longest, slots(rule, anchors), np.asarray(rows, np.float64)


def modelled(
    coefficients: Coefficients,
    tokens: np.ndarray,
    sq: np.ndarray,
    slots: np.ndarray,
    documents: np.ndarray,
) -> np.ndarray:
    """The cost model itself: ``c0 + c_tok*tokens + c_attn*sq + c_slot*slots +
    c_doc*documents``."""
    c0, tok, attn, slot, doc = coefficients
    return c0 + tok * tokens + attn * sq + slot * slots + doc * documents


def uniform_features(lengths: np.ndarray, rows: np.ndarray, *, rule: AnchorRule) -> np.ndarray:
    """Features of micro-batches of ``rows[i]`` documents all of length ``lengths[i]``
    (padded and packed alike: no padding)."""
    x = np.asarray(lengths, dtype=np.int64)
    n = np.asarray(rows, dtype=np.int64)
    out = np.empty((x.size, len(FEATURES)), np.float64)
    out[:, 0] = 1.0
    out[:, 1:] = np.stack(padded_terms(n, x, n * doc_anchors(rule, x), rule), 1)
    return out
