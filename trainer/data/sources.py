"""Where conversations come from: JSONL, JSON, Parquet, Arrow files, Hugging Face
``save_to_disk`` folders or folders of them, read in chunks of raw rows."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias

import pyarrow as pa

from loader_server.wire.files import file_error, read_json
from trainer.data.corpus import REPORT_NAME
from trainer.data.messages import CONV_KEYS, MalformedRow, as_row, not_object, short

log = logging.getLogger(__name__)

_JSONL, _JSON, _PARQUET, _ARROW = (
    (".jsonl", ".ndjson"),
    (".json",),
    (".parquet", ".pq"),
    (".arrow",),
)
_DATA_KEYS = ("data", "rows", "examples", "train", "items")
CHUNK_ROWS = 256  # rows per chunk at most (read_chunks)


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # jsonl | json | parquet | arrow | hf


def read_rows(sources: Sequence[str | Path]) -> Iterator[tuple[str, int, dict | MalformedRow]]:
    """``(file, row index in that file, row)`` over every row of the sources, in order.

    Sources are JSONL, JSON (a list of rows, or an object holding one under ``data``/
    ``rows``/``examples``/``train``/``items``), Parquet, Arrow files, Hugging Face
    ``save_to_disk`` folders, or folders of those (name order, recursively; hidden entries
    and folders holding a ``tokenize_report.json`` are skipped; each file is read once, see
    ``expand_sources``). A row that is not valid JSON, or not an object, comes back as a
    ``MalformedRow`` instead of raising. For JSONL the row index is the 0-based line number;
    blank lines are not rows.
    """
    return source_rows(expand_sources(sources))


def source_rows(files: list[Source]) -> Iterator[tuple[str, int, dict | MalformedRow]]:
    """``read_rows`` of what ``expand_sources`` found."""
    for where, payload in read_chunks(files, CHUNK_ROWS):
        for (name, i), raw in zip(where, payload_rows(payload), strict=True):
            try:
                yield name, i, as_row(raw)
            except MalformedRow as e:
                yield name, i, e


def expand_sources(sources: Sequence[str | Path]) -> list[Source]:
    """Every input file (or datasets folder) of the sources, in order, each once.

    Folder walks follow links to files and folders but never read the same file or folder
    twice: a link to a folder already walked (a loop such as ``sub/up -> ..``), a second
    link to a file already read, a broken link, and a source named twice are skipped, and
    one warning names them."""
    seen: dict[tuple[int, int], Path] = {}
    skipped: list[str] = []
    out: list[Source] = []
    for s in sources:
        path = Path(s)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if path.is_dir():
            before = len(skipped)
            found = _expand_dir(path, seen, skipped)
            if not found and len(skipped) == before:
                raise ValueError(f"{path}: no .jsonl, .json, .parquet or .arrow files in folder")
            out.extend(found)
        else:
            src = _file_source(path, explicit=True)
            if src is not None and _first_visit(path, seen, skipped):
                out.append(src)
    if skipped:
        shown = "; ".join(skipped[:10]) + (
            f"; and {len(skipped) - 10} more" if skipped[10:] else ""
        )
        log.warning("read once: skipped %d link(s) or repeated input(s): %s", len(skipped), shown)
    if not out:
        raise ValueError(f"{', '.join(map(str, sources))}: no input left to read (see the warning)")
    return out


def _first_visit(path: Path, seen: dict[tuple[int, int], Path], skipped: list[str]) -> bool:
    """Whether ``path`` (a file or folder, links followed) is read for the first time; a
    repeat is added to ``skipped``."""
    try:
        st = path.stat()
    except OSError:  # a broken link, or a loop of links
        skipped.append(f"{path} (-> {_link_target(path)}, a link to nothing)")
        return False
    key = (st.st_dev, st.st_ino)
    first = seen.get(key)
    if first is None:
        seen[key] = path
        return True
    how = f"-> {_link_target(path)}, " if path.is_symlink() else ""
    skipped.append(f"{path} ({how}already read as {first})")
    return False


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _expand_dir(path: Path, seen: dict[tuple[int, int], Path], skipped: list[str]) -> list[Source]:
    if not _first_visit(path, seen, skipped):
        return []
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path}: a DatasetDict folder (splits {splits}); pass one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
        return [Source(path, "hf")]
    out: list[Source] = []
    try:
        entries = sorted(path.iterdir())
    except OSError as e:
        raise ValueError(f"{path}: cannot list the folder ({e.strerror or e})") from e
    for p in entries:
        if p.name.startswith(".") or (p / REPORT_NAME).is_file():  # hidden, or our own output
            continue
        if p.is_dir():
            out.extend(_expand_dir(p, seen, skipped))
        elif (src := _file_source(p, explicit=False)) is not None and _first_visit(
            p, seen, skipped
        ):
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
    sources: list[Source], size: int, limit: int | None = None, max_bytes: int | None = None
) -> Iterator[tuple[list[tuple[str, int]], Payload]]:
    """Chunks of at most ``size`` raw rows, ``(where, payload)``; a chunk never spans files.

    With ``max_bytes``, a chunk also ends at about that many bytes of row payload: a JSONL
    chunk with the line that reaches it; JSON, Parquet and Arrow rows count at the mean
    size of their file or read batch (of ``size`` rows). The cuts depend only on the input.
    """
    left = limit
    for src in sources:
        for idx, payload in _reading(src, _READERS[src.kind](src.path, size, max_bytes)):
            if left is not None:
                if left <= 0:
                    return
                idx, payload = idx[:left], payload[:left]
                left -= len(idx)
            yield [(str(src.path), i) for i in idx], payload


def _reading(
    src: Source, chunks: Iterator[tuple[list[int], Payload]]
) -> Iterator[tuple[list[int], Payload]]:
    """A reader's chunks; an error reading the source (permissions, a file that went away,
    a corrupt Parquet page) becomes one line naming it."""
    try:
        yield from chunks
    except (OSError, pa.ArrowException) as e:  # ArrowInvalid: a corrupt page, mid-file
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{src.path}: cannot read it ({why})") from e


def _step(rows: int, nbytes: int, max_bytes: int | None) -> int:
    """Rows per chunk for ``rows`` rows of ``nbytes`` bytes in all (at least 1)."""
    if max_bytes is None or nbytes <= max_bytes:
        return max(rows, 1)
    return max(1, rows * max_bytes // nbytes)


def _by_bytes(
    chunks: Iterator[tuple[list[int], pa.Table]], max_bytes: int | None
) -> Iterator[tuple[list[int], pa.Table]]:
    """Each table cut into pieces of about ``max_bytes``, its rows at their mean size."""
    for idx, table in chunks:
        step = _step(len(idx), table.nbytes, max_bytes)
        for lo in range(0, len(idx), step):
            yield idx[lo : lo + step], table.slice(lo, step)


def _jsonl_chunks(
    path: Path, size: int, max_bytes: int | None = None
) -> Iterator[tuple[list[int], list]]:
    budget = max_bytes or sys.maxsize
    idx: list[int] = []
    lines: list[bytes] = []
    held = 0
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if line.isspace():
                continue
            idx.append(i)
            lines.append(line)
            held += len(line)
            if len(lines) == size or held >= budget:
                yield idx, lines
                idx, lines, held = [], [], 0
    if lines:
        yield idx, lines


def _json_chunks(
    path: Path, size: int, max_bytes: int | None = None
) -> Iterator[tuple[list[int], list]]:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except ValueError as e:
        if "Extra data" in str(e):  # JSON Lines under a .json name
            yield from _jsonl_chunks(path, size, max_bytes)
            return
        raise file_error(path, "JSON (a list of rows, or one under rows or data)", e) from e
    except RecursionError:
        raise ValueError(
            f"{path}: JSON nested too deeply to read (more than ~{sys.getrecursionlimit()} "
            "levels): not a list of conversation rows"
        ) from None
    rows = _json_rows(path, data)
    step = min(size, _step(len(rows), path.stat().st_size, max_bytes))
    for lo in range(0, len(rows), step):
        yield list(range(lo, min(lo + step, len(rows)))), rows[lo : lo + step]


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


def _parquet_chunks(
    path: Path, size: int, max_bytes: int | None = None
) -> Iterator[tuple[list[int], pa.Table]]:
    yield from _by_bytes(_parquet_batches(path, size), max_bytes)


def _parquet_batches(path: Path, size: int) -> Iterator[tuple[list[int], pa.Table]]:
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


def _arrow_chunks(
    path: Path, size: int, max_bytes: int | None = None
) -> Iterator[tuple[list[int], pa.Table]]:
    yield from _by_bytes(_table_chunks(path, _read_arrow(path), size), max_bytes)


def _read_arrow(path: Path) -> pa.Table:
    source = pa.memory_map(str(path), "r")
    try:
        if source.read(6) == b"ARROW1":
            source.seek(0)
            return pa.ipc.open_file(source).read_all()
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise file_error(path, "a readable Arrow IPC file or stream", e) from e


def _table_chunks(path: Path, table: pa.Table, size: int) -> Iterator[tuple[list[int], pa.Table]]:
    table = table.select(_conv_columns(path, table.column_names))
    for lo in range(0, table.num_rows, size):
        yield list(range(lo, min(lo + size, table.num_rows))), table.slice(lo, size)


def _hf_chunks(
    path: Path, size: int, max_bytes: int | None = None
) -> Iterator[tuple[list[int], pa.Table]]:
    yield from _by_bytes(_hf_tables(path, size), max_bytes)


def _hf_tables(path: Path, size: int) -> Iterator[tuple[list[int], pa.Table]]:
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
    try:
        files = [path / d["filename"] for d in read_json(state)["_data_files"]]
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise ValueError(f"{state}: not a datasets state.json listing _data_files ({e!r})") from e
    return pa.concat_tables([_read_arrow(f) for f in files])


_READERS: dict[str, Callable[[Path, int, int | None], Iterator[tuple[list[int], Payload]]]] = {
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


def input_bytes(sources: list[Source]) -> int:
    """The sources' size on disk in bytes (a datasets folder: all its files)."""
    return sum(
        sum(p.stat().st_size for p in src.path.rglob("*") if p.is_file())
        if src.kind == "hf"
        else src.path.stat().st_size
        for src in sources
    )


def fingerprints(sources: list[Source]) -> dict[str, dict[str, Any]]:
    """What each input file is now, by resolved path: ``{"size", "mtime_ns", "blake2b"}``
    (the content's BLAKE2b-128, streamed). A datasets folder counts as all its files."""
    out: dict[str, dict[str, Any]] = {}
    for src in sources:
        files = (
            [src.path]
            if src.kind != "hf"
            else sorted(p for p in src.path.rglob("*") if p.is_file())
        )
        for path in files:
            out[str(path.resolve())] = fingerprint(path)
    return out


def fingerprint(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from e
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "blake2b": digest}


def fingerprint_change(old: Any, new: dict[str, Any]) -> str:
    """How an input with fingerprint ``new`` differs from ``old``, "" when it does not: its
    size or its content changed. The same content with a new mtime (copied, touched) is
    the same input."""
    if not isinstance(old, dict):
        return f"has an unreadable fingerprint ({short(old)})"
    if old.get("size") != new["size"]:
        return f"changed size ({old.get('size')} -> {new['size']} bytes)"
    if old.get("blake2b") != new["blake2b"]:
        return "changed content (same size, another BLAKE2b digest)"
    return ""


def changed_since(old: dict[str, Any], path: Path) -> str:
    """``fingerprint_change`` of ``path`` as it is now, for a check during a run: an
    unchanged size and mtime is taken as unchanged without reading the file again."""
    try:
        st = path.stat()
    except OSError:
        return "is gone"
    if st.st_size == old.get("size") and st.st_mtime_ns == old.get("mtime_ns"):
        return ""
    return fingerprint_change(old, fingerprint(path))
