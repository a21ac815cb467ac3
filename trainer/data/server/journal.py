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

from trainer.data.messages import short
from trainer.data.sources import fingerprint_change

log = logging.getLogger(__name__)

JOURNAL_SUFFIX = ".regen.jsonl"
JOURNAL_VERSION = 1


def journal_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + JOURNAL_SUFFIX)


class Journal:
    """Append-only JSONL of finished rows; the first line is the run's settings (and the
    fingerprints of its inputs, ``trainer.data.sources.fingerprints``).

    In memory: each row's newest record without its messages (``records``) and where its
    line is (``messages`` reads it back), so a journal of a million conversations costs
    only the bookkeeping.

    Opening an existing journal checks it against this run: the settings must be the same
    and, with ``inputs``, every input file the same size and content as when it was written
    (one line names the first that differs). A journal written without fingerprints (by an
    older version) is refused too: nothing says its rows are this input's rows.
    ``restart`` discards an existing journal instead. Every line of the wrong shape is one
    error naming the journal and the line."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        *,
        inputs: dict[str, dict[str, Any]] | None = None,
        restart: bool = False,
    ) -> None:
        self.path, self.header, self.inputs = Path(path), header, inputs
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self._where: dict[tuple[str, int], tuple[int, int]] = {}
        if restart and (self.path.exists() or self.path.is_symlink()):
            log.warning("--restart: discarding %s; every row is regenerated", self.path)
            self.path.unlink()
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
        if rec["status"] == "ok":
            rec.setdefault("finish_reasons", [])
            rec.setdefault("completion_tokens", 0)
        self.records[key] = rec
        self._where[key] = (offset, size)

    def _write_header(self) -> None:
        inputs = {} if self.inputs is None else {"inputs": self.inputs}
        line = {"journal": JOURNAL_VERSION, **self.header, **inputs}
        self.path.write_text(json.dumps(line) + "\n")

    def _parse(self, line: bytes, k: int) -> dict[str, Any]:
        where = f"{self.path}:{k}"
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deeply
            what = str(e) if isinstance(e, ValueError) else "nested too deeply"
            raise ValueError(f"{where}: not a JSON line ({what}); the journal is damaged") from e
        problem = record_problem(rec) if k > 1 else header_problem(rec)
        if problem:
            raise ValueError(
                f"{where}: {problem}; the journal is damaged (--restart discards it and "
                "regenerates every row)"
            )
        return rec

    def _check_header(self, old: dict[str, Any]) -> None:
        diff = {k: (old.get(k), v) for k, v in self.header.items() if old.get(k) != v}
        if diff:
            what = "; ".join(f"{k}: journal {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{self.path} was written with other settings ({what}): use another OUT, "
                "or --restart to discard the journal and regenerate every row"
            )
        if self.inputs is not None:
            self._check_inputs(old.get("inputs"))

    def _check_inputs(self, old: Any) -> None:
        """Refuse to resume when an input is not what the journal's rows were read from."""
        again = "--restart discards the journal and regenerates every row"
        if not isinstance(old, dict):
            raise ValueError(
                f"{self.path} records no fingerprints of its inputs (an older dflash-train "
                f"wrote it): whether they changed since is unknown; {again}"
            )
        now = self.inputs or {}
        for name in sorted(set(old) | set(now)):
            if name not in now:
                how = "is not among the inputs any more"
            elif name not in old:
                how = "is a new input"
            else:
                how = fingerprint_change(old[name], now[name])
            if how:
                raise ValueError(
                    f"{name} {how} since {self.path} was written: the finished rows may not "
                    f"be this input's rows; restore it, or {again}"
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


def header_problem(rec: Any) -> str:
    """What is wrong with a journal's first line ("" when nothing)."""
    if not isinstance(rec, dict):
        return f"the settings line is a JSON {type(rec).__name__}, not an object"
    if rec.get("journal") != JOURNAL_VERSION:
        return f"not a regen journal (version {short(rec.get('journal'))})"
    return ""


def record_problem(rec: Any) -> str:
    """What is wrong with a row's record ("" when nothing): the shape ``append`` writes."""
    if not isinstance(rec, dict):
        return f"a record is a JSON {type(rec).__name__}, not an object"
    if not {"file", "row", "status"} <= set(rec):
        return "a record needs file, row and status"
    fields: dict[str, Any] = {"file": str, "row": int, "status": str}
    if rec["status"] == "ok":
        fields.update(messages=list, finish_reasons=(list, None), completion_tokens=(int, None))
    elif rec["status"] == "failed":
        fields.update(reason=str, detail=str)
    else:
        return f"status is {short(rec['status'])}, not 'ok' or 'failed'"
    for name, kinds in fields.items():
        value = rec.get(name)
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if value is None and None in kinds:
            continue
        types = tuple(k for k in kinds if k is not None)
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join(t.__name__ for t in types)
            return f"{name} is {short(value)}, not {want}"
    if rec["status"] == "ok":
        for j, m in enumerate(rec["messages"]):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                return f"message {j} is {short(m)}, not {{role, content}} strings"
        if any(not isinstance(f, str) for f in rec.get("finish_reasons") or []):
            return "finish_reasons holds a non-string"
    return ""
