"""Whether a corpus can be served at all under a spec: the check a daemon makes before it
reports READY (and before a SIGHUP swaps a new corpus in), so a corpus no client could
train on is one line at start, not a failure in every client.

A corpus is unservable when every sample is empty, when every non-empty one is longer than
``max_seq_len`` and the spec drops overlong samples, or when what is left cannot fill one
step of the spec's smallest shape (one rank, the spec's ``grad_accum``): a larger job
needs more. Pure: lengths and a spec in, a reason (or None) out. Planning is needed only
for small corpora (a padded micro-batch holds at most ``max_batch_size`` rows, a packed
one at most ``token_budget`` tokens, so a corpus past those counts fills a step).
"""

from __future__ import annotations

import numpy as np

from loader_server.planning.elastic import shaped
from loader_server.planning.planner import effective_lengths, plan_epoch
from loader_server.wire.layouts import layout
from loader_server.wire.spec import BatchSpec


def why_unservable(lengths: np.ndarray, spec: BatchSpec) -> str | None:
    """Why no step of ``spec``'s smallest shape can be filled from ``lengths``; None when
    one can."""
    raw = np.asarray(lengths)
    if raw.size == 0:
        return "the corpus has no samples"
    nonempty = int((raw > 0).sum())
    if nonempty == 0:
        return f"all {raw.size:,} samples are empty (0 tokens)"
    _, ok = effective_lengths(raw, spec)
    servable = int(ok.sum())
    if servable == 0:
        return (
            f"all {nonempty:,} non-empty samples are longer than max_seq_len "
            f"{spec.max_seq_len} and overlong = drop: raise max_seq_len or set overlong = "
            "truncate"
        )
    smallest = shaped(spec, 1, spec.grad_accum)
    if _surely_fills(raw[ok], smallest):
        return None
    plan = plan_epoch(raw, smallest, epoch=0)
    if plan.num_steps > 0:
        return None
    micro = plan.stats["num_micro"] + plan.stats["dropped_leftover_micro"]
    return (
        f"its {servable:,} servable samples make {micro} micro-batch(es) under this spec, "
        f"fewer than one step of grad_accum {spec.grad_accum} on one rank: lower grad_accum "
        "or token_budget, or serve a larger corpus"
    )


def _surely_fills(servable: np.ndarray, spec: BatchSpec) -> bool:
    """Enough samples (padded) or tokens (packed) that the plan has a step, unplanned: a
    micro-batch holds at most ``max_batch_size`` rows or ``token_budget`` tokens, so there
    are more than ``grad_accum`` of them."""
    if layout(spec.layout).packs:
        tokens = int(np.minimum(servable, spec.max_seq_len).sum(dtype=np.int64))
        return tokens > spec.grad_accum * spec.token_budget
    return servable.size > spec.grad_accum * spec.max_batch_size
