"""Synthetic corpora shaped like the reference corpus.

Lengths are lognormal (median 1500, sigma 0.8, clipped to [16, 8192]: mean ~2000 tokens,
~1.8G tokens for 902K samples), the loss mask covers a response part (the last 50-90% of
each sample). Two kinds of content:

* ``random``: uniform token ids over the vocabulary. Unlearnable; right for loader tests
  and benchmarks, where only shapes and bytes matter.
* ``learnable``: content whose difficulty depends on length, so a drafter's loss can fall
  and batch composition visibly matters. Samples shorter than the median length follow an
  order-1 Markov chain over 64 tokens with 2 successors per state (~0.5 bit/token); longer
  ones an order-2 chain over 512 tokens with 4 successors (~1.6 bit/token). The chains are
  stepped for all rows of a chunk at once (one numpy op per position, never per token).

Generation is chunked (one record batch per chunk), streamed to disk with a progress
callback, and fully determined by the seed: the same arguments give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loader_server.data.dataset import CORPUS_SCHEMA as _SCHEMA
from loader_server.data.dataset import record_batch

QWEN3_VOCAB = 151936


@dataclass(frozen=True, kw_only=True)
class SynthSpec:
    """What to generate. Lengths: lognormal(log(median), sigma) rounded, clipped."""

    num_samples: int
    seed: int = 0
    median_len: float = 1500.0
    sigma: float = 0.8
    min_len: int = 16
    max_len: int = 8192
    vocab_size: int = QWEN3_VOCAB
    content: str = "random"  # random | learnable
    chunk_samples: int = 8192

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {self.num_samples}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.median_len <= 0 or self.sigma < 0:
            raise ValueError(
                f"bad length distribution: median {self.median_len}, sigma {self.sigma}"
            )
        if self.content not in ("random", "learnable"):
            raise ValueError(f"content must be 'random' or 'learnable', got {self.content!r}")
        min_vocab = 512 if self.content == "learnable" else 2
        if self.vocab_size < min_vocab:
            raise ValueError(f"vocab_size must be >= {min_vocab} for {self.content} content")
        if self.chunk_samples <= 0:
            raise ValueError(f"chunk_samples must be positive, got {self.chunk_samples}")


def synth_lengths(spec: SynthSpec) -> np.ndarray:
    """All sample lengths (int32), drawn from their own seeded stream."""
    rng = np.random.default_rng([spec.seed, 0])
    raw = rng.lognormal(np.log(spec.median_len), spec.sigma, spec.num_samples)
    return np.clip(np.rint(raw), spec.min_len, spec.max_len).astype(np.int32)


def _chunks(spec: SynthSpec, size: int) -> Iterator[pa.RecordBatch]:
    lengths = synth_lengths(spec)
    for k, lo in enumerate(range(0, spec.num_samples, size)):
        lens = lengths[lo : lo + size]
        rng = np.random.default_rng([spec.seed, 1, k])
        offsets = np.zeros(lens.size + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        if spec.content == "random":
            ids = rng.integers(0, spec.vocab_size, int(offsets[-1]), dtype=np.int32)
        else:
            ids = _learnable_ids(lens, offsets, float(spec.median_len), rng)
        mask = _response_mask(lens, offsets, rng)
        yield record_batch(ids, mask, lens)


def _response_mask(lens: np.ndarray, offsets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """1 on each sample's response: positions >= a prompt length of 10-50% of the sample."""
    prompt = np.floor(lens * rng.uniform(0.1, 0.5, lens.size)).astype(np.int64)
    pos = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(
        offsets[:-1].astype(np.int64), lens
    )
    return (pos >= np.repeat(prompt, lens)).astype(np.uint8)


def _learnable_ids(
    lens: np.ndarray, offsets: np.ndarray, split_len: float, rng: np.random.Generator
) -> np.ndarray:
    """Markov-chain content; short samples easy, long samples hard (see module docstring)."""
    # Transition tables are fixed (seed-independent) so every corpus speaks one "language".
    tables = np.random.default_rng(12345)
    easy_next = tables.integers(0, 64, size=(64, 2), dtype=np.int32)
    hard_next = tables.integers(0, 512, size=(512 * 512, 4), dtype=np.int32)
    easy_p = np.cumsum([0.9, 0.1])
    hard_p = np.cumsum([0.55, 0.25, 0.15, 0.05])

    parts = []
    for lo in range(0, lens.size, 1024):  # bounded [width, rows] scratch per block
        sub = lens[lo : lo + 1024]
        n, width = sub.size, int(sub.max())
        easy = sub < split_len
        out = np.empty((width, n), dtype=np.int32)
        prev2 = rng.integers(0, 512, n, dtype=np.int32)
        prev1 = np.where(easy, rng.integers(0, 64, n), rng.integers(0, 512, n)).astype(np.int32)
        for t in range(width):  # vectorized over rows; one step per position
            u = rng.random(n)
            e = easy_next[prev1 % 64, np.searchsorted(easy_p, u)]
            h = hard_next[prev2 * 512 + prev1 % 512, np.minimum(np.searchsorted(hard_p, u), 3)]
            out[t] = np.where(easy, e, h)
            prev2, prev1 = prev1, out[t]
        keep = np.arange(width)[None, :] < sub[:, None]
        parts.append(out.T[keep])
    return np.concatenate(parts)


def write_corpus(
    out: str | Path,
    spec: SynthSpec,
    *,
    shards: int = 1,
    stream_format: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write the corpus: one file (``shards == 1`` and ``out`` not a folder) or a folder of
    ``data-XXXXX-of-YYYYY.arrow`` shards. Returns the files written.

    Files are written under a temporary name and renamed when complete, so an interrupted
    run never leaves a truncated file under the final name.
    """
    if not 1 <= shards <= spec.num_samples:
        raise ValueError(f"shards must be in [1, num_samples={spec.num_samples}], got {shards}")
    out = Path(out)
    if shards == 1 and out.suffix:
        paths = [out]
        out.parent.mkdir(parents=True, exist_ok=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    # Every shard gets at least one record batch; shard k holds a contiguous range of chunks,
    # so sample order is preserved across shards.
    size = min(spec.chunk_samples, -(-spec.num_samples // shards))
    n_chunks = -(-spec.num_samples // size)
    bounds = np.linspace(0, n_chunks, shards + 1).round().astype(int)
    chunks = _chunks(spec, size)
    for k, path in enumerate(paths):
        tmp = path.with_name(path.name + ".tmp")
        opener = pa.ipc.new_stream if stream_format else pa.ipc.new_file
        with pa.OSFile(str(tmp), "wb") as sink, opener(sink, _SCHEMA) as writer:
            for _ in range(bounds[k], bounds[k + 1]):
                batch = next(chunks)
                writer.write_batch(batch)
                if progress is not None:
                    progress(batch.num_rows)
        tmp.replace(path)
    return paths
