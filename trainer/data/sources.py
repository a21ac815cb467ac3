"""Where conversations come from: JSONL, JSON, Parquet, Arrow files, Hugging Face
``save_to_disk`` folders or folders of them, read in chunks of raw rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias

import pyarrow as pa

from trainer.data.corpus import REPORT_NAME
from trainer.data.messages import CONV_KEYS, MalformedRow, as_row, not_object

_JSONL, _JSON, _PARQUET, _ARROW = (
    (".jsonl", ".ndjson"),
    (".json",),
    (".parquet", ".pq"),
    (".arrow",),
)
_DATA_KEYS = ("data", "rows", "examples", "train", "items")
CHUNK_ROWS = 256  # rows per worker task: ~0.5 s of work at 1K tokens per row


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # jsonl | json | parquet | arrow | hf


def read_rows(sources: Sequence[str | Path]) -> Iterator[tuple[str, int, dict | MalformedRow]]:
    """``(file, row index in that file, row)`` over every row of the sources, in order.

    Sources are JSONL, JSON (a list of rows, or an object holding one under ``data``/
    ``rows``/``examples``/``train``/``items``), Parquet, Arrow files, Hugging Face
    ``save_to_disk`` folders, or folders of those (name order, recursively; hidden entries
    and folders holding a ``tokenize_report.json`` are skipped). A row that is not
    valid JSON, or not an object, comes back as a ``MalformedRow`` instead of raising. For
    JSONL the row index is the 0-based line number; blank lines are not rows.
    """
    for where, payload in read_chunks(expand_sources(sources), CHUNK_ROWS):
        for (name, i), raw in zip(where, payload_rows(payload), strict=True):
            try:
                yield name, i, as_row(raw)
            except MalformedRow as e:
                yield name, i, e


def expand_sources(sources: Sequence[str | Path]) -> list[Source]:
    """Every input file (or datasets folder) of the sources, in order."""
    out: list[Source] = []
    for s in sources:
        path = Path(s)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        found = _expand_dir(path) if path.is_dir() else [_file_source(path, explicit=True)]
        if not found:
            raise ValueError(f"{path}: no .jsonl, .json, .parquet or .arrow files in folder")
        out.extend(x for x in found if x is not None)
    return out


def _expand_dir(path: Path) -> list[Source | None]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path}: a DatasetDict folder (splits {splits}); pass one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
        return [Source(path, "hf")]
    out: list[Source | None] = []
    for p in sorted(path.iterdir()):
        if p.name.startswith(".") or (p / REPORT_NAME).is_file():  # hidden, or our own output
            continue
        if p.is_dir():
            out.extend(_expand_dir(p))
        elif (src := _file_source(p, explicit=False)) is not None:
            out.append(src)
    return out


def _file_source(path: Path, *, explicit: bool) -> Source | None:
    suffix = path.suffix.lower()
    for kind, suffixes in (("jsonl", _JSONL), ("json", _JSON), ("parquet", _PARQUET)):
        if suffix in suffixes:
            return Source(path, kind)
    if suffix in _ARROW:
        return Source(path, "arrow")
    if explicit:
        raise ValueError(
            f"{path}: unsupported input format {suffix or '(no suffix)'} "
            f"(want .jsonl, .json, .parquet, .arrow or a datasets save_to_disk folder)"
        )
    return None


Payload: TypeAlias = list | pa.Table  # a chunk of raw rows: JSONL lines, dicts, or an Arrow table


def read_chunks(
    sources: list[Source], size: int, limit: int | None = None
) -> Iterator[tuple[list[tuple[str, int]], Payload]]:
    """Chunks of at most ``size`` raw rows, ``(where, payload)``; a chunk never spans files."""
    left = limit
    for src in sources:
        for idx, payload in _READERS[src.kind](src.path, size):
            if left is not None:
                if left <= 0:
                    return
                idx, payload = idx[:left], payload[:left]
                left -= len(idx)
            yield [(str(src.path), i) for i in idx], payload


def _jsonl_chunks(path: Path, size: int) -> Iterator[tuple[list[int], list]]:
    idx: list[int] = []
    lines: list[bytes] = []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            idx.append(i)
            lines.append(line)
            if len(lines) == size:
                yield idx, lines
                idx, lines = [], []
    if lines:
        yield idx, lines


def _json_chunks(path: Path, size: int) -> Iterator[tuple[list[int], list]]:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except ValueError as e:
        if "Extra data" in str(e):  # JSON Lines under a .json name
            yield from _jsonl_chunks(path, size)
            return
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    rows = _json_rows(path, data)
    for lo in range(0, len(rows), size):
        yield list(range(lo, min(lo + size, len(rows)))), rows[lo : lo + size]


def _json_rows(path: Path, data: Any) -> list:
    if isinstance(data, list):
        return [r if isinstance(r, dict) else not_object(r) for r in data]
    if isinstance(data, dict):
        if any(k in data for k in CONV_KEYS):
            return [data]
        for key in _DATA_KEYS:
            if isinstance(data.get(key), list):
                return _json_rows(path, data[key])
        raise ValueError(f"{path}: a JSON object without a list of rows under {_DATA_KEYS}")
    raise ValueError(f"{path}: JSON holds a {type(data).__name__}, not a list of rows")


def _conv_columns(path: Path, names: Sequence[str]) -> list[str]:
    cols = [c for c in CONV_KEYS if c in names]
    if not cols:
        raise ValueError(f"{path}: no 'messages' or 'conversations' column (columns {names})")
    return cols


def _parquet_chunks(path: Path, size: int) -> Iterator[tuple[list[int], pa.Table]]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    cols = _conv_columns(path, f.schema_arrow.names)
    lo = 0
    for batch in f.iter_batches(batch_size=size, columns=cols):
        yield list(range(lo, lo + batch.num_rows)), pa.Table.from_batches([batch])
        lo += batch.num_rows


def _arrow_chunks(path: Path, size: int) -> Iterator[tuple[list[int], pa.Table]]:
    yield from _table_chunks(path, _read_arrow(path), size)


def _read_arrow(path: Path) -> pa.Table:
    source = pa.memory_map(str(path), "r")
    try:
        if source.read(6) == b"ARROW1":
            source.seek(0)
            return pa.ipc.open_file(source).read_all()
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow IPC file ({e})") from e


def _table_chunks(path: Path, table: pa.Table, size: int) -> Iterator[tuple[list[int], pa.Table]]:
    table = table.select(_conv_columns(path, table.column_names))
    for lo in range(0, table.num_rows, size):
        yield list(range(lo, min(lo + size, table.num_rows))), table.slice(lo, size)


def _hf_chunks(path: Path, size: int) -> Iterator[tuple[list[int], pa.Table]]:
    """A ``save_to_disk`` folder: ``datasets.load_from_disk`` (honours an indices mapping)
    when ``datasets`` is installed, else the Arrow shards listed in ``state.json``."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is None:
        yield from _table_chunks(path, _hf_shards(path), size)
        return
    ds = datasets.load_from_disk(str(path))
    ds = ds.select_columns(_conv_columns(path, ds.column_names))
    lo = 0
    for table in ds.with_format("arrow").iter(batch_size=size):
        yield list(range(lo, lo + table.num_rows)), table
        lo += table.num_rows


def _hf_shards(path: Path) -> pa.Table:
    state = path / "state.json"
    if not state.is_file():
        raise ValueError(
            f"{path}: reading this datasets folder needs the `datasets` package "
            f"(pip install datasets): it has no state.json listing its shards"
        )
    files = [path / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    return pa.concat_tables([_read_arrow(f) for f in files])


_READERS: dict[str, Callable[[Path, int], Iterator[tuple[list[int], Payload]]]] = {
    "jsonl": _jsonl_chunks,
    "json": _json_chunks,
    "parquet": _parquet_chunks,
    "arrow": _arrow_chunks,
    "hf": _hf_chunks,
}


def payload_rows(payload: Payload) -> list:
    return payload.to_pylist() if isinstance(payload, pa.Table) else payload


def count_rows(sources: list[Source]) -> int | None:
    """Rows to expect, for the progress bar (None when it would cost a parse)."""
    total = 0
    for src in sources:
        if src.kind == "jsonl":
            with open(src.path, "rb") as f:
                total += sum(block.count(b"\n") for block in iter(partial(f.read, 1 << 24), b""))
        elif src.kind == "parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(src.path).metadata.num_rows
        else:
            return None
    return total
