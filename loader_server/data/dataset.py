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

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loader_server.data import _native
from loader_server.data.shards import ShardError, ShardFile, fingerprint, open_shard

log = logging.getLogger(__name__)

IDS_COLUMN = "input_ids"
MASK_COLUMN = "loss_mask"
#: The schema corpus writers use (the reader also takes other integer widths).
CORPUS_SCHEMA = pa.schema([(IDS_COLUMN, pa.list_(pa.int32())), (MASK_COLUMN, pa.list_(pa.uint8()))])
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


class DatasetError(Exception):
    """A dataset that cannot be served; the message names the file, column and row."""


class CorpusFaultError(DatasetError):
    """Reading the mapped corpus faulted (SIGBUS): a file shrank, or its storage failed."""


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

    def __init__(
        self, path: Path, chunks: list[_Chunk], lengths: np.ndarray, shards: list[ShardFile]
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
            return _unpack_bits(chunk.mask_bits, offset, n)
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


def _mask_kind(c: _Chunk) -> int:
    if c.mask_offsets is None:
        return _native_ones
    if c.mask_bits is not None:
        return _native_bits
    assert c.mask_values is not None
    return int(c.mask_values.dtype.itemsize)


def _mask_base(c: _Chunk) -> int:
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
    chunks: list[_Chunk] = []
    for shard in shards:
        chunks.extend(_read_shard(shard))
    if not chunks:
        raise DatasetError(f"{root}: dataset is empty (no record batches)")
    _check_uniform(chunks)
    raw = np.concatenate([np.diff(c.ids_offsets) for c in chunks])
    if raw.size and int(raw.max()) > _INT32_MAX:
        raise DatasetError(f"{root}: a sample of {int(raw.max())} tokens (more than 2^31 - 1)")
    lengths = raw.astype(np.int32)
    if lengths.size == 0:
        raise DatasetError(f"{root}: dataset is empty (0 samples)")
    if chunks[0].mask_offsets is None:
        log.info("%s: no %r column; every token counts for the loss", root, MASK_COLUMN)
    if vocab_size is not None or check_values or _value_bytes(chunks) <= scan_bytes:
        for c in chunks:
            _check_values(c, vocab_size)
    return ArrowDataset(root, chunks, lengths, shards)


def _value_bytes(chunks: list[_Chunk]) -> int:
    """Bytes of token data a value scan reads (ids and a non-bool mask)."""
    total = 0
    for c in chunks:
        total += int(c.ids_offsets[-1] - c.ids_offsets[0]) * c.ids_values.dtype.itemsize
        if c.mask_values is not None and c.mask_offsets is not None:
            total += int(c.mask_offsets[-1] - c.mask_offsets[0]) * c.mask_values.dtype.itemsize
    return total


def _shard_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    state = root / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
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


def _record_batches(shard: ShardFile) -> list[pa.RecordBatch]:
    """Read all record batches of one IPC file (file or stream format) zero-copy."""
    path = shard.path
    try:
        source = pa.memory_map(shard.map_path, "r")
    except OSError as e:
        raise DatasetError(f"{path}: cannot open ({e})") from e
    head = source.read(8)
    source.seek(0)
    if source.size() == 0:
        raise DatasetError(f"{path}: empty file, not Arrow IPC")
    try:
        if head[:6] == b"ARROW1":
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
        else:
            batches = list(pa.ipc.open_stream(source))
        for batch in batches:
            batch.schema.names  # noqa: B018 - decodes every field name (may be corrupt)
        return batches
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: bad UTF-8 names
        kind = "Arrow IPC file" if head[:6] == b"ARROW1" else "Arrow IPC stream"
        raise DatasetError(
            f"{path}: truncated, corrupt or not an {kind} ({_one_line(e)})"
        ) from None


def _read_shard(shard: ShardFile) -> list[_Chunk]:
    path = shard.path
    batches = _record_batches(shard)
    chunks = []
    first_row = 0
    for batch in batches:
        _check_schema(path, batch.schema)
        _check_structure(path, batch, first_row)
        chunks.append(_chunk(path, batch, first_row))
        first_row += batch.num_rows
    return chunks


def _check_structure(path: Path, batch: pa.RecordBatch, first_row: int) -> None:
    """Arrow's own check of a record batch read from a file that may be corrupt (buffer
    sizes against lengths, O(1) per array; a column access before it can crash pyarrow).
    Offsets and nulls of the served columns are checked next, vectorized (``_list_parts``)."""
    try:
        batch.validate()
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise DatasetError(
            f"{path}: record batch at row {first_row} is corrupt ({_one_line(e)})"
        ) from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


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


def _check_uniform(chunks: list[_Chunk]) -> None:
    """Every shard must store its columns with the same types: one gather serves them all."""
    first = chunks[0]
    for c in chunks[1:]:
        for name, want, got in (
            (IDS_COLUMN, str(first.ids_values.dtype), str(c.ids_values.dtype)),
            (MASK_COLUMN, _mask_type(first), _mask_type(c)),
        ):
            if got != want:
                raise DatasetError(
                    f"{c.path}: column {name!r} is {got} but {first.path} has {want}; "
                    f"every shard must store the same column types"
                )


def _mask_type(c: _Chunk) -> str:
    if c.mask_offsets is None:
        return "absent"
    return "bool" if c.mask_values is None else str(c.mask_values.dtype)


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
    # The native fill trusts offsets (they locate every row it copies): a corrupt file must
    # fail here, not read past its data. Arrow's own open-time check covers less.
    back = np.flatnonzero(np.diff(offsets) < 0)
    if back.size:
        raise DatasetError(
            f"{path}: column {name!r}, row {first_row + int(back[0])}: corrupt list offsets "
            f"(they decrease)"
        )
    if offsets.size and (offsets[0] < 0 or offsets[-1] > len(values)):
        raise DatasetError(
            f"{path}: column {name!r}: corrupt list offsets ({int(offsets[0])}..."
            f"{int(offsets[-1])} outside the {len(values)} values)"
        )
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
