"""Memory-mapped access to a tokenized Arrow corpus.

The corpus is one Arrow IPC file (file or stream format) or a folder of shards (for example
a Hugging Face ``save_to_disk`` folder, whose shard order comes from ``state.json``). Every
file is opened with ``pyarrow.memory_map``: token data stays in the page cache and is never
copied into Python objects, so opening the 902K-sample reference corpus costs about as much
as reading its list offsets (~7 MB), and the process RSS does not grow with the corpus.

Per-sample lengths are the differences of the ``input_ids`` offsets buffers, computed with
numpy for every record batch of every shard at once. ``input_ids(i)`` and ``loss_mask(i)``
return zero-copy numpy views into the mapping (a ``bool`` mask is bit-packed in Arrow, so
that one case unpacks the sample's bits: a copy of ``len`` bytes).

Validation is structural and vectorized (types, nulls, mask/ids length agreement); value
checks (token ids in ``[0, vocab)``, mask values in {0, 1}) scan the token data and run only
when asked (``vocab_size`` or ``check_values``), because they touch every page of the corpus.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

IDS_COLUMN = "input_ids"
MASK_COLUMN = "loss_mask"
_ID_TYPES = (pa.int32(), pa.int64(), pa.uint32())
# Masks are usually uint8/bool; Hugging Face `datasets` stores Python ints as int64.
_MASK_TYPES = (
    pa.int8(),
    pa.uint8(),
    pa.bool_(),
    pa.int16(),
    pa.uint16(),
    pa.int32(),
    pa.uint32(),
    pa.int64(),
)
_SHARD_SUFFIXES = (".arrow", ".ipc", ".feather")
# Shards up to this size are hashed whole for the fingerprint; larger ones are sampled.
_FULL_HASH_BYTES = 64 << 20
_HASH_SAMPLES = 256
_HASH_SAMPLE_BYTES = 4096


class DatasetError(Exception):
    """A dataset that cannot be served; the message names the file, column and row."""


@dataclass(frozen=True)
class _Chunk:
    """One record batch: zero-copy views of its list values and absolute offsets."""

    path: Path
    first_row: int  # row index of this batch's first row within its file
    ids_values: np.ndarray
    ids_offsets: np.ndarray  # int64, len rows+1, absolute positions into ids_values
    mask_values: np.ndarray | None  # int8/uint8 view, or None (no mask column)
    mask_offsets: np.ndarray | None
    mask_bits: pa.Buffer | None  # bool masks are bit-packed: unpacked per sample
    mask_bit_offset: int


class ArrowDataset:
    """A read-only, memory-mapped tokenized corpus.

    Attributes:
        lengths: int32 array of per-sample token counts, in sample order.
        has_loss_mask: whether the corpus carries a ``loss_mask`` column.
        fingerprint: hex digest of the lengths and the shards' identities; keys plans.
        paths: the shard files, in sample order.
    """

    def __init__(self, path: Path, chunks: list[_Chunk], lengths: np.ndarray) -> None:
        self.path = path
        self._chunks = chunks
        self.lengths = lengths
        self.paths = list(dict.fromkeys(c.path for c in chunks))
        self.has_loss_mask = bool(chunks) and chunks[0].mask_offsets is not None
        starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c.ids_offsets) - 1 for c in chunks], out=starts[1:])
        self._chunk_starts = starts
        # Per sample: which chunk holds it and where its tokens start in that chunk.
        counts = np.diff(starts)
        self._sample_chunk = np.repeat(np.arange(len(chunks), dtype=np.int32), counts)
        self._sample_start = (
            np.concatenate([c.ids_offsets[:-1] for c in chunks])
            if chunks
            else np.zeros(0, np.int64)
        )
        self._mask_start = (
            np.concatenate([c.mask_offsets[:-1] for c in chunks])  # type: ignore[index]
            if self.has_loss_mask
            else None
        )
        # Flat per-chunk lists: the hot copy loop indexes these, not dataclass attributes.
        self._ids_values = [c.ids_values for c in chunks]
        self._mask_values = [c.mask_values for c in chunks]
        self.fingerprint = _fingerprint(lengths, self.paths, path)

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.num_samples

    def _locate(self, i: int) -> tuple[_Chunk, int, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        return (
            self._chunks[self._sample_chunk[i]],
            int(self._sample_start[i]),
            int(self.lengths[i]),
        )

    def input_ids(self, i: int) -> np.ndarray:
        """Zero-copy view of sample ``i``'s token ids (dtype as stored)."""
        chunk, start, n = self._locate(i)
        return chunk.ids_values[start : start + n]

    def loss_mask(self, i: int) -> np.ndarray:
        """Sample ``i``'s loss mask: a zero-copy view, or ones when the corpus has none."""
        chunk, _, n = self._locate(i)
        if self._mask_start is None:
            return np.ones(n, dtype=np.uint8)
        start = int(self._mask_start[i])
        if chunk.mask_bits is not None:
            return _unpack_bits(chunk.mask_bits, chunk.mask_bit_offset + start, n)
        assert chunk.mask_values is not None
        return chunk.mask_values[start : start + n]

    def write_rows(
        self,
        sample_ids: Sequence[int] | np.ndarray,
        ids_out: np.ndarray,
        mask_out: np.ndarray,
        max_len: int,
    ) -> None:
        """Copy samples (each truncated to ``max_len``) into consecutive rows of 2-D outputs.

        ``ids_out``/``mask_out`` are ``[B, L]`` arrays (typically shared-memory slots); the
        caller has filled the padding. One memcpy per row and field, no intermediate buffer.
        """
        ids_values, mask_values = self._ids_values, self._mask_values
        for row, (c, start, mstart, n) in enumerate(self._rows(sample_ids, max_len)):
            ids_out[row, :n] = ids_values[c][start : start + n]
            mv = mask_values[c]
            if mv is not None:  # the common case, inlined: this loop is the daemon's hot path
                mask_out[row, :n] = mv[mstart : mstart + n]
            else:
                self._mask_into(c, mstart, n, mask_out[row, :n])

    def write_packed(
        self,
        sample_ids: Sequence[int] | np.ndarray,
        ids_out: np.ndarray,
        mask_out: np.ndarray,
        max_len: int,
    ) -> None:
        """Copy samples back to back into 1-D outputs (each truncated to ``max_len``)."""
        pos = 0
        for c, start, mstart, n in self._rows(sample_ids, max_len):
            ids_out[pos : pos + n] = self._ids_values[c][start : start + n]
            self._mask_into(c, mstart, n, mask_out[pos : pos + n])
            pos += n

    def _rows(self, sample_ids: Sequence[int] | np.ndarray, max_len: int) -> zip:
        """(chunk, ids start, mask start, length) per sample, looked up vectorized."""
        idx = np.asarray(sample_ids, dtype=np.int64)
        mstart = self._mask_start[idx] if self._mask_start is not None else np.zeros_like(idx)
        return zip(
            self._sample_chunk[idx].tolist(),
            self._sample_start[idx].tolist(),
            mstart.tolist(),
            np.minimum(self.lengths[idx], max_len).tolist(),
            strict=True,
        )

    def _mask_into(self, c: int, start: int, n: int, out: np.ndarray) -> None:
        values = self._mask_values[c]
        if values is not None:
            out[:] = values[start : start + n]
        elif self._mask_start is None:
            out[:] = 1
        else:
            chunk = self._chunks[c]
            assert chunk.mask_bits is not None
            out[:] = _unpack_bits(chunk.mask_bits, chunk.mask_bit_offset + start, n)


def open_dataset(
    path: str | Path, *, vocab_size: int | None = None, check_values: bool = False
) -> ArrowDataset:
    """Open a corpus file or shard folder, memory-mapped, and validate it.

    Raises:
        DatasetError: the path is not a valid corpus; the message names file, column, row.
    """
    root = Path(path)
    if not root.exists():
        raise DatasetError(f"{root}: no such file or directory")
    files = _shard_files(root)
    chunks: list[_Chunk] = []
    for f in files:
        chunks.extend(_read_shard(f))
    if not chunks:
        raise DatasetError(f"{root}: dataset is empty (no record batches)")
    lengths = np.concatenate([np.diff(c.ids_offsets) for c in chunks]).astype(np.int32)
    if lengths.size == 0:
        raise DatasetError(f"{root}: dataset is empty (0 samples)")
    if chunks[0].mask_offsets is None:
        log.info("%s: no %r column; every token counts for the loss", root, MASK_COLUMN)
    if vocab_size is not None or check_values:
        for c in chunks:
            _check_values(c, vocab_size)
    return ArrowDataset(root, chunks, lengths)


def _shard_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    state = root / "state.json"
    if state.is_file():
        try:
            files = [root / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DatasetError(f"{state}: not a Hugging Face datasets state file ({e})") from e
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DatasetError(f"{state}: lists shard {missing[0]} which does not exist")
        return files
    files = sorted(p for p in root.iterdir() if p.suffix in _SHARD_SUFFIXES and p.is_file())
    if not files:
        raise DatasetError(f"{root}: no Arrow shards (*.arrow, *.ipc, *.feather) in folder")
    return files


def _record_batches(path: Path) -> list[pa.RecordBatch]:
    """Read all record batches of one IPC file (file or stream format) zero-copy."""
    try:
        source = pa.memory_map(str(path), "r")
    except OSError as e:
        raise DatasetError(f"{path}: cannot open ({e})") from e
    head = source.read(8)
    source.seek(0)
    if source.size() == 0:
        raise DatasetError(f"{path}: empty file, not Arrow IPC")
    try:
        if head[:6] == b"ARROW1":
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(k) for k in range(reader.num_record_batches)]
        return list(pa.ipc.open_stream(source))
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        kind = "Arrow IPC file" if head[:6] == b"ARROW1" else "Arrow IPC stream"
        raise DatasetError(f"{path}: truncated, corrupt or not an {kind} ({e})") from e


def _read_shard(path: Path) -> list[_Chunk]:
    batches = _record_batches(path)
    chunks = []
    first_row = 0
    for batch in batches:
        _check_schema(path, batch.schema)
        chunks.append(_chunk(path, batch, first_row))
        first_row += batch.num_rows
    return chunks


def _check_schema(path: Path, schema: pa.Schema) -> None:
    if IDS_COLUMN not in schema.names:
        raise DatasetError(
            f"{path}: missing required column {IDS_COLUMN!r} (columns: {schema.names})"
        )
    for name, allowed in ((IDS_COLUMN, _ID_TYPES), (MASK_COLUMN, _MASK_TYPES)):
        if name not in schema.names:
            continue
        t = schema.field(name).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or t.value_type not in allowed:
            want = ", ".join(f"list<{a}>" for a in allowed)
            raise DatasetError(
                f"{path}: column {name!r} has type {_type_name(t)}, expected one of {want}"
            )


def _type_name(t: pa.DataType) -> str:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        kind = "large_list" if pa.types.is_large_list(t) else "list"
        return f"{kind}<{t.value_type}>"
    return str(t)


def _list_parts(
    path: Path, name: str, arr: pa.Array, first_row: int
) -> tuple[np.ndarray, pa.Array]:
    if arr.null_count:
        row = int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))
        raise DatasetError(f"{path}: column {name!r}, row {first_row + row}: null list")
    offsets = arr.offsets.to_numpy().astype(np.int64, copy=False)
    values = arr.values
    if values.null_count:
        # Nulls anywhere in the child buffer matter only inside this array's slice.
        child_nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        inside = child_nulls[(child_nulls >= offsets[0]) & (child_nulls < offsets[-1])]
        if inside.size:
            row = int(np.searchsorted(offsets, inside[0], side="right") - 1)
            raise DatasetError(f"{path}: column {name!r}, row {first_row + row}: null value")
    return offsets, values


def _chunk(path: Path, batch: pa.RecordBatch, first_row: int) -> _Chunk:
    ids_offsets, ids = _list_parts(path, IDS_COLUMN, batch.column(IDS_COLUMN), first_row)
    ids_values = ids.to_numpy(zero_copy_only=True)
    mask_values = mask_offsets = mask_bits = None
    bit_offset = 0
    if MASK_COLUMN in batch.schema.names:
        mask_offsets, mask = _list_parts(path, MASK_COLUMN, batch.column(MASK_COLUMN), first_row)
        bad = np.flatnonzero(np.diff(mask_offsets) != np.diff(ids_offsets))
        if bad.size:
            r = int(bad[0])
            raise DatasetError(
                f"{path}: column {MASK_COLUMN!r}, row {first_row + r}: length "
                f"{int(mask_offsets[r + 1] - mask_offsets[r])} differs from "
                f"{IDS_COLUMN} length {int(ids_offsets[r + 1] - ids_offsets[r])}"
            )
        if pa.types.is_boolean(mask.type):
            mask_bits, bit_offset = mask.buffers()[1], mask.offset
        else:
            mask_values = mask.to_numpy(zero_copy_only=True)
    return _Chunk(
        path, first_row, ids_values, ids_offsets, mask_values, mask_offsets, mask_bits, bit_offset
    )


def _check_values(c: _Chunk, vocab_size: int | None) -> None:
    lo, hi = int(c.ids_offsets[0]), int(c.ids_offsets[-1])
    ids = c.ids_values[lo:hi]
    if ids.size:
        limit = vocab_size if vocab_size is not None else np.iinfo(np.int32).max + 1
        bad = (ids < 0) | (ids >= limit) if ids.dtype.kind == "i" else ids >= limit
        if bad.any():
            pos = lo + int(np.argmax(bad))
            row = int(np.searchsorted(c.ids_offsets, pos, side="right") - 1)
            raise DatasetError(
                f"{c.path}: column {IDS_COLUMN!r}, row {c.first_row + row}: token id "
                f"{int(c.ids_values[pos])} outside [0, {limit})"
            )
    if c.mask_values is not None and c.mask_offsets is not None:
        lo, hi = int(c.mask_offsets[0]), int(c.mask_offsets[-1])
        values = c.mask_values[lo:hi]
        bad = values > 1 if values.dtype.kind == "u" else (values < 0) | (values > 1)
        if bad.any():
            pos = lo + int(np.argmax(bad))
            row = int(np.searchsorted(c.mask_offsets, pos, side="right") - 1)
            raise DatasetError(
                f"{c.path}: column {MASK_COLUMN!r}, row {c.first_row + row}: mask value "
                f"{int(c.mask_values[pos])} is not 0 or 1"
            )


def _unpack_bits(buf: pa.Buffer, bit_start: int, n: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8)
    first, last = bit_start // 8, (bit_start + n + 7) // 8
    bits = np.unpackbits(raw[first:last], bitorder="little")
    skip = bit_start - first * 8
    return bits[skip : skip + n]


def _fingerprint(lengths: np.ndarray, paths: list[Path], root: Path) -> str:
    """Hash of the lengths and each shard's name, size and content.

    Shards up to 64 MiB are hashed whole; larger ones by 256 evenly spaced 4 KiB samples plus
    their head and tail (the footer), so opening stays fast on multi-GB corpora. The hash
    uses names relative to the dataset root, so a copy on another node fingerprints the same.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
    for p in paths:
        size = p.stat().st_size
        rel = p.name if p == root else str(p.relative_to(root))
        h.update(f"{rel}:{size}".encode())
        with open(p, "rb") as f:
            if size <= _FULL_HASH_BYTES:
                h.update(f.read())
                continue
            for off in np.linspace(0, size - _HASH_SAMPLE_BYTES, _HASH_SAMPLES, dtype=np.int64):
                f.seek(int(off))
                h.update(f.read(_HASH_SAMPLE_BYTES))
    return h.hexdigest()
