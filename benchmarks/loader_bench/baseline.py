"""Baselines the service is measured against.

* ``DataLoader``: ``torch.utils.data.DataLoader(num_workers=2)`` over the *same* batch plan,
  each worker reading its rows through pyarrow (memory-mapped tables, ``take``) and
  pad-collating into tensors, which the DataLoader ships to the main process through its
  shared-memory queues. This is the usual way a trainer reads a tokenized Arrow corpus.
* ``sort-once``: the original pipeline. The trainer loads every sample into its own memory
  at start (here: the token columns copied out of Arrow into numpy, the cheapest form of
  that), sorts by length once, packs greedily and only shuffles batch order per epoch.
  Its restart cost is that load, and its RSS the whole corpus.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.loader_bench.consumer import touch
from loader_server.data.dataset import IDS_COLUMN, MASK_COLUMN, _shard_files


def read_batches(path: Path) -> list[pa.RecordBatch]:
    """Every record batch of every shard, memory-mapped (no copy)."""
    out: list[pa.RecordBatch] = []
    for f in _shard_files(Path(path)):
        source = pa.memory_map(str(f), "r")
        head = source.read(6)
        source.seek(0)
        reader = pa.ipc.open_file(source) if head == b"ARROW1" else pa.ipc.open_stream(source)
        out.extend(reader.read_all().to_batches())
    return out


class PlanBatches(Dataset):
    """Item k = the k-th micro-batch of a fixed list, read with pyarrow and pad-collated.

    Rows are gathered with ``take`` per record batch (a ``take`` across a whole chunked
    table would concatenate the corpus first).
    """

    def __init__(self, path: Path, batches: list[np.ndarray], max_len: int) -> None:
        self.path = path
        self.batches = batches
        self.max_len = max_len
        self._record_batches: list[pa.RecordBatch] | None = None
        self._starts = np.zeros(1, np.int64)

    def __len__(self) -> int:
        return len(self.batches)

    def _open(self) -> list[pa.RecordBatch]:
        if self._record_batches is None:  # opened lazily, once per worker process
            self._record_batches = read_batches(self.path)
            self._starts = np.cumsum([0] + [b.num_rows for b in self._record_batches])
        return self._record_batches

    def __getitem__(self, k: int) -> dict[str, Any]:
        record_batches = self._open()
        ids = np.asarray(self.batches[k])
        which = np.searchsorted(self._starts, ids, side="right") - 1
        rows_ids: list[np.ndarray] = [np.zeros(0, np.int32)] * len(ids)
        rows_mask: list[np.ndarray | None] = [None] * len(ids)
        for b in np.unique(which).tolist():
            pick = np.flatnonzero(which == b)
            rb = record_batches[b].take(pa.array(ids[pick] - self._starts[b]))
            offsets = rb.column(IDS_COLUMN).offsets.to_numpy()
            values = rb.column(IDS_COLUMN).values.to_numpy()
            mvalues = (
                rb.column(MASK_COLUMN).values.to_numpy(zero_copy_only=False)
                if MASK_COLUMN in rb.schema.names
                else None
            )
            for j, r in enumerate(pick.tolist()):
                lo, hi = int(offsets[j]), int(offsets[j + 1])
                rows_ids[r] = values[lo:hi]
                rows_mask[r] = mvalues[lo:hi] if mvalues is not None else None
        lens = np.array([min(len(x), self.max_len) for x in rows_ids], np.int32)
        width = int(lens.max())
        out_ids = np.zeros((len(lens), width), np.int32)
        out_mask = np.zeros((len(lens), width), np.uint8)
        for r, n in enumerate(lens.tolist()):
            out_ids[r, :n] = rows_ids[r][:n]
            m = rows_mask[r]
            out_mask[r, :n] = m[:n] if m is not None else 1
        return {
            "input_ids": torch.from_numpy(out_ids),
            "loss_mask": torch.from_numpy(out_mask),
            "lengths": torch.from_numpy(lens),
            "num_tokens": int(lens.sum()),
        }


def dataloader_throughput(
    path: Path,
    batches: list[np.ndarray],
    max_len: int,
    seconds: float,
    workers: int = 2,
    warmup: float = 0.0,
) -> dict[str, Any]:
    """Tokens/s a DataLoader with ``workers`` workers delivers into the main process."""
    torch.set_num_threads(1)  # same consumer conditions as the service's clients
    loader = DataLoader(
        PlanBatches(path, batches, max_len), batch_size=None, num_workers=workers, shuffle=False
    )
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    first_batch_s = time.perf_counter() - t0
    tokens = nbytes = n = checksum = 0
    batch = first
    while time.perf_counter() - t0 < first_batch_s + warmup:
        checksum += touch(batch["input_ids"])
        try:
            batch = next(it)
        except StopIteration:  # a small corpus: warm up over another pass
            it = iter(loader)
            batch = next(it)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        checksum += touch(batch["input_ids"])
        tokens += batch["num_tokens"]
        nbytes += batch["input_ids"].numel() * 5
        n += 1
        try:
            batch = next(it)
        except StopIteration:
            break
    elapsed = time.perf_counter() - start
    del it
    return {
        "first_batch_s": first_batch_s,
        "batches": n,
        "tokens_per_s": tokens / elapsed,
        "bytes_per_s": nbytes / elapsed,
    }


def sort_once_restart(path: Path) -> dict[str, Any]:
    """What a restart costs the original pipeline: load the corpus into process memory."""
    t0 = time.perf_counter()
    chunks = [b.column(IDS_COLUMN) for b in read_batches(path)]
    values = np.concatenate([c.values.to_numpy() for c in chunks])  # into trainer memory
    lengths = np.concatenate([np.diff(c.offsets.to_numpy()) for c in chunks])
    order = np.argsort(lengths, kind="stable")  # the one global sort
    elapsed = time.perf_counter() - t0
    return {
        "restart_s": elapsed,
        "resident_bytes": int(values.nbytes + lengths.nbytes + order.nbytes),
    }
