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

Validation is structural and vectorized (types, nulls, mask/ids length agreement). Value
checks (token ids in ``[0, vocab)`` or ``[0, 2^31)``, mask values in {0, 1}) scan the token
data: always for a corpus of at most ``SCAN_BYTES`` of token data, on request for a larger
one (``vocab_size`` or ``check_values``: it touches every page). Whatever was not scanned is
checked as it is served: the native fill refuses a value it could not serve exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from loader_server.data import _native
from loader_server.data.chunks import (
    IDS_COLUMN,
    MASK_COLUMN,
    Chunk,
    DatasetError,
    check_uniform,
    read_shard,
    scan_values,
    unpack_bits,
    value_bytes,
)
from loader_server.data.shards import ShardError, ShardFile, fingerprint, open_shard
from loader_server.wire.files import read_json

log = logging.getLogger(__name__)

#: The schema corpus writers use (the reader also takes other integer widths).
CORPUS_SCHEMA = pa.schema([(IDS_COLUMN, pa.list_(pa.int32())), (MASK_COLUMN, pa.list_(pa.uint8()))])
_SHARD_SUFFIXES = (".arrow", ".ipc", ".feather")
_INT32_MAX = np.iinfo(np.int32).max
#: Corpora with at most this much token data get their values scanned at open (~0.2 s).
SCAN_BYTES = 256 << 20


def record_batch(ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> pa.RecordBatch:
    """Rows of ``lengths`` tokens, given as flat ``ids`` and ``mask``, as one record batch of
    ``CORPUS_SCHEMA``: the one way this project's writers (``synth``, the trainer's
    ``tokenize`` and ``regen``) build a corpus, zero-copy from numpy."""
    offsets = np.zeros(np.size(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    arrays = [
        pa.ListArray.from_arrays(_arrow_view(offsets, pa.int32()), _arrow_view(ids, pa.int32())),
        pa.ListArray.from_arrays(_arrow_view(offsets, pa.int32()), _arrow_view(mask, pa.uint8())),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=CORPUS_SCHEMA)


def _arrow_view(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """Zero-copy Arrow view of a numpy array (``pa.array`` would import pandas: 0.6 s)."""
    values = np.ascontiguousarray(values, dtype=type_.to_pandas_dtype())
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


class CorpusFaultError(DatasetError):
    """Reading the mapped corpus faulted (SIGBUS): a file shrank, or its storage failed."""


class ArrowDataset:
    """A read-only, memory-mapped tokenized corpus.

    Attributes:
        lengths: int32 array of per-sample token counts, in sample order.
        has_loss_mask: whether the corpus carries a ``loss_mask`` column.
        fingerprint: hex digest of the lengths and the shards' identities; keys plans.
        paths: the shard files, in sample order.
    """

    def __init__(
        self, path: Path, chunks: list[Chunk], lengths: np.ndarray, shards: list[ShardFile]
    ) -> None:
        self.path = path
        self._chunks = chunks
        self.lengths = lengths
        self.shards = shards
        self.paths = [s.path for s in shards]
        self.has_loss_mask = bool(chunks) and chunks[0].mask_offsets is not None
        counts = [len(c.ids_offsets) - 1 for c in chunks]
        self._sample_chunk = np.repeat(np.arange(len(chunks), dtype=np.int32), counts)
        self._chunk_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # Per sample, where its tokens start: an address inside the mapping (a bit address
        # for bool masks). The native gather copies a whole micro-batch from these tables.
        self._ids_kind = chunks[0].ids_values.dtype.itemsize if chunks else 4
        self._ids_base = [_address(c.ids_values) for c in chunks]
        self._ids_addr = _addresses(
            [
                (b, c.ids_offsets, self._ids_kind)
                for b, c in zip(self._ids_base, chunks, strict=True)
            ]
        )
        self._mask_kind = _mask_kind(chunks[0]) if chunks else _native_ones
        self._mask_base = [_mask_base(c) for c in chunks]
        self._mask_addr = (
            _addresses(
                [
                    (b, c.mask_offsets, max(self._mask_kind, 1))
                    for b, c in zip(self._mask_base, chunks, strict=True)
                ]
            )
            if self._mask_kind != _native_ones
            else None
        )
        self.fingerprint = fingerprint(lengths, shards, path)
        # Samples whose pages ``populate`` has mapped into this process (one byte each).
        self._populated = np.zeros(lengths.shape[0], np.uint8)
        # What _native.fill and _native.populate need to find any sample's tokens.
        self._native_table = (
            self.lengths,
            self._ids_addr,
            self._ids_kind,
            self._mask_addr,
            self._mask_kind,
        )

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.num_samples

    def describe(self, i: int) -> str:
        """Where sample ``i`` comes from: ``FILE, row R`` (row within that file)."""
        c = int(self._sample_chunk[i])
        chunk = self._chunks[c]
        return f"{chunk.path}, row {chunk.first_row + i - int(self._chunk_start[c])}"

    def close(self) -> None:
        """Close the shards' descriptors (the mappings go when the last view does)."""
        for shard in self.shards:
            shard.close()

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        return int(self._sample_chunk[i]), int(self.lengths[i])

    def input_ids(self, i: int) -> np.ndarray:
        """Zero-copy view of sample ``i``'s token ids (dtype as stored)."""
        c, n = self._locate(i)
        start = (int(self._ids_addr[i]) - self._ids_base[c]) // self._ids_kind
        return self._chunks[c].ids_values[start : start + n]

    def loss_mask(self, i: int) -> np.ndarray:
        """Sample ``i``'s loss mask: a zero-copy view, or ones when the corpus has none."""
        c, n = self._locate(i)
        if self._mask_addr is None:
            return np.ones(n, dtype=np.uint8)
        chunk, offset = self._chunks[c], int(self._mask_addr[i]) - self._mask_base[c]
        if chunk.mask_bits is not None:
            return unpack_bits(chunk.mask_bits, offset, n)
        assert chunk.mask_values is not None
        start = offset // self._mask_kind
        return chunk.mask_values[start : start + n]

    def fill(
        self,
        sample_ids: Sequence[int] | np.ndarray,
        max_len: int,
        *,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        lengths: np.ndarray,
        sample_ids_out: np.ndarray,
        position_ids: np.ndarray | None = None,
        cu_seqlens: np.ndarray | None = None,
        width: int = 0,
        pad_id: int = 0,
    ) -> tuple[int, int]:
        """Write a micro-batch (each sample cut to ``max_len``) into the given outputs.

        ``width > 0``: padded rows of ``width`` elements in ``input_ids`` (int32) and
        ``loss_mask`` (uint8), padding ``pad_id`` and 0. ``width == 0``: packed back to back,
        with ``position_ids`` and ``cu_seqlens`` (int32) when given. ``lengths`` (int32) and
        ``sample_ids_out`` (int64) get one entry per row. Outputs are flat arrays at least as
        large as needed, typically a shared-memory slot's fields: one native call writes
        them all, with no intermediate buffer. Returns (real tokens, longest row).

        Raises:
            DatasetError: a token id outside [0, 2^31) or a mask value outside {0, 1}
                (values are served exactly or not at all), naming file, row and value.
            CorpusFaultError: a page of the mapped corpus could not be read (SIGBUS: a
                file truncated under the daemon, or failing storage).
        """
        try:
            return _native.fill(
                np.ascontiguousarray(sample_ids, dtype=np.int64),
                *self._native_table,
                max_len,
                width,
                pad_id,
                input_ids,
                loss_mask,
                lengths,
                sample_ids_out,
                position_ids,
                cu_seqlens,
            )
        except _native.BadValue as e:
            sample, column, index = e.args
            raise DatasetError(self._bad_value(sample, column, index)) from None
        except _native.Fault as e:
            where = self.describe(e.sample)
            raise CorpusFaultError(f"{where} (sample {e.sample}): {e.strerror}") from None

    def _bad_value(self, sample: int, column: str, index: int) -> str:
        view = self.input_ids(sample) if column == IDS_COLUMN else self.loss_mask(sample)
        value = int(view[index])
        why = (
            f"token id {value} does not fit the int32 batches (must be in [0, {_INT32_MAX}])"
            if column == IDS_COLUMN
            else f"mask value {value} is not 0 or 1"
        )
        return f"{self.describe(sample)}, column {column!r}, token {index}: {why}"

    def needs_populate(self, sample_ids: np.ndarray) -> bool:
        """Whether some of these samples' pages were never mapped by ``populate``."""
        return not self._populated[sample_ids].all()

    def populate(self, sample_ids: np.ndarray, max_len: int) -> int:
        """Map the pages of these samples into this process ahead of ``fill``.

        One ``madvise(MADV_POPULATE_READ)`` per sample and field instead of a page fault per
        page (each of which also maps 15 neighbouring pages): on the 902K corpus's first
        pass ~3x less work, and it runs on another thread, with the GIL released, while the
        daemon copies. Each sample is populated once per daemon; returns how many were.
        """
        return _native.populate(
            np.ascontiguousarray(sample_ids, dtype=np.int64),
            *self._native_table,
            max_len,
            self._populated,
        )


_native_ones, _native_bits = 0, -1  # _native.gather's source kinds besides element sizes


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _mask_kind(c: Chunk) -> int:
    if c.mask_offsets is None:
        return _native_ones
    if c.mask_bits is not None:
        return _native_bits
    assert c.mask_values is not None
    return int(c.mask_values.dtype.itemsize)


def _mask_base(c: Chunk) -> int:
    """Where a chunk's mask offsets count from: bytes, or bits for a bool mask."""
    if c.mask_bits is not None:
        return c.mask_bits.address * 8 + c.mask_bit_offset
    return _address(c.mask_values) if c.mask_values is not None else 0


def _addresses(parts: list[tuple[int, np.ndarray | None, int]]) -> np.ndarray:
    """Per sample: base + offset * unit, over every chunk at once (int64)."""
    return np.concatenate(
        [base + offsets[:-1] * unit for base, offsets, unit in parts if offsets is not None]
    )


def open_dataset(
    path: str | Path,
    *,
    vocab_size: int | None = None,
    check_values: bool = False,
    scan_bytes: int = SCAN_BYTES,
) -> ArrowDataset:
    """Open a corpus file or shard folder, memory-mapped, and validate it.

    Values are scanned (token ids in [0, 2^31) or [0, vocab_size), mask values in {0, 1})
    when ``vocab_size`` or ``check_values`` asks for it, and always when the token data is
    at most ``scan_bytes`` (a cheap vectorized pass). Otherwise they are checked as they are
    served (``fill`` refuses a value it could not serve exactly).

    Raises:
        DatasetError: the path is not a valid corpus; the message names file, column, row.
    """
    root = Path(path)
    try:
        return _open_dataset(root, vocab_size, check_values, scan_bytes)
    except PermissionError as e:
        raise DatasetError(_permission_denied(root, e)) from None


# systemd's ProtectHome=yes (the loader unit sets it) makes these inaccessible (EACCES).
_PROTECT_HOME_DIRS = (Path("/home"), Path("/root"), Path("/run/user"))


def _permission_denied(root: Path, e: PermissionError) -> str:
    """One line: which path could not be read, as whom, and the likely cause."""
    where = e.filename if e.filename is not None else root
    try:
        import pwd

        user = f"user {pwd.getpwuid(os.geteuid()).pw_name}"
    except (ImportError, KeyError):
        user = f"uid {os.geteuid()}"
    text = f"{where}: permission denied reading the dataset as {user}"
    hidden = next((d for d in _PROTECT_HOME_DIRS if root.absolute().is_relative_to(d)), None)
    if hidden is not None:
        return (
            f"{text}; it lies under {hidden}, which the dflash-loader unit's ProtectHome=yes "
            f"makes inaccessible to the daemon: move the corpus out of {hidden} (e.g. to "
            f"/data/corpus), or use ProtectHome=tmpfs with BindReadOnlyPaths= in a drop-in"
        )
    return f"{text}; give the daemon's group read access (chgrp -R dflash, chmod -R g+rX)"


def _open_dataset(
    root: Path, vocab_size: int | None, check_values: bool, scan_bytes: int
) -> ArrowDataset:
    if not root.exists():
        raise DatasetError(f"{root}: no such file or directory")
    if not (root.is_file() or root.is_dir()):
        raise DatasetError(f"{root}: neither a regular file nor a folder of shards")
    shards: list[ShardFile] = []
    try:
        for f in _shard_files(root):
            shards.append(open_shard(f))
        return _open(root, shards, vocab_size, check_values, scan_bytes)
    except ShardError as e:
        _close_all(shards)
        raise DatasetError(str(e)) from None
    except BaseException:
        _close_all(shards)
        raise


def _close_all(shards: list[ShardFile]) -> None:
    for shard in shards:
        shard.close()


def _open(
    root: Path,
    shards: list[ShardFile],
    vocab_size: int | None,
    check_values: bool,
    scan_bytes: int,
) -> ArrowDataset:
    chunks: list[Chunk] = []
    for shard in shards:
        chunks.extend(read_shard(shard))
    if not chunks:
        raise DatasetError(f"{root}: dataset is empty (no record batches)")
    check_uniform(chunks)
    raw = np.concatenate([np.diff(c.ids_offsets) for c in chunks])
    if raw.size and int(raw.max()) > _INT32_MAX:
        raise DatasetError(f"{root}: a sample of {int(raw.max())} tokens (more than 2^31 - 1)")
    lengths = raw.astype(np.int32)
    if lengths.size == 0:
        raise DatasetError(f"{root}: dataset is empty (0 samples)")
    if chunks[0].mask_offsets is None:
        log.info("%s: no %r column; every token counts for the loss", root, MASK_COLUMN)
    if vocab_size is not None or check_values or value_bytes(chunks) <= scan_bytes:
        for c in chunks:
            scan_values(c, vocab_size)
    return ArrowDataset(root, chunks, lengths, shards)


def _shard_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    state = root / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in read_json(state)["_data_files"]]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{state}: not a Hugging Face datasets state file ({e})") from e
        files = []
        for name in names:
            f = root / str(name)
            # A shard name read from a file must stay inside the dataset folder.
            if not isinstance(name, str) or not f.resolve().is_relative_to(root.resolve()):
                raise DatasetError(f"{state}: shard {name!r} lies outside {root}")
            if not f.is_file():
                raise DatasetError(f"{state}: lists shard {f} which does not exist")
            files.append(f)
        return files
    files = sorted(p for p in root.iterdir() if p.suffix in _SHARD_SUFFIXES and p.is_file())
    if not files:
        raise DatasetError(f"{root}: no Arrow shards (*.arrow, *.ipc, *.feather) in folder")
    return files
