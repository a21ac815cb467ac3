"""Reading a user's file: one place where a parse error becomes ``PATH: what is wrong``.

Every command of the project reads files people write or copy around: JSON configs and
records, TOML configs, safetensors weights, Arrow corpora. A parser's own message
(``Expecting ',' delimiter: line 1 column 58 (char 57)``, ``incomplete metadata``) names
neither the file nor, often, what kind of file it expected; reaching a user as is, it
leaves them to guess which of several files is at fault. ``file_error`` turns any such
exception into one ``ValueError`` naming the path, what the file should be, and the line
and column where the parser gives them; ``read_json`` and ``read_toml`` read through it.
The callers that parse safetensors (the trainer) and Arrow (the daemon, the trainer) hand
their parser's exception to ``file_error`` the same way.

Pure Python (the wire's rule: both sides import it, the client too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib


def file_error(path: str | Path, what: str, error: BaseException) -> ValueError:
    """``PATH: not WHAT (the parser's reason, at line L column C)`` as a ValueError: raise it
    ``from None`` where the parse failed. ``what``: what the file should be ("JSON", "a
    drafter's config.json", "safetensors weights", "an Arrow IPC file")."""
    reason = _reason(error)
    return ValueError(f"{path}: not {what} ({reason})" if reason else f"{path}: not {what}")


def _reason(error: BaseException) -> str:
    """The parser's reason in one line, its position in the file's own terms."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    if isinstance(error, tomllib.TOMLDecodeError):
        return str(error)  # "Expected '=' ... (at line 3, column 7)"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text: byte {error.start} is 0x{error.object[error.start]:02x}"
    text = " ".join(str(error).split())
    return text or type(error).__name__


def read_text(path: str | Path, what: str) -> str:
    """The file as UTF-8 text; an unreadable file is ``OSError`` as the OS says it (it
    names the path), bytes that are not UTF-8 a ``file_error``."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise file_error(path, what, e) from None


def read_json(path: str | Path, what: str = "JSON") -> Any:
    """The JSON value of ``path``; a parse error is ``PATH: not WHAT (reason at line L
    column C)``."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as e:
        raise file_error(path, what, e) from None


def read_toml(path: str | Path, what: str = "TOML") -> dict[str, Any]:
    """The TOML table of ``path``; a parse error names the file, the line and the column."""
    try:
        return tomllib.loads(read_text(path, what))
    except tomllib.TOMLDecodeError as e:
        raise file_error(path, what, e) from None
