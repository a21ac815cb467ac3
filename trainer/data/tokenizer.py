"""The tokenizer as the chat encoder uses it: loaded from a ``--tokenizer`` argument (a local
folder or a Hub id, by one rule: ``tokenizer_source``), its added tokens (``AddedTokens``),
and the raw Rust batch encodes, one of which must reproduce ``apply_chat_template``'s ids
(``reproducing_encodes``), run so that one bad text never fails a batch (``encode_each``)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.messages import MalformedRow, clip

#: A batch encode: texts -> the tokenizer's Rust encodings (``ids``, ``offsets``...).
Encode = Callable[[list[str]], list[Any]]


@dataclass(frozen=True)
class AddedTokens:
    """The tokenizer's added tokens: ``ids`` (string -> id), ``pattern`` (finds them in a
    text, leftmost-longest as the tokenizer does) and ``is_added`` (by id)."""

    ids: dict[str, int]
    pattern: re.Pattern[str]
    is_added: np.ndarray

    @classmethod
    def of(cls, tokenizer: Any) -> AddedTokens:
        ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        longest_first = sorted(ids, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, longest_first)) or r"(?!x)x")
        is_added = np.zeros(max(len(tokenizer), *ids.values(), 0) + 1, bool)
        is_added[list(ids.values())] = True
        return cls(ids, pattern, is_added)


def fast_encode(tokenizer: Any, texts: list[str]) -> list[Any]:
    """Ids only: skipping the character offsets saves about a quarter of the encode."""
    bt = tokenizer.backend_tokenizer
    return getattr(bt, "encode_batch_fast", bt.encode_batch)(texts, add_special_tokens=False)


def offsets_encode(tokenizer: Any, texts: list[str]) -> list[Any]:
    return tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)


def call_encode(tokenizer: Any, texts: list[str]) -> list[Any]:
    return tokenizer(texts, add_special_tokens=False).encodings


def reproducing_encodes(tokenizer: Any, text: str, want: list[int]) -> tuple[Encode, Encode] | None:
    """``(ids encode, offsets encode)`` whose ids for ``text`` are ``want`` (what
    ``apply_chat_template(tokenize=True)`` gives): the raw Rust encodes, or, if they differ
    for this tokenizer, the tokenizer's own call for both; None if neither does."""
    ids_only, with_offsets = partial(fast_encode, tokenizer), partial(offsets_encode, tokenizer)
    if list(ids_only([text])[0].ids) == want:
        return ids_only, with_offsets
    call = partial(call_encode, tokenizer)
    if list(call([text])[0].ids) == want:
        return call, call
    return None


def encode_each(encode: Encode, texts: list[str]) -> list[Any]:
    """``encode(texts)``; if the batch fails, each text alone, a failing one giving its
    MalformedRow (``encode_error``) in its place."""
    if not texts:
        return []
    try:
        return encode(texts)
    except Exception:
        return [_encode_one(encode, t) for t in texts]


def _encode_one(encode: Encode, text: str) -> Any:
    try:
        return encode([text])[0]
    except Exception as e:  # the tokenizer's own refusal, whatever its type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return MalformedRow("encode_error", clip(first, 120))


#: A Hugging Face Hub repository id: ``name`` or ``namespace/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def tokenizer_source(value: str | Path) -> Path | str:
    """A ``--tokenizer`` argument as a local folder (a Path) or a Hub id (a str), by one
    rule: an existing folder is that folder; an existing file is an error naming its folder;
    a path that does not exist is an error, never a Hub lookup. It is a path when it is
    absolute, starts with ``.`` or ``~``, ends in a file suffix (``.json``), has more than
    one ``/``, or its first component exists here (``tok/qwen`` with a folder ``tok``);
    only a bare ``name`` or ``namespace/name`` that matches nothing here is a Hub id."""
    text = str(value)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"{text}: a file, not a tokenizer folder; pass the folder that holds it ({path.parent})"
        )
    first = Path(text).parts[0] if Path(text).parts else text
    looks_like_path = (
        path.is_absolute()
        or text.startswith((".", "~"))
        or Path(text).suffix in (".json", ".model", ".txt", ".jinja")
        or text.count("/") > 1
        or (text.count("/") == 1 and Path(first).exists())
        or not _HUB_ID.fullmatch(text)
    )
    if looks_like_path:
        near = (
            path.parent
            if path.parent.is_dir() and path.parent not in (Path("."), Path("/"))
            else None
        )
        hint = f" ({near} exists, but has no {path.name!r})" if near is not None else ""
        raise ValueError(f"{text}: no such tokenizer folder{hint}")
    return text


def load_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer from a folder (no torch when it has ``tokenizer.json``) or a Hub id
    (``tokenizer_source`` decides which; a Hub id is looked for in the local Hugging Face
    cache first); an object with ``apply_chat_template`` is returned as it is."""
    if hasattr(tokenizer, "apply_chat_template"):
        tok = tokenizer
    else:
        source = tokenizer_source(tokenizer)
        try:
            if isinstance(source, Path) and (source / "tokenizer.json").is_file():
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast.from_pretrained(str(source))
            elif isinstance(source, Path):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
            else:
                tok = _hub_tokenizer(source)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = "the folder" if isinstance(source, Path) else "the Hub id"
            raise ValueError(f"{tokenizer}: cannot load a tokenizer from {where} ({first})") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"{tokenizer}: need a fast (Rust) tokenizer with a tokenizer.json")
    return tok


def _hub_tokenizer(repo: str) -> Any:
    """The Hub id's tokenizer from the local cache, else downloaded (unless offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(repo, local_files_only=True)
    except (OSError, ValueError):
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise ValueError(
                f"not a local folder, not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                f"set (download it first: `huggingface-cli download {repo} --local-dir DIR`)"
            ) from None
    return AutoTokenizer.from_pretrained(repo)
