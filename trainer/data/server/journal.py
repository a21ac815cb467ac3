"""The journal of finished rows (``OUT.regen.jsonl``): one JSON line per row, flushed;
a restarted run reads it back and skips what finished."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOURNAL_SUFFIX = ".regen.jsonl"
JOURNAL_VERSION = 1


def journal_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + JOURNAL_SUFFIX)


class Journal:
    """Append-only JSONL of finished rows; the first line is the run's settings.

    In memory: each row's newest record without its messages (``records``) and where its
    line is (``messages`` reads it back), so a journal of a million conversations costs
    only the bookkeeping."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header = Path(path), header
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self._where: dict[tuple[str, int], tuple[int, int]] = {}
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_header()
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = self._file.seek(0, os.SEEK_END)
        self._lock = threading.Lock()

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        if torn:
            log.warning("%s: cutting a torn last line (%d bytes)", self.path, len(torn))
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(torn))
        if not lines:  # killed while writing the settings line
            self._write_header()
            return
        self._check_header(self._parse(lines[0], 1))
        offset = len(lines[0]) + 1
        for k, line in enumerate(lines[1:], 2):
            self._keep(self._parse(line, k), offset, len(line))
            offset += len(line) + 1

    def _keep(self, rec: dict[str, Any], offset: int, size: int) -> None:
        key = (rec["file"], rec["row"])
        messages = rec.pop("messages", None)
        if messages is not None:
            replies = (m["content"] for m in messages if m["role"] == "assistant")
            rec["empty_reply"] = any(not r.strip() for r in replies)
        self.records[key] = rec
        self._where[key] = (offset, size)

    def _write_header(self) -> None:
        self.path.write_text(json.dumps({"journal": JOURNAL_VERSION, **self.header}) + "\n")

    def _parse(self, line: bytes, k: int) -> dict[str, Any]:
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{self.path}:{k}: not a JSON line ({e}); the journal is damaged"
            ) from e
        if k > 1 and not {"file", "row", "status"} <= set(rec):
            raise ValueError(f"{self.path}:{k}: a record needs file, row and status")
        return rec

    def _check_header(self, old: dict[str, Any]) -> None:
        if old.get("journal") != JOURNAL_VERSION:
            raise ValueError(f"{self.path}: not a regen journal (version {old.get('journal')})")
        diff = {k: (old.get(k), v) for k, v in self.header.items() if old.get(k) != v}
        if diff:
            what = "; ".join(f"{k}: journal {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{self.path} was written with other settings ({what}): use another OUT, "
                "or delete the journal to start over"
            )

    def append(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, ensure_ascii=False).encode()
        with self._lock:
            self._file.write(line + b"\n")
            self._file.flush()
            self._keep(dict(rec), self._size, len(line))
            self._size += len(line) + 1

    def messages(self, keys: list[tuple[str, int]]) -> Iterator[list[dict[str, str]]]:
        """The regenerated conversations of finished rows, read back from the file."""
        with open(self.path, "rb") as f:
            for key in keys:
                offset, size = self._where[key]
                f.seek(offset)
                yield json.loads(f.read(size))["messages"]

    def close(self) -> None:
        self._file.close()

    def finished(self, key: tuple[str, int]) -> bool:
        rec = self.records.get(key)
        return rec is not None and rec["status"] == "ok"
