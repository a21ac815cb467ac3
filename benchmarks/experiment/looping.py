"""How much the learned target loops (``--corpus text``): the share of distinct n-grams in
each of its held-out replies, beside the same measure over the text's own replies to the
same prompts (the yardstick: what a reply that does not loop looks like), overall and per
kind of prompt (short function tasks, long continuations).

``looping(cfg, heldout_path)`` gives ``{"target": ..., "reference": ..., "by_kind": {kind:
{"target": ..., "reference": ...}}}``, each a ``share_summary``: ``{"n", "mean",
"not_looping", "replies"}`` (the mean share over the replies that have an n-gram, and the
fraction of them with at least ``NOT_LOOPING`` distinct); the target's also ``samples``
(its replies, those under n tokens too) and ``at_limit``, the fraction of them that reached
the regeneration's token limit (a reply that loops rarely ends). ``--data-only`` prints
it; ``results.json`` keeps it under ``corpus`` (``heldout_replies_distinct_4grams``,
``heldout_references_distinct_4grams``, ``heldout_looping_by_kind``).
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
from trainer.data.regen import split_prompt

#: A reply with at least this share of distinct n-grams counts as not looping (the text's
#: own replies to the experiment's held-out prompts: 82% of them, none below 0.5).
NOT_LOOPING = 0.8
#: The n of the n-grams.
N = 4


def share_summary(shares: Sequence[float | None], n: int = N) -> dict[str, Any]:
    """Mean share over the replies that have an n-gram, and the fraction not looping."""
    got = np.array([x for x in shares if x is not None], dtype=np.float64)
    return {
        "n": n,
        "mean": float(got.mean()) if got.size else None,
        "not_looping": float((got >= NOT_LOOPING).mean()) if got.size else None,
        "replies": int(got.size),
    }


def summarize(
    target: Sequence[float | None],
    target_kinds: Sequence[str],
    at_limit: Sequence[bool],
    reference: Sequence[float | None],
    reference_kinds: Sequence[str],
) -> dict[str, Any]:
    """``looping``'s answer from per-reply shares (None: under n tokens), kinds and whether
    each of the target's replies reached the token limit. Pure."""
    if not len(target) == len(target_kinds) == len(at_limit):
        raise ValueError("target shares, kinds and limits differ in length")
    if len(reference) != len(reference_kinds):
        raise ValueError("reference shares and kinds differ in length")

    def of_target(keep: np.ndarray) -> dict[str, Any]:
        hit = np.asarray(at_limit, dtype=bool)[keep]
        out = share_summary([s for s, k in zip(target, keep, strict=True) if k])
        return {
            **out,
            "samples": int(hit.size),
            "at_limit": float(hit.mean()) if hit.size else None,
        }

    def of_reference(kind: str | None) -> dict[str, Any]:
        pairs = zip(reference, reference_kinds, strict=True)
        return share_summary([s for s, k in pairs if kind is None or k == kind])

    kinds = np.asarray(target_kinds, dtype=object)
    return {
        "target": of_target(np.ones(len(kinds), dtype=bool)),
        "reference": of_reference(None),
        "by_kind": {
            kind: {"target": of_target(kinds == kind), "reference": of_reference(kind)}
            for kind in sorted(set(target_kinds) | set(reference_kinds))
        },
    }


def sample_rows(ds: Any, tok: Any, rows: list[dict[str, Any]], where: Path) -> list[int]:
    """The prompt row each sample of the held-out corpus ``ds`` answers: its prompt (the
    tokens before the reply), decoded, is the row's messages rendered by the target's chat
    template (regeneration may drop rows, so position alone does not say). Raises naming
    the sample whose prompt is no row's."""
    rendered = {
        tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False): i
        for i, r in enumerate(rows)
    }
    out = []
    for i in range(len(ds)):
        ids = np.asarray(ds.input_ids(i))
        prompt = tok.decode(
            ids[: split_prompt(ds.loss_mask(i))], clean_up_tokenization_spaces=False
        )
        if prompt not in rendered:
            raise ValueError(
                f"{where}: sample {i}'s prompt ({prompt[:60]!r}...) is no prompt row's"
            )
        out.append(rendered[prompt])
    return out


def looping(cfg: Any, heldout_path: Path) -> dict[str, Any]:
    """How much the target loops on the held-out prompts (its replies: the reply tokens,
    loss mask 1, of each held-out sample), and the text's own replies to the same prompts
    (``textdata.reference_replies``, tokenized by the target's tokenizer and cut at the
    replies' token limit, as the target's are)."""
    from transformers import AutoTokenizer

    with open(cfg.data_dir / "prompts-heldout.jsonl") as f:
        rows = [json.loads(line) for line in f]
    tok = AutoTokenizer.from_pretrained(cfg.target_dir())
    limit = cfg.text.max_tokens
    own = reference_replies(cfg.target, rows)
    reference = [
        distinct_ngram_share(np.asarray(tok(text)["input_ids"][:limit]), N) for _, text in own
    ]
    ds = open_dataset(heldout_path)
    replies = [np.asarray(ds.input_ids(i))[ds.loss_mask(i).astype(bool)] for i in range(len(ds))]
    kinds = [own[r][0] for r in sample_rows(ds, tok, rows, heldout_path)]
    # a reply cut at the limit has ``limit`` tokens and the end of turn the template adds
    at_limit = [r.size > limit for r in replies]
    target = [distinct_ngram_share(r, N) for r in replies]
    return summarize(target, kinds, at_limit, reference, [k for k, _ in own])
