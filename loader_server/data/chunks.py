"""One Arrow record batch of a mapped shard, read into a checked, zero-copy ``Chunk``.

``read_shard`` reads every record batch of one IPC file (file or stream format) without
copying token data, and checks what the native fill will trust: the schema (an
``input_ids`` list column of int32/int64/uint32, an optional ``loss_mask`` list column of
an integer or bool type), Arrow's own structure check, list offsets that never decrease or
leave their values, no null lists or values, a mask as long as its ids. ``scan_values``
scans the token data itself (ids in ``[0, vocab)``, masks in {0, 1}); ``check_uniform``
asks every shard to store the same column types. Every error names the file, the column
and the row (``DatasetError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loader_server.data.shards import ShardFile

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


class DatasetError(Exception):
    """A dataset that cannot be served; the message names the file, column and row."""


@dataclass(frozen=True)
class Chunk:
    """One record batch: zero-copy views of its list values and absolute offsets."""

    path: Path
    first_row: int  # row index of this batch's first row within its file
    ids_values: np.ndarray
    ids_offsets: np.ndarray  # int64, len rows+1, absolute positions into ids_values
    mask_values: np.ndarray | None  # int8/uint8 view, or None (no mask column)
    mask_offsets: np.ndarray | None
    mask_bits: pa.Buffer | None  # bool masks are bit-packed: unpacked per sample
    mask_bit_offset: int


def value_bytes(chunks: list[Chunk]) -> int:
    """Bytes of token data a value scan reads (ids and a non-bool mask)."""
    total = 0
    for c in chunks:
        total += int(c.ids_offsets[-1] - c.ids_offsets[0]) * c.ids_values.dtype.itemsize
        if c.mask_values is not None and c.mask_offsets is not None:
            total += int(c.mask_offsets[-1] - c.mask_offsets[0]) * c.mask_values.dtype.itemsize
    return total


#: What a closed Arrow IPC stream ends with: a continuation marker and a zero length. A
#: stream cut at a record batch's end reads without error, so only this tells it.
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _record_batches(shard: ShardFile) -> list[pa.RecordBatch]:
    """Read all record batches of one IPC file (file or stream format) zero-copy; a stream
    must end with its end-of-stream marker."""
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
            if source.size() < 8 or source.read_at(8, source.size() - 8) != END_OF_STREAM:
                rows = sum(b.num_rows for b in batches)
                raise DatasetError(
                    f"{path}: Arrow IPC stream has no end-of-stream marker: cut short (its "
                    f"writer stopped before closing it?) after {len(batches)} record batches "
                    f"({rows:,} rows); write it again, or close the writer"
                )
        for batch in batches:
            batch.schema.names  # noqa: B018 - decodes every field name (may be corrupt)
        return batches
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: bad UTF-8 names
        kind = "Arrow IPC file" if head[:6] == b"ARROW1" else "Arrow IPC stream"
        raise DatasetError(
            f"{path}: truncated, corrupt or not an {kind} ({_one_line(e)})"
        ) from None


def read_shard(shard: ShardFile) -> list[Chunk]:
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
        if schema.names.count(name) > 1:
            raise DatasetError(
                f"{path}: column {name!r} appears {schema.names.count(name)} times "
                f"(columns: {schema.names}); a corpus needs exactly one"
            )
        t = schema.field(name).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or t.value_type not in allowed:
            want = ", ".join(f"list<{a}>" for a in allowed)
            raise DatasetError(
                f"{path}: column {name!r} has type {_type_name(t)}, expected one of {want}"
            )


def check_uniform(chunks: list[Chunk]) -> None:
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


def _mask_type(c: Chunk) -> str:
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


def _chunk(path: Path, batch: pa.RecordBatch, first_row: int) -> Chunk:
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
    return Chunk(
        path, first_row, ids_values, ids_offsets, mask_values, mask_offsets, mask_bits, bit_offset
    )


def scan_values(c: Chunk, vocab_size: int | None) -> None:
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


def unpack_bits(buf: pa.Buffer, bit_start: int, n: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8)
    first, last = bit_start // 8, (bit_start + n + 7) // 8
    bits = np.unpackbits(raw[first:last], bitorder="little")
    skip = bit_start - first * 8
    return bits[skip : skip + n]
