"""The daemon's ``stats``: what the CLI, the ``stats`` reply and the Prometheus exporter show.

Also called from the exporter's thread: it only reads counters and copies the session
list, so it needs no lock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from loader_server.data.dataset import ArrowDataset
from loader_server.service.session import Session

# The shortest age a rate is divided by: a session opened this instant has served nothing.
_MIN_AGE_S = 1e-9


def session_stats(s: Session, now: float) -> dict[str, Any]:
    """One session's entry (``now``: ``time.monotonic()``)."""
    age = max(now - s.stats.started, _MIN_AGE_S)
    return {
        "session": s.sid,
        "job": s.job,
        "rank": s.rank,
        "world_size": s.spec.world_size,
        "pos": list(s.pos),
        "legs": [list(leg) for leg in s.legs],  # shape changes of pos's epoch (elastic)
        "ring_fill": s.produced - s.consumed,
        "slots": s.ring.num_slots,
        "batches": s.stats.batches,
        "tokens": s.stats.tokens,
        "tokens_per_s": s.stats.tokens / age,
        "client_wait_s": s.ring.client_wait_s(),
        "age_s": age,
        "opened_at": s.opened_at,  # Unix time
    }


def daemon_stats(
    *,
    instance: str,
    started: float,
    dataset: ArrowDataset,
    corpus_error: str | None,
    errors: int,
    sessions: Iterable[Session],
) -> dict[str, Any]:
    """The whole reply; ``started``: the daemon's start, by ``time.monotonic()``."""
    now = time.monotonic()
    return {
        "instance": instance,
        "pid": os.getpid(),
        "uptime_s": now - started,
        "dataset": str(dataset.path),
        "corpus_error": corpus_error,
        "fingerprint": dataset.fingerprint,
        "samples": dataset.num_samples,
        "errors": errors,
        "sessions": [session_stats(s, now) for s in sessions],
    }
