"""The loader corpus as the trainer writes it, in one place: the schema (the reader's,
``loader_server.data.dataset.CORPUS_SCHEMA``: ``input_ids`` ``list<int32>``, ``loss_mask``
``list<uint8>``), rows as Arrow record batches (``loader_server.data.dataset.record_batch``,
zero-copy from flat numpy arrays; ``dflash-loader synth`` writes with it too), the sharded
folder ``tokenize`` writes (``ShardWriter``), and the held-out prompts file the verifier
reads (``write_heldout`` / ``read_heldout``). No torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loader_server.data.dataset import CORPUS_SCHEMA as SCHEMA
from loader_server.data.dataset import record_batch
from trainer.files import atomic_output

REPORT_NAME, HELDOUT_NAME = "tokenize_report.json", "heldout.jsonl"
_BATCH_ROWS, _BATCH_TOKENS = 8192, 1 << 24  # record batch bounds in the shards


class ShardWriter:
    """Rows to ``shard-00000.arrow``... in record batches of at most 8192 rows / 16M tokens,
    ``shard_rows`` rows per shard, holding back the last ``hold`` rows (the held-out set).
    Batch and shard boundaries depend only on the row lengths: same rows, same bytes."""

    def __init__(self, folder: Path, shard_rows: int, hold: int) -> None:
        self.folder, self.shard_rows, self.hold = folder, shard_rows, hold
        self.paths: list[Path] = []
        self.rows = self.tokens = self.supervised = 0
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending = self._pending_tokens = 0
        self._stuck_tokens = 0  # pending tokens the last flush could not write
        self._writer: Any = None
        self._sink: Any = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        if lengths.size:
            self._parts.append((ids, mask, lengths))
            self._pending += int(lengths.size)
            self._pending_tokens += int(ids.size)
            fresh = self._pending_tokens - self._stuck_tokens
            if self._pending - self.hold >= _BATCH_ROWS or fresh >= _BATCH_TOKENS:
                self._flush(final=False)

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write everything but the held rows; return those (flat ids, mask, lengths)."""
        held = self._flush(final=True)
        self._close_shard()
        return held

    def _flush(self, final: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._parts:
            return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32)
        ids, mask, lens = (np.concatenate([p[k] for p in self._parts]) for k in range(3))
        offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        i, n_out = 0, max(lens.size - self.hold, 0)
        while i < n_out and (take := self._next_batch(lens[i:n_out], final)):
            lo, hi = int(offsets[i]), int(offsets[i + take])
            self._write(ids[lo:hi], mask[lo:hi], lens[i : i + take])
            i += take
        lo = int(offsets[i])
        self._parts = [(ids[lo:], mask[lo:], lens[i:])]
        self._pending = int(lens.size - i)
        self._pending_tokens = self._stuck_tokens = int(ids.size - lo)
        return self._parts[0]

    def _next_batch(self, lens: np.ndarray, final: bool) -> int:
        """Rows in the next record batch (0: not enough rows yet to close one)."""
        limit = min(_BATCH_ROWS, self.shard_rows - self._in_shard)
        csum = np.cumsum(lens[:limit], dtype=np.int64)
        by_tokens = int(np.searchsorted(csum, _BATCH_TOKENS, side="left")) + 1
        take = min(limit, by_tokens, lens.size)
        complete = take in (limit, by_tokens)
        return take if complete or final else 0

    def _write(self, ids: np.ndarray, mask: np.ndarray, lens: np.ndarray) -> None:
        if self._writer is None:
            path = self.folder / f"shard-{len(self.paths):05d}.arrow"
            self.paths.append(path)
            self._sink = pa.OSFile(str(path), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        self._writer.write_batch(record_batch(ids, mask, lens))
        self.rows += int(lens.size)
        self.tokens += int(ids.size)
        self.supervised += int(np.count_nonzero(mask))
        self._in_shard += int(lens.size)
        if self._in_shard >= self.shard_rows:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
        self._writer = self._sink = None
        self._in_shard = 0


@dataclass(frozen=True)
class HeldoutPrompt:
    """One held-out prompt: the corpus index the sample would have had, its prompt's token
    ids, and where it came from (source file and row)."""

    sample: int
    prompt: list[int]
    file: str
    row: int


def write_heldout(
    path: Path, prompts: Iterable[HeldoutPrompt], *, force: bool = True, inputs: Iterable[Path] = ()
) -> Path:
    """``{"sample", "prompt", "file", "row"}`` per line, written atomically
    (``trainer.files.atomic_output``: ``force`` replaces an existing file)."""
    with atomic_output(path, folder=False, force=force, inputs=inputs) as tmp, open(tmp, "w") as f:
        for p in prompts:
            line = {"sample": p.sample, "prompt": p.prompt, "file": p.file, "row": p.row}
            f.write(json.dumps(line) + "\n")
    return Path(path)


def read_heldout(
    path: Path, max_prompt_len: int | None = None, vocab_size: int | None = None
) -> list[list[int]]:
    """The prompts of a held-out file: lines of ``{"prompt": [token ids]}`` (the last
    ``max_prompt_len`` ids of each when given), every id an int in ``[0, vocab_size)`` when
    that is given. Every problem is one line naming the file and line."""
    try:
        with open(path) as f:
            lines = list(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from e
    prompts = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{k}: not JSON ({e.msg})") from None
        ids = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids:
            raise ValueError(
                f"{path}:{k}: expected a JSON object with a non-empty 'prompt' list of token "
                "ids (tokenize/regen --holdout writes them)"
            )
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"{path}:{k}: prompt holds {i!r}, not a token id")
            if i < 0 or (vocab_size is not None and i >= vocab_size):
                top = "" if vocab_size is None else f" (0..{vocab_size - 1})"
                raise ValueError(
                    f"{path}:{k}: token id {i} is outside the target's vocabulary{top}: "
                    "were these prompts tokenized for another model?"
                )
        prompts.append(list(ids[-max_prompt_len:] if max_prompt_len else ids))
    return prompts
