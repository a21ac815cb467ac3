"""Conversations as messages: one ShareGPT or OpenAI row -> ``[{"role", "content"}]``,
and the error a row that cannot become a training sample raises."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping
from typing import Any, cast

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "claude": "assistant",
    "model": "assistant",
}
CONV_KEYS = ("messages", "conversations")


class MalformedRow(ValueError):
    """A row that cannot become a training sample; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (MalformedRow, (self.reason, self.detail))


def to_messages(row: Mapping, *, require_assistant: bool = True) -> list[dict[str, str]]:
    """A ShareGPT or OpenAI row as ``[{"role", "content"}]`` with roles system/user/assistant.
    ``require_assistant=False`` accepts a prompt-only row (no assistant turn).

    Any value of any type and nesting comes back as messages or raises MalformedRow,
    never another error.

    Raises:
        MalformedRow: missing_messages, bad_shape, empty, unknown_role, non_string_content,
            bad_text (a lone surrogate: not UTF-8 text), empty_assistant or
            no_assistant_turn.
    """
    if not isinstance(row, Mapping):
        raise MalformedRow("bad_shape", f"row is a {type(row).__name__}, not an object")
    key = next((k for k in CONV_KEYS if row.get(k) is not None), None)
    if key is None:
        raise MalformedRow(
            "missing_messages", f"no 'messages' or 'conversations' in {key_list(row)}"
        )
    return normalize(row[key], key, require_assistant=require_assistant)


def normalize(turns: Any, key: str, *, require_assistant: bool) -> list[dict[str, str]]:
    if not isinstance(turns, (list, tuple)):
        raise MalformedRow("bad_shape", f"'{key}' is a {type(turns).__name__}, not a list")
    if not turns:
        raise MalformedRow("empty", f"'{key}' is an empty list")
    messages = [_message(turn, k) for k, turn in enumerate(turns)]
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise MalformedRow("no_assistant_turn", f"roles {roles}")
    return messages


def _message(turn: Any, k: int) -> dict[str, str]:
    if not isinstance(turn, Mapping):
        raise MalformedRow("bad_shape", f"message {k} is a {type(turn).__name__}, not an object")
    role = _first(turn, "role", "from")
    if role is None:
        raise MalformedRow(
            "bad_shape", f"message {k} has no 'role' or 'from' (keys {key_list(turn)})"
        )
    norm = ROLES.get(role.lower()) if isinstance(role, str) else None
    if norm is None:
        raise MalformedRow("unknown_role", f"message {k} has role {short(role)}")
    if _first(turn, "content", "value") is None and not ({"content", "value"} & set(turn)):
        raise MalformedRow("bad_shape", f"message {k} has no 'content' or 'value'")
    content = _text(_first(turn, "content", "value"), k)
    if norm == "assistant" and not content.strip():
        raise MalformedRow("empty_assistant", f"message {k} (assistant) has empty content")
    return {"role": norm, "content": content}


def _text(value: Any, k: int) -> str:
    """Message content: a string, or OpenAI content parts that are all text."""
    if isinstance(value, str):
        return checked_text(value, f"message {k} content")
    if isinstance(value, (list, tuple)) and value:
        parts = [p.get("text") if isinstance(p, Mapping) else None for p in value]
        if all(isinstance(p, str) for p in parts):
            return checked_text("".join(cast(list[str], parts)), f"message {k} content")
    raise MalformedRow("non_string_content", f"message {k} content is {short(value)}")


def checked_text(text: str, what: str) -> str:
    """``text`` if it can be UTF-8 encoded (what a tokenizer and a JSON line need); a lone
    surrogate (JSON's ``"\\ud800"``) raises MalformedRow ``bad_text``."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise MalformedRow(
                "bad_text", f"{what} holds {e.object[e.start : e.end]!r} at {e.start}: not text"
            ) from None
    return text


def _first(d: Mapping, *keys: str) -> Any:
    return next((d[k] for k in keys if d.get(k) is not None), None)


def key_list(d: Mapping) -> str:
    names = sorted(map(str, d))
    return "{" + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") + "}"


def short(value: Any, width: int = 60) -> str:
    """A value for an error message: its repr, clipped (bounded in depth and size, so a
    huge or deeply nested value costs no more than a small one)."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother = 3, width, width
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = 6
    try:
        text = shown.repr(value)
    except (RecursionError, ValueError):  # a hostile __repr__, or a huge int
        text = f"<{type(value).__name__}>"
    return clip(text, width)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Everything before the first assistant turn (a held-out prompt's messages)."""
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first]


def as_row(raw: Any) -> dict:
    """A raw row (a JSON line, or an already decoded value) as a dict; MalformedRow
    (``bad_json``, ``bad_shape``) otherwise, never another error."""
    if isinstance(raw, MalformedRow):
        raise raw
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise MalformedRow("bad_json", clip(str(e), 100)) from None
        except RecursionError:
            raise MalformedRow("bad_json", "nested too deeply to decode") from None
    if not isinstance(raw, dict):
        raise not_object(raw)
    return raw


def not_object(value: Any) -> MalformedRow:
    return MalformedRow("bad_shape", f"row is a {type(value).__name__}, not an object")
