"""How much the learned target loops (``--corpus text``): the share of distinct n-grams in
each of its held-out replies, beside the same measure over the text's own replies to the
same prompts (the yardstick: what a reply that does not loop looks like).

``looping(cfg, heldout_path)`` gives both as ``{"target": ..., "reference": ...}``, each
``{"n", "mean", "not_looping", "replies"}``: the mean share over the replies that have an
n-gram, and the fraction of them with at least ``NOT_LOOPING`` distinct. ``--data-only``
prints it; ``results.json`` keeps it under ``corpus`` (``heldout_replies_distinct_4grams``,
``heldout_references_distinct_4grams``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.experiment.stats import distinct_ngram_share
from benchmarks.experiment.textdata import reference_replies
from loader_server.data.dataset import open_dataset


def reply_ngram_share(path: Path, n: int = 4) -> dict[str, Any]:
    """How much the target's replies loop: the mean share of distinct ``n``-grams in the
    reply tokens (loss mask 1) of each held-out sample (1.0: no n-gram repeats)."""
    ds = open_dataset(path)
    shares = [
        distinct_ngram_share(ds.input_ids(i)[ds.loss_mask(i).astype(bool)], n)
        for i in range(len(ds))
    ]
    return share_summary(shares, n)


#: A reply with at least this share of distinct n-grams counts as not looping (the text's
#: own replies to the experiment's held-out prompts: 82% of them, none below 0.5).
NOT_LOOPING = 0.8


def share_summary(shares: Sequence[float | None], n: int) -> dict[str, Any]:
    """Mean share over the replies that have an n-gram, and the fraction not looping."""
    got = np.array([x for x in shares if x is not None], dtype=np.float64)
    return {
        "n": n,
        "mean": float(got.mean()) if got.size else None,
        "not_looping": float((got >= NOT_LOOPING).mean()) if got.size else None,
        "replies": int(got.size),
    }


def reference_ngram_share(cfg: Any, n: int = 4) -> dict[str, Any]:
    """``reply_ngram_share``'s yardstick: the same measure over the text's own replies to
    the held-out prompts (``textdata.reference_replies``), tokenized by the target's
    tokenizer and cut at the replies' token limit, as the target's replies are."""
    from transformers import AutoTokenizer

    with open(cfg.data_dir / "prompts-heldout.jsonl") as f:
        rows = [json.loads(line) for line in f]
    tok = AutoTokenizer.from_pretrained(cfg.target_dir())
    shares = [
        distinct_ngram_share(np.asarray(tok(text)["input_ids"][: cfg.text.max_tokens]), n)
        for text in reference_replies(cfg.target, rows)
    ]
    return share_summary(shares, n)


def looping(cfg: Any, heldout_path: Path) -> dict[str, Any]:
    """How much the target loops on the held-out prompts, and the text's own replies."""
    return {"target": reply_ngram_share(heldout_path), "reference": reference_ngram_share(cfg)}
