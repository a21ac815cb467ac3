"""Chat conversations in, a loader corpus out (``dflash-train tokenize``).

Input rows are ShareGPT (``{"conversations": [{"from", "value"}]}``) or OpenAI
(``{"messages": [{"role", "content"}]}``) conversations, read from JSONL, JSON, Parquet or
Hugging Face ``save_to_disk`` folders. Each conversation is rendered with the tokenizer's chat
template and tokenized; the output is a folder of Arrow shards with ``input_ids``
(``list<int32>``) and ``loss_mask`` (``list<uint8>``), which ``loader_server.data.dataset`` serves.

The loss mask is 1 exactly on what the assistant writes: every token of each assistant
message's rendered content plus the end-of-turn string that closes it (``<|im_end|>`` for
ChatML), and 0 on everything else (system and user turns, role headers, template-inserted
scaffolding such as Qwen3's empty think block, the newline after ``<|im_end|>``). It needs no
``{% generation %}`` markers:

* Per role sequence (``("system", "user", "assistant")``...), the template is rendered once
  with sentinel contents; splitting that text at the sentinels gives the scaffolding around
  each message (its *skeleton*, cached). The end-of-turn string is learned once, from the
  scaffolding after a final assistant reply: up to and including its first added token.
* Each conversation is rendered once; if the text equals the skeleton with the real contents
  put in, every content's character span is known by arithmetic (the fast path). Otherwise
  the template changed the content (stripped it, split a think block out of it...) and the
  exact fallback renders the conversation again once per assistant message with that
  message's content replaced by a sentinel: the part of the text that differs is the
  rendered content. Fallbacks are counted in the report.
* Character spans become token spans without character offsets (computing them costs about
  a third of the encode): added tokens split the text into segments tokenized independently,
  so the k-th added token in the text is the k-th added-token id, which places every span
  end (the end-of-turn token); a span start follows a short header (``assistant\\n``) whose
  own tokens, cached, must be the first tokens of its segment. When they are not (a token
  straddles header and reply), that conversation is encoded again with offsets. A token
  that straddles a span boundary counts as supervised when it overlaps the span at all, the
  rule of Transformers' own ``{% generation %}`` masks.

Tokenization itself is the fast tokenizer's batch encode (Rust). ``tokenize_corpus`` feeds
chunks of rows to a process pool (the tokenizer loaded once per worker) in input order, so
the shards are byte-identical for any worker count. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

IDS_COLUMN, MASK_COLUMN = "input_ids", "loss_mask"
SCHEMA = pa.schema([(IDS_COLUMN, pa.list_(pa.int32())), (MASK_COLUMN, pa.list_(pa.uint8()))])
REPORT_NAME, HELDOUT_NAME = "tokenize_report.json", "heldout.jsonl"
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
_JSONL, _JSON, _PARQUET, _ARROW = (
    (".jsonl", ".ndjson"),
    (".json",),
    (".parquet", ".pq"),
    (".arrow",),
)
_DATA_KEYS = ("data", "rows", "examples", "train", "items")
_CONV_KEYS = ("messages", "conversations")
_CHUNK_ROWS = 256  # rows per worker task: ~0.5 s of work at 1K tokens per row
_BATCH_ROWS, _BATCH_TOKENS = 8192, 1 << 24  # record batch bounds in the shards
_SENTINEL = "\x00"


class MalformedRow(ValueError):
    """A row that cannot become a training sample; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (MalformedRow, (self.reason, self.detail))


# --------------------------------------------------------------------------- messages


def to_messages(row: Mapping, *, require_assistant: bool = True) -> list[dict[str, str]]:
    """A ShareGPT or OpenAI row as ``[{"role", "content"}]`` with roles system/user/assistant.
    ``require_assistant=False`` accepts a prompt-only row (no assistant turn).

    Raises:
        MalformedRow: missing_messages, bad_shape, empty, unknown_role, non_string_content,
            empty_assistant or no_assistant_turn.
    """
    if not isinstance(row, Mapping):
        raise MalformedRow("bad_shape", f"row is a {type(row).__name__}, not an object")
    key = next((k for k in _CONV_KEYS if row.get(k) is not None), None)
    if key is None:
        raise MalformedRow("missing_messages", f"no 'messages' or 'conversations' in {_keys(row)}")
    return _normalize(row[key], key, require_assistant=require_assistant)


def _normalize(turns: Any, key: str, *, require_assistant: bool) -> list[dict[str, str]]:
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
        raise MalformedRow("bad_shape", f"message {k} has no 'role' or 'from' (keys {_keys(turn)})")
    norm = ROLES.get(role.lower()) if isinstance(role, str) else None
    if norm is None:
        raise MalformedRow("unknown_role", f"message {k} has role {_short(role)}")
    if _first(turn, "content", "value") is None and not ({"content", "value"} & set(turn)):
        raise MalformedRow("bad_shape", f"message {k} has no 'content' or 'value'")
    content = _text(_first(turn, "content", "value"), k)
    if norm == "assistant" and not content.strip():
        raise MalformedRow("empty_assistant", f"message {k} (assistant) has empty content")
    return {"role": norm, "content": content}


def _text(value: Any, k: int) -> str:
    """Message content: a string, or OpenAI content parts that are all text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        parts = [p.get("text") if isinstance(p, Mapping) else None for p in value]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise MalformedRow("non_string_content", f"message {k} content is {_short(value)}")


def _first(d: Mapping, *keys: str) -> Any:
    return next((d[k] for k in keys if d.get(k) is not None), None)


def _keys(d: Mapping) -> str:
    names = sorted(map(str, d))
    return "{" + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") + "}"


def _short(value: Any, width: int = 60) -> str:
    """A value for an error message: its repr, clipped."""
    return _clip(repr(value), width)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Everything before the first assistant turn (a held-out prompt's messages)."""
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first]


# --------------------------------------------------------------------------- reading rows


@dataclass(frozen=True)
class _Source:
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
    for where, payload in _chunks(expand_sources(sources), _CHUNK_ROWS):
        for (name, i), raw in zip(where, _payload_rows(payload), strict=True):
            try:
                yield name, i, _as_row(raw)
            except MalformedRow as e:
                yield name, i, e


def expand_sources(sources: Sequence[str | Path]) -> list[_Source]:
    """Every input file (or datasets folder) of the sources, in order."""
    out: list[_Source] = []
    for s in sources:
        path = Path(s)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        found = _expand_dir(path) if path.is_dir() else [_file_source(path, explicit=True)]
        if not found:
            raise ValueError(f"{path}: no .jsonl, .json, .parquet or .arrow files in folder")
        out.extend(x for x in found if x is not None)
    return out


def _expand_dir(path: Path) -> list[_Source | None]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path}: a DatasetDict folder (splits {splits}); pass one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
        return [_Source(path, "hf")]
    out: list[_Source | None] = []
    for p in sorted(path.iterdir()):
        if p.name.startswith(".") or (p / REPORT_NAME).is_file():  # hidden, or our own output
            continue
        if p.is_dir():
            out.extend(_expand_dir(p))
        elif (src := _file_source(p, explicit=False)) is not None:
            out.append(src)
    return out


def _file_source(path: Path, *, explicit: bool) -> _Source | None:
    suffix = path.suffix.lower()
    for kind, suffixes in (("jsonl", _JSONL), ("json", _JSON), ("parquet", _PARQUET)):
        if suffix in suffixes:
            return _Source(path, kind)
    if suffix in _ARROW:
        return _Source(path, "arrow")
    if explicit:
        raise ValueError(
            f"{path}: unsupported input format {suffix or '(no suffix)'} "
            f"(want .jsonl, .json, .parquet, .arrow or a datasets save_to_disk folder)"
        )
    return None


Payload = list | pa.Table  # a chunk of raw rows: JSONL lines, dicts, or an Arrow table


def _chunks(
    sources: list[_Source], size: int, limit: int | None = None
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
        return [r if isinstance(r, dict) else _not_object(r) for r in data]
    if isinstance(data, dict):
        if any(k in data for k in _CONV_KEYS):
            return [data]
        for key in _DATA_KEYS:
            if isinstance(data.get(key), list):
                return _json_rows(path, data[key])
        raise ValueError(f"{path}: a JSON object without a list of rows under {_DATA_KEYS}")
    raise ValueError(f"{path}: JSON holds a {type(data).__name__}, not a list of rows")


def _not_object(value: Any) -> MalformedRow:
    return MalformedRow("bad_shape", f"row is a {type(value).__name__}, not an object")


def _conv_columns(path: Path, names: Sequence[str]) -> list[str]:
    cols = [c for c in _CONV_KEYS if c in names]
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


def _payload_rows(payload: Payload) -> list:
    return payload.to_pylist() if isinstance(payload, pa.Table) else payload


def _as_row(raw: Any) -> dict:
    if isinstance(raw, MalformedRow):
        raise raw
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise MalformedRow("bad_json", _clip(str(e), 100)) from None
    if not isinstance(raw, dict):
        raise _not_object(raw)
    return raw


def _count_rows(sources: list[_Source]) -> int | None:
    """Rows to expect, for the progress bar (None when it would cost a parse)."""
    total = 0
    for src in sources:
        if src.kind == "jsonl":
            with open(src.path, "rb") as f:
                total += sum(block.count(b"\n") for block in iter(lambda f=f: f.read(1 << 24), b""))
        elif src.kind == "parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(src.path).metadata.num_rows
        else:
            return None
    return total


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class _Skeleton:
    """The template's text around the messages of one role sequence."""

    scaffold: tuple[str, ...]  # len(roles) + 1 pieces
    eot_follows: tuple[bool, ...]  # per message: the end-of-turn string starts the next piece


class ChatEncoder:
    """Render and tokenize conversations with a tokenizer's chat template, with loss masks.

    ``tokenizer`` is a local tokenizer folder (loaded as a ``PreTrainedTokenizerFast`` from
    its ``tokenizer.json``, which imports no torch), a Hub id or an already loaded fast
    tokenizer. ``enable_thinking`` is passed to the template when not None.
    """

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None) -> None:
        self.name = str(tokenizer)
        self.tokenizer = load_tokenizer(tokenizer)
        template = self.tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ValueError(f"{self.name}: tokenizer has no chat template")
        self.takes_thinking = "enable_thinking" in template
        self.enable_thinking = enable_thinking
        if enable_thinking is not None and not self.takes_thinking:
            _warn_once(f"{self.name}: the chat template ignores enable_thinking={enable_thinking}")
        passed = enable_thinking is not None and self.takes_thinking
        self._kwargs = {"enable_thinking": enable_thinking} if passed else {}
        self._render_text = self._direct_renderer() or self._apply_template
        self._added_ids = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items()}
        added = sorted(self._added_ids, key=len, reverse=True)  # leftmost-longest, as tokenizers
        self._added = re.compile("|".join(map(re.escape, added)) or r"(?!x)x")
        self._is_added = np.zeros(max(self.vocab_size, *self._added_ids.values(), 0) + 1, bool)
        self._is_added[list(self._added_ids.values())] = True
        self._heads: dict[str, np.ndarray] = {}
        self._skeletons: dict[tuple[str, ...], _Skeleton | None] = {}
        self.end_of_turn = ""
        self.end_of_turn = self._learn_end_of_turn()
        self.fallbacks = 0  # conversations masked by the exact (re-rendering) method
        self.offset_fallbacks = 0  # conversations placed with character offsets
        self._encode_texts = self._encode_offsets = self._offsets_encode
        self._check_ids()

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # public API

    def encode(self, messages: Sequence[Mapping]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, loss_mask uint8)`` of one conversation; raises MalformedRow."""
        out = self.encode_many([messages])[0]
        if isinstance(out, MalformedRow):
            raise out
        return out

    def encode_many(
        self, conversations: Sequence[Sequence[Mapping]]
    ) -> list[tuple[np.ndarray, np.ndarray] | MalformedRow]:
        """``encode`` for many conversations at once (one batched Rust encode); a conversation
        that fails gives its ``MalformedRow`` in its place instead of raising."""
        normalized: list[list[dict[str, str]] | MalformedRow] = []
        for conv in conversations:
            try:
                normalized.append(_normalize(list(conv), "messages", require_assistant=True))
            except MalformedRow as e:
                normalized.append(e)
        return self._encode_normalized(normalized)

    def prompt_ids(self, messages: Sequence[Mapping]) -> np.ndarray:
        """The messages rendered with the generation prompt, tokenized (int32): what the model
        sees before it answers."""
        msgs = _normalize(list(messages), "messages", require_assistant=False)
        text = self._render(msgs, add_generation_prompt=True)
        return np.asarray(self._encode_texts([text])[0].ids, dtype=np.int32)

    # rendering and spans

    def _render(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False
    ) -> str:
        try:
            return self._render_text(messages, add_generation_prompt)
        except Exception as e:  # the template is arbitrary code; report its error per row
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MalformedRow("template_error", _clip(first, 120)) from None

    def _apply_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
        )

    def _direct_renderer(self) -> Callable[[list[dict[str, str]], bool], str] | None:
        """The compiled template called directly: ``apply_chat_template`` spends about as long
        again copying the messages (ours are plain strings already). Used only if it renders
        the probes exactly as ``apply_chat_template`` does."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.tokenizer.chat_template)
        except Exception:
            return None
        env = {**self.tokenizer.special_tokens_map, **self._kwargs}

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **env,
            )

        for roles in (("user", "assistant"), ("system", "user", "assistant", "user", "assistant")):
            messages = [{"role": r, "content": f"{r} {k} text"} for k, r in enumerate(roles)]
            for gen in (False, True):
                try:
                    if render(messages, gen) != self._apply_template(messages, gen):
                        return None
                except Exception:
                    return None
        return render

    def _skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        if roles not in self._skeletons:
            if len(self._skeletons) >= 4096:
                self._skeletons.clear()
            self._skeletons[roles] = self._build_skeleton(roles)
        return self._skeletons[roles]

    def _build_skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        marks = [f"{_SENTINEL}{k}{_SENTINEL}" for k in range(len(roles))]
        try:
            text = self._render(
                [{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)]
            )
        except MalformedRow:
            return None
        pieces, pos = [], 0
        for mark in marks:
            j = text.find(mark, pos)
            if j < 0:
                return None
            pieces.append(text[pos:j])
            pos = j + len(mark)
        pieces.append(text[pos:])
        if any(_SENTINEL in p for p in pieces):  # a content rendered twice or mangled
            return None
        eot = self.end_of_turn
        follows = tuple(
            bool(eot) and r == "assistant" and pieces[k + 1].startswith(eot)
            for k, r in enumerate(roles)
        )
        return _Skeleton(tuple(pieces), follows)

    def _learn_end_of_turn(self) -> str:
        """What closes an assistant reply: the text after a final reply's content up to and
        including the first added token ('' when the template adds none)."""
        skeleton = self._build_skeleton(("user", "assistant"))
        if skeleton is None:
            raise ValueError(
                f"{self.name}: the chat template cannot render a user/assistant conversation "
                f"with its contents verbatim"
            )
        tail = skeleton.scaffold[-1]
        m = self._added.search(tail)
        return tail[: m.end()] if m else ""

    def _spans(self, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
        spans = self._spans_fast(text, messages)
        if spans is None:
            self.fallbacks += 1
            spans = self._spans_exact(text, messages)
        return spans

    def _spans_fast(
        self, text: str, messages: list[dict[str, str]]
    ) -> list[tuple[int, int]] | None:
        sk = self._skeleton(tuple(m["role"] for m in messages))
        if sk is None:
            return None
        parts, spans, pos = [sk.scaffold[0]], [], len(sk.scaffold[0])
        eot = len(self.end_of_turn)
        for k, m in enumerate(messages):
            c, after = m["content"], sk.scaffold[k + 1]
            parts += (c, after)
            if m["role"] == "assistant":
                spans.append((pos, pos + len(c) + (eot if sk.eot_follows[k] else 0)))
            pos += len(c) + len(after)
        return spans if "".join(parts) == text else None

    def _spans_exact(self, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
        """Per assistant message, render once more with its content replaced by a sentinel:
        the characters that differ are its rendered content."""
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            other = self._render([*messages[:k], {**m, "content": _SENTINEL}, *messages[k + 1 :]])
            a = _common_prefix(text, other)
            b = len(text) - _common_suffix(text, other, min(len(text), len(other)) - a)
            if b <= a:
                continue
            if self.end_of_turn and text.startswith(self.end_of_turn, b):
                b += len(self.end_of_turn)
            spans.append((a, b))
        return spans

    # tokenizing

    def _fast_encode(self, texts: list[str]) -> list[Any]:
        """Ids only: skipping the character offsets saves about a quarter of the encode."""
        bt = self.tokenizer.backend_tokenizer
        return getattr(bt, "encode_batch_fast", bt.encode_batch)(texts, add_special_tokens=False)

    def _offsets_encode(self, texts: list[str]) -> list[Any]:
        return self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)

    def _call_encode(self, texts: list[str]) -> list[Any]:
        return self.tokenizer(texts, add_special_tokens=False).encodings

    def _check_ids(self) -> None:
        """Our ids must equal ``apply_chat_template(tokenize=True)``; if the raw Rust encode
        differs for this tokenizer, go through the tokenizer's own call instead."""
        probe = [
            {"role": "user", "content": "Hi there, what is 2+2? héllo 世界"},
            {"role": "assistant", "content": "It is 4.\n\nAnything else? 👋"},
        ]
        out = self.tokenizer.apply_chat_template(probe, tokenize=True, **self._kwargs)
        want = list(out["input_ids"] if isinstance(out, Mapping) else out)
        text = self._render(probe)
        if list(self._fast_encode([text])[0].ids) == want:
            self._encode_texts, self._encode_offsets = self._fast_encode, self._offsets_encode
        elif list(self._call_encode([text])[0].ids) == want:
            self._encode_texts = self._encode_offsets = self._call_encode
        else:
            raise ValueError(f"{self.name}: cannot reproduce apply_chat_template's token ids")

    def _encode_normalized(
        self, conversations: Sequence[list[dict[str, str]] | MalformedRow]
    ) -> list[tuple[np.ndarray, np.ndarray] | MalformedRow]:
        out: list[Any] = list(conversations)
        todo, texts, spans = [], [], []
        for i, messages in enumerate(conversations):
            if isinstance(messages, MalformedRow):
                continue
            try:
                text = self._render(messages)
                spans.append(self._spans(text, messages))
            except MalformedRow as e:
                out[i] = e
                continue
            todo.append(i)
            texts.append(text)
        redo = []
        for i, enc, text, sp in zip(todo, self._encode_texts(texts), texts, spans, strict=True):
            ids = np.asarray(enc.ids, dtype=np.int32)
            token_spans = self._token_spans(text, ids, sp)
            if token_spans is None:
                redo.append((i, ids, text, sp))
            else:
                out[i] = _checked(ids, _span_mask(token_spans, len(ids)))
        if redo:  # character offsets for the few the anchors cannot place
            self.offset_fallbacks += len(redo)
            encs = self._encode_offsets([r[2] for r in redo])
            for (i, ids, _, sp), enc in zip(redo, encs, strict=True):
                out[i] = _checked(ids, token_mask(enc, sp, len(ids)))
        return out

    def _token_spans(
        self, text: str, ids: np.ndarray, spans: list[tuple[int, int]]
    ) -> list[tuple[int, int]] | None:
        """Token ranges of character spans without offsets, or None (then offsets decide).

        Added tokens split the text into segments that are tokenized independently, so the
        k-th added token in the text is the k-th added-token id in ``ids``: a span ending
        just after an added token ends just after that id. A span starts inside a segment,
        after a short header (``assistant\\n``): if the header's own tokens (cached) are the
        segment's first tokens, they cover exactly its characters, and the content's first
        token starts right after them (no token straddles the boundary)."""
        anchors = self._anchors(text, ids)
        if anchors is None:
            return None
        ends, positions = anchors
        out = []
        for a, b in spans:
            j = bisect.bisect_right(ends, a) - 1
            seg_char, seg_tok = (ends[j], positions[j] + 1) if j >= 0 else (0, 0)
            head = self._segment_ids(text[seg_char:a])
            if head is None or not np.array_equal(ids[seg_tok : seg_tok + head.size], head):
                return None
            k = bisect.bisect_left(ends, b)
            if k == len(ends) or ends[k] != b:
                return None
            out.append((seg_tok + head.size, positions[k] + 1))
        return out

    def _anchors(self, text: str, ids: np.ndarray) -> tuple[list[int], list[int]] | None:
        """Character end and token position of every added token, when they agree."""
        found = [(m.end(), m.group()) for m in self._added.finditer(text)]
        positions = np.flatnonzero(self._is_added[ids]).tolist()
        if len(positions) != len(found):
            return None
        for p, (_, s) in zip(positions, found, strict=True):
            if ids[p] != self._added_ids[s]:
                return None
        return [e for e, _ in found], positions

    def _segment_ids(self, head: str) -> np.ndarray | None:
        if len(head) > 256:  # no added token near the content: let the offsets decide
            return None
        cached = self._heads.get(head)
        if cached is None:
            if len(self._heads) >= 4096:
                self._heads.clear()
            cached = np.asarray(self._encode_texts([head])[0].ids, dtype=np.int32)
            self._heads[head] = cached
        return cached


def _span_mask(token_spans: list[tuple[int, int]], n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=np.uint8)
    for lo, hi in token_spans:
        mask[lo:hi] = 1
    return mask


def _checked(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | MalformedRow:
    if not mask.any():
        return MalformedRow("no_supervised_tokens", "no assistant token survives rendering")
    return ids, mask


def token_mask(enc: Any, spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """uint8 mask of the tokens that overlap any character span (sorted, disjoint), from an
    encoding with offsets.

    ``char_to_token`` finds each span's first and last token (a couple of Rust calls per
    span, no per-token Python); characters no token covers fall back to the offsets."""
    mask = np.zeros(n, dtype=np.uint8)
    for a, b in spans:
        first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
        if first is None or last is None:
            return mask_from_offsets(np.asarray(enc.offsets, dtype=np.int64), spans, n)
        # Several tokens can share a character (byte-level pieces of one code point).
        while last + 1 < n and enc.token_to_chars(last + 1)[0] < b:
            last += 1
        mask[first : last + 1] = 1
    return mask


def mask_from_offsets(offsets: np.ndarray, spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """Vectorized: token t is 1 when ``[start_t, end_t)`` overlaps a span ``[a, b)``."""
    if not spans or n == 0:
        return np.zeros(n, dtype=np.uint8)
    a = np.array([s[0] for s in spans], dtype=np.int64)
    b = np.array([s[1] for s in spans], dtype=np.int64)
    offsets = offsets.reshape(-1, 2)
    k = np.searchsorted(b, offsets[:, 0], side="right")  # first span ending after the start
    hit = (k < len(b)) & (offsets[:, 1] > a[np.minimum(k, len(b) - 1)])
    return hit.astype(np.uint8)


def _common_prefix(x: str, y: str) -> int:
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:  # binary search; each comparison runs in C
        mid = (lo + hi + 1) // 2
        if x[:mid] == y[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(x: str, y: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[len(x) - mid :] == y[len(y) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def load_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer from a folder (no torch when it has ``tokenizer.json``) or Hub id;
    an object with ``apply_chat_template`` is returned as it is."""
    if hasattr(tokenizer, "apply_chat_template"):
        tok = tokenizer
    else:
        path = Path(tokenizer)
        if not path.exists() and (path.is_absolute() or str(tokenizer).startswith((".", "~"))):
            raise FileNotFoundError(f"{path}: no such tokenizer folder")
        try:
            if (path / "tokenizer.json").is_file():
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast.from_pretrained(str(path))
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{tokenizer}: cannot load a tokenizer ({first})") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"{tokenizer}: need a fast (Rust) tokenizer with a tokenizer.json")
    return tok


# --------------------------------------------------------------------------- workers


@dataclass
class _Result:
    """One chunk's kept rows (flat) and every row's outcome."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    outcomes: list  # per row: None (kept), "truncated" (kept) or (reason, detail)
    fallbacks: int


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str, enable_thinking: bool | None, child: bool) -> None:
    if child:  # one process per core: no Rust thread pool inside each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    enc = _WORKER.get("encoder")
    if enc is None or (enc.name, enc.enable_thinking) != (str(tokenizer), enable_thinking):
        _WARNED.add(f"{tokenizer}: the chat template ignores enable_thinking={enable_thinking}")
        _WORKER["encoder"] = ChatEncoder(tokenizer, enable_thinking=enable_thinking)


def _encode_chunk(payload: Payload, max_length: int | None, overflow: str) -> _Result:
    enc: ChatEncoder = _WORKER["encoder"]
    rows = _payload_rows(payload)
    outcomes: list[Any] = [None] * len(rows)
    convs: list[Any] = []
    for raw in rows:
        try:
            convs.append(to_messages(_as_row(raw)))
        except MalformedRow as e:
            convs.append(e)
    before = enc.fallbacks
    ids, masks = [], []
    for i, r in enumerate(enc._encode_normalized(convs)):
        if isinstance(r, MalformedRow):
            outcomes[i] = (r.reason, r.detail)
            continue
        outcomes[i], r = _fit(r, max_length, overflow)
        if r is not None:
            ids.append(r[0])
            masks.append(r[1])
    lengths = np.array([len(x) for x in ids], dtype=np.int32)
    return _Result(
        np.concatenate(ids) if ids else np.zeros(0, np.int32),
        np.concatenate(masks) if masks else np.zeros(0, np.uint8),
        lengths,
        outcomes,
        enc.fallbacks - before,
    )


def _fit(
    sample: tuple[np.ndarray, np.ndarray], max_length: int | None, overflow: str
) -> tuple[Any, tuple[np.ndarray, np.ndarray] | None]:
    ids, mask = sample
    if max_length is None or len(ids) <= max_length:
        return None, sample
    if overflow == "drop":
        return ("too_long", f"{len(ids)} tokens > --max-length {max_length}"), None
    if not mask[:max_length].any():
        return ("too_long", f"no supervised token in the first {max_length} of {len(ids)}"), None
    return "truncated", (ids[:max_length], mask[:max_length])


class _Runner:
    """Chunks through ``_encode_chunk`` in input order: in process, or a bounded window of
    tasks in a process pool (forked, so workers inherit the loaded encoder)."""

    def __init__(self, encoder: ChatEncoder, tokenizer: str, workers: int) -> None:
        _WORKER["encoder"] = encoder
        self.pool = None
        self.window = workers * 4
        self._env = os.environ.get("TOKENIZERS_PARALLELISM")
        if workers > 1:
            # Forked workers must not touch the parent's Rust thread pool; saying so before
            # the fork also silences tokenizers' fork warning. The parent encodes nothing
            # while the pool runs.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self.pool = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context(method),
                initializer=_init_worker,
                initargs=(tokenizer, encoder.enable_thinking, True),
            )

    def map(
        self, chunks: Iterator[tuple[list, Payload]], max_length: int | None, overflow: str
    ) -> Iterator[tuple[list, Payload, _Result]]:
        if self.pool is None:
            for where, payload in chunks:
                yield where, payload, _encode_chunk(payload, max_length, overflow)
            return
        pending: deque = deque()
        for where, payload in chunks:
            pending.append(
                (where, payload, self.pool.submit(_encode_chunk, payload, max_length, overflow))
            )
            if len(pending) >= self.window:
                where0, payload0, fut = pending.popleft()
                yield where0, payload0, fut.result()
        while pending:
            where0, payload0, fut = pending.popleft()
            yield where0, payload0, fut.result()

    def close(self) -> None:
        if self.pool is None:
            return
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._env


# --------------------------------------------------------------------------- writing


class _ShardWriter:
    """Rows to ``shard-00000.arrow``... in record batches of at most 8192 rows / 16M tokens,
    ``shard_rows`` rows per shard, holding back the last ``hold`` rows (the held-out set).
    Batch and shard boundaries depend only on the row lengths: same rows, same bytes."""

    def __init__(self, folder: Path, shard_rows: int, hold: int) -> None:
        self.folder, self.shard_rows, self.hold = folder, shard_rows, hold
        self.paths: list[Path] = []
        self.rows = self.tokens = self.supervised = 0
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending = self._pending_tokens = 0
        self._stuck_tokens = 0  # pending tokens the last flush could not write
        self._writer: Any = None
        self._sink: Any = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        if lengths.size:
            self._parts.append((ids, mask, lengths))
            self._pending += int(lengths.size)
            self._pending_tokens += int(ids.size)
            fresh = self._pending_tokens - self._stuck_tokens
            if self._pending - self.hold >= _BATCH_ROWS or fresh >= _BATCH_TOKENS:
                self._flush(final=False)

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write everything but the held rows; return those (flat ids, mask, lengths)."""
        held = self._flush(final=True)
        self._close_shard()
        return held

    def _flush(self, final: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._parts:
            return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32)
        ids, mask, lens = (np.concatenate([p[k] for p in self._parts]) for k in range(3))
        offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        i, n_out = 0, max(lens.size - self.hold, 0)
        while i < n_out and (take := self._next_batch(lens[i:n_out], final)):
            lo, hi = int(offsets[i]), int(offsets[i + take])
            self._write(ids[lo:hi], mask[lo:hi], lens[i : i + take])
            i += take
        lo = int(offsets[i])
        self._parts = [(ids[lo:], mask[lo:], lens[i:])]
        self._pending = int(lens.size - i)
        self._pending_tokens = self._stuck_tokens = int(ids.size - lo)
        return self._parts[0]

    def _next_batch(self, lens: np.ndarray, final: bool) -> int:
        """Rows in the next record batch (0: not enough rows yet to close one)."""
        limit = min(_BATCH_ROWS, self.shard_rows - self._in_shard)
        csum = np.cumsum(lens[:limit], dtype=np.int64)
        by_tokens = int(np.searchsorted(csum, _BATCH_TOKENS, side="left")) + 1
        take = min(limit, by_tokens, lens.size)
        complete = take in (limit, by_tokens)
        return take if complete or final else 0

    def _write(self, ids: np.ndarray, mask: np.ndarray, lens: np.ndarray) -> None:
        if self._writer is None:
            path = self.folder / f"shard-{len(self.paths):05d}.arrow"
            self.paths.append(path)
            self._sink = pa.OSFile(str(path), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        offsets = np.zeros(lens.size + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        arrays = [
            pa.ListArray.from_arrays(_arrow(offsets, pa.int32()), _arrow(ids, pa.int32())),
            pa.ListArray.from_arrays(_arrow(offsets, pa.int32()), _arrow(mask, pa.uint8())),
        ]
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=SCHEMA))
        self.rows += int(lens.size)
        self.tokens += int(ids.size)
        self.supervised += int(np.count_nonzero(mask))
        self._in_shard += int(lens.size)
        if self._in_shard >= self.shard_rows:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
        self._writer = self._sink = None
        self._in_shard = 0


def _arrow(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """Zero-copy Arrow view of a numpy array (``pa.array`` would import pandas: 0.6 s)."""
    values = np.ascontiguousarray(values, dtype=type_.to_pandas_dtype())
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


# --------------------------------------------------------------------------- the corpus


@dataclass
class _Stats:
    strict: bool
    rows_read: int = 0
    truncated: int = 0
    fallbacks: int = 0
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)
    lengths: list[np.ndarray] = field(default_factory=list)

    def add(self, where: list[tuple[str, int]], result: _Result) -> None:
        self.rows_read += len(where)
        self.fallbacks += result.fallbacks
        self.lengths.append(result.lengths)
        for (name, i), outcome in zip(where, result.outcomes, strict=True):
            if outcome == "truncated":
                self.truncated += 1
            elif outcome is not None:
                self._skip(name, i, *outcome)

    def _skip(self, name: str, i: int, reason: str, detail: str) -> None:
        if self.strict and reason != "too_long":
            raise ValueError(f"{name}: row {i}: {reason}: {detail} (--strict)")
        entry = self.skipped.setdefault(
            reason, {"count": 0, "first_file": name, "first_row": i, "detail": detail}
        )
        entry["count"] += 1

    def count(self, too_long: bool) -> int:
        return sum(v["count"] for k, v in self.skipped.items() if (k == "too_long") == too_long)


def tokenize_corpus(
    sources: Sequence[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path,
    enable_thinking: bool | None = None,
    max_length: int | None = None,
    overflow: str = "truncate",
    workers: int = 1,
    shard_rows: int = 100_000,
    strict: bool = False,
    holdout: int = 0,
    progress: bool = True,
    limit: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Tokenize conversations into ``out_dir/shard-*.arrow``; returns the report (also
    written to ``out_dir/tokenize_report.json``).

    The output is built in ``OUT.tmp`` and renamed when complete; an existing non-empty
    ``out_dir`` is refused unless ``force``. With ``holdout > 0`` the last ``holdout``
    conversations that would enter the corpus are kept out and their prompts (the messages
    before the first assistant turn, rendered with the generation prompt) written to
    ``out_dir/heldout.jsonl`` (``{"sample", "prompt", "file", "row"}`` per line, the format
    ``trainer.regen.load_prompts`` reads); the loader ignores non-shard files in the folder.
    """
    _check_options(max_length, overflow, workers, shard_rows, holdout, limit)
    files = expand_sources(sources)
    out = Path(out_dir)
    encoder = ChatEncoder(tokenizer, enable_thinking=enable_thinking)
    opts = {
        "max_length": max_length,
        "overflow": overflow,
        "workers": workers,
        "shard_rows": shard_rows,
        "strict": strict,
        "holdout": holdout,
        "progress": progress,
        "limit": limit,
    }
    tmp = _prepare_out(out, force)
    try:
        report = _run(files, tmp, out, encoder, str(tokenizer), opts)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _check_options(
    max_length: int | None,
    overflow: str,
    workers: int,
    shard_rows: int,
    holdout: int,
    limit: int | None,
) -> None:
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    for name, value, low in (
        ("max_length", max_length, 1),
        ("workers", workers, 1),
        ("shard_rows", shard_rows, 1),
        ("holdout", holdout, 0),
        ("limit", limit, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and not force and (out.is_file() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists and is not empty (--force replaces it)")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    tmp.mkdir(parents=True)
    return tmp


def _replace(tmp: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    tmp.rename(out)


def _run(
    files: list[_Source],
    tmp: Path,
    out: Path,
    encoder: ChatEncoder,
    tokenizer: str,
    opts: dict[str, Any],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    stats = _Stats(strict=opts["strict"])
    writer = _ShardWriter(tmp, opts["shard_rows"], opts["holdout"])
    kept: deque = deque(maxlen=max(opts["holdout"], 1))  # (file, row, raw) of the last kept rows
    total = _count_rows(files) if opts["progress"] else None
    if total is not None and opts["limit"] is not None:
        total = min(total, opts["limit"])
    runner = _Runner(encoder, tokenizer, opts["workers"])
    bar = _bar(total, opts["progress"])
    try:
        chunks = _chunks(files, _CHUNK_ROWS, opts["limit"])
        for where, payload, result in runner.map(chunks, opts["max_length"], opts["overflow"]):
            stats.add(where, result)
            writer.add(result.ids, result.mask, result.lengths)
            if opts["holdout"]:
                _remember(kept, where, payload, result.outcomes)
            _tick(bar, len(where), int(result.ids.size), t0)
    finally:
        runner.close()
        bar.close()
    held = writer.finish()
    if writer.rows == 0:
        reasons = {k: v["count"] for k, v in stats.skipped.items()}
        raise ValueError(
            f"no conversations for the corpus: {stats.rows_read} rows read, "
            f"{held[2].size} held out, skipped {reasons}"
        )
    heldout = (
        _write_heldout(tmp, out, encoder, kept, held, writer.rows) if opts["holdout"] else None
    )
    report = _report(files, out, writer, stats, encoder, tokenizer, opts, heldout, t0)
    (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _remember(kept: deque, where: list, payload: Payload, outcomes: list) -> None:
    for k, ((name, i), outcome) in enumerate(zip(where, outcomes, strict=True)):
        if outcome is None or outcome == "truncated":
            kept.append((name, i, payload, k))


def _write_heldout(
    tmp: Path,
    out: Path,
    encoder: ChatEncoder,
    kept: deque,
    held: tuple[np.ndarray, np.ndarray, np.ndarray],
    corpus_rows: int,
) -> str:
    ids, mask, lens = held
    rows = list(kept)[len(kept) - lens.size :]
    starts = np.concatenate([[0], np.cumsum(lens)])
    with open(tmp / HELDOUT_NAME, "w") as f:
        for k, (name, i, payload, j) in enumerate(rows):
            messages = prompt_messages(to_messages(_as_row(_payload_row(payload, j))))
            if messages:
                prompt = encoder.prompt_ids(messages)
            else:  # the conversation opens with the assistant: its tokens before the reply
                sample_mask = mask[starts[k] : starts[k + 1]]
                prompt = ids[starts[k] : starts[k] + max(int(np.argmax(sample_mask)), 1)]
            line = {"sample": corpus_rows + k, "prompt": prompt.tolist(), "file": name, "row": i}
            f.write(json.dumps(line) + "\n")
    return str(out / HELDOUT_NAME)


def _payload_row(payload: Payload, j: int) -> Any:
    return payload.slice(j, 1).to_pylist()[0] if isinstance(payload, pa.Table) else payload[j]


def _report(
    files: list[_Source],
    out: Path,
    writer: _ShardWriter,
    stats: _Stats,
    encoder: ChatEncoder,
    tokenizer: str,
    opts: dict[str, Any],
    heldout: str | None,
    t0: float,
) -> dict[str, Any]:
    elapsed = time.perf_counter() - t0
    lengths = np.concatenate(stats.lengths)
    n_held = opts["holdout"]
    return {
        "out": str(out),
        "shards": [p.name for p in writer.paths],
        "sources": [str(f.path) for f in files],
        "tokenizer": tokenizer,
        "vocab_size": encoder.vocab_size,
        "end_of_turn": encoder.end_of_turn,
        "template_takes_enable_thinking": encoder.takes_thinking,
        "enable_thinking": encoder.enable_thinking,
        "rows_read": stats.rows_read,
        "conversations": writer.rows,
        "heldout": n_held,
        "heldout_prompts": heldout,
        "malformed_rows": stats.count(too_long=False),
        "dropped_too_long": stats.count(too_long=True),
        "truncated": stats.truncated,
        "skipped": stats.skipped,
        "fallback_conversations": stats.fallbacks,
        "tokens": writer.tokens,
        "supervised_tokens": writer.supervised,
        "length": _length_stats(lengths),
        **{k: opts[k] for k in ("max_length", "overflow", "workers", "shard_rows", "limit")},
        "elapsed_s": round(elapsed, 3),
        "conversations_per_s": round((writer.rows + n_held) / elapsed, 1),
        "tokens_per_s": round(int(lengths.sum()) / elapsed, 1),
    }


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The report in a few lines: what went in, what came out, every skipped reason with the
    first file and row it happened at."""
    lines = [
        f"{report['rows_read']} rows read: {report['conversations']} conversations in the corpus, "
        f"{report['heldout']} held out, {report['malformed_rows']} malformed, "
        f"{report['dropped_too_long']} too long; {report['truncated']} truncated",
        f"{report['tokens']} tokens ({report['supervised_tokens']} supervised) in "
        f"{len(report['shards'])} shards, {report['elapsed_s']:.1f} s "
        f"({report['conversations_per_s']:.0f} conv/s, {report['tokens_per_s']:,.0f} tok/s)",
    ]
    for reason, v in sorted(report["skipped"].items(), key=lambda kv: -kv[1]["count"]):
        lines.append(
            f"skipped {v['count']} x {reason}: first {v['first_file']} row {v['first_row']} "
            f"({v['detail']})"
        )
    return lines


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 1),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(lengths.max()),
    }


def _bar(total: int | None, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="tokenize", unit="conv", disable=not enabled, dynamic_ncols=True)


def _tick(bar: Any, rows: int, tokens: int, t0: float) -> None:
    bar.update(rows)
    if not bar.disable:
        bar.n_tokens = getattr(bar, "n_tokens", 0) + tokens
        rate = bar.n_tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
