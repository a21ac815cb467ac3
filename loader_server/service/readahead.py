"""Read-ahead along the plan: map the pages of upcoming micro-batches before they are filled.

The plan says exactly which samples a session needs next, so the daemon need not discover
them one page fault at a time while it copies. After filling a session's micro-batch, the
server hands the samples of the one ``DEPTH`` micro-batches further on to this thread,
which maps their pages (``ArrowDataset.populate``: ``madvise(MADV_POPULATE_READ)`` per
sample, GIL released) while the server thread keeps copying. It matters while the corpus is
new to the daemon: on the 902K corpus a first-touch row costs 15-60 us in page faults, a
populated one 5 us to copy. Samples are populated once per daemon; afterwards ``submit``
costs one vectorized check. A hint only: errors are logged, never fatal.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np

from loader_server.data.dataset import ArrowDataset

log = logging.getLogger(__name__)

# How many micro-batches ahead of a session's fill position its pages are requested.
DEPTH = 8
# Requests queued beyond this are dropped (the fill then faults the pages itself).
_MAX_QUEUED = 256
# At close, how long the thread may take to finish the request it is on (a hint: a slower
# one is left behind, a daemon thread, rather than holding up a reload or shutdown).
_JOIN_TIMEOUT_S = 5.0


class Readahead:
    """One thread that populates pages for the server thread; the server owns it."""

    def __init__(self, dataset: ArrowDataset) -> None:
        self._dataset = dataset
        # Samples a plan can serve (empty ones never are); written by the thread.
        self._unpopulated = int(np.count_nonzero(dataset.lengths))
        self._queue: queue.SimpleQueue[tuple[np.ndarray, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="readahead", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """False once every sample has been populated: nothing left to read ahead."""
        return self._unpopulated > 0

    def submit(self, sample_ids: np.ndarray, max_len: int) -> None:
        """Ask for these samples' pages (a no-op once they have all been populated)."""
        if self._queue.qsize() < _MAX_QUEUED and self._dataset.needs_populate(sample_ids):
            self._queue.put((sample_ids, max_len))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._unpopulated -= self._dataset.populate(*item)
            except Exception:  # a hint: the fill faults the pages in itself
                log.exception("read-ahead failed")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
