"""Character spans -> token spans and loss masks, for a whole encode or a prefix of one.

* Character spans become token spans without character offsets (computing them costs about
  a third of the encode): added tokens split the text into segments tokenized independently,
  so the k-th added token in the text is the k-th added-token id, which places every span
  end (the end-of-turn token); a span start follows a short header (``assistant\\n``) whose
  own tokens, cached, must be the first tokens of its segment. When they are not (a token
  straddles header and reply), that conversation is encoded again with offsets
  (``token_mask``). A token that straddles a span boundary counts as supervised when it
  overlaps the span at all, the rule of Transformers' own ``{% generation %}`` masks.
* With a token ``limit`` (``--max-length``), a conversation whose rendered text is far
  longer than ``limit`` tokens can be is not tokenized whole: a prefix of its text is, long
  enough to hold ``limit`` + 1 + ``PREFIX_MARGIN`` tokens, and its first ``limit`` + 1
  tokens and mask are the whole encode's (tokenization is local: cutting the text changes
  only the tokens near the cut; each such prefix encode is checked against a second,
  longer cut, and if they disagree the conversation is tokenized whole). A 50 MB row under
  ``--max-length 4096`` then costs a render and a few small encodes (``Longer``).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.messages import MalformedRow
from trainer.data.tokenizer import AddedTokens, Encode, encode_each

log = logging.getLogger(__name__)

#: Tokens a prefix encode must reach past ``limit`` + 1: those near the cut may differ from
#: the whole text's; the first ``limit`` + 1 are far enough from it.
PREFIX_MARGIN = 128
#: Characters per token a first prefix allows for (then x4 per try); False: always whole.
PREFIX_CHARS_PER_TOKEN: int | bool = 16


@dataclass(frozen=True)
class Longer:
    """A conversation longer than the ``limit`` it was encoded under, encoded only as far
    as its first ``limit`` + 1 tokens (``ids``, ``mask``: equal to the whole encode's
    first ones); ``chars``: its rendered length in characters."""

    ids: np.ndarray
    mask: np.ndarray
    chars: int


class TokenPlacer:
    """Token ranges of character spans from the ids alone (module docstring): ``added``,
    the tokenizer's added tokens; ``encode``, the encode of the ids (for span headers)."""

    def __init__(self, added: AddedTokens, encode: Encode) -> None:
        self._added = added
        self._encode = encode
        self._heads: dict[str, np.ndarray] = {}

    def token_spans(
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
        found = [(m.end(), m.group()) for m in self._added.pattern.finditer(text)]
        positions = np.flatnonzero(self._added.is_added[ids]).tolist()
        if len(positions) != len(found):
            return None
        for p, (_, s) in zip(positions, found, strict=True):
            if ids[p] != self._added.ids[s]:
                return None
        return [e for e, _ in found], positions

    def _segment_ids(self, head: str) -> np.ndarray | None:
        if len(head) > 256:  # no added token near the content: let the offsets decide
            return None
        cached = self._heads.get(head)
        if cached is None:
            if len(self._heads) >= 4096:
                self._heads.clear()
            cached = np.asarray(self._encode([head])[0].ids, dtype=np.int32)
            self._heads[head] = cached
        return cached


def prefix_encode(
    encode_offsets: Encode, text: str, spans: list[tuple[int, int]], limit: int
) -> Any:
    """``Longer`` for a text too long to fit in ``limit`` tokens, from prefix encodes with
    offsets (module docstring); None when the text is short enough to encode whole, or the
    prefix encodes do not agree (then it is). Raises MalformedRow when nothing in it is
    supervised."""
    if not PREFIX_CHARS_PER_TOKEN:
        return None
    need = limit + 1 + PREFIX_MARGIN
    cut = need * int(PREFIX_CHARS_PER_TOKEN)
    while cut < len(text):
        if not any(b > a for a, b in spans):  # what the whole encode would say
            raise MalformedRow("no_supervised_tokens", "no assistant token survives rendering")
        longer = min(len(text), cut + max(cut // 4, 1024))
        a, b = encode_each(encode_offsets, [text[:cut], text[:longer]])
        if isinstance(a, MalformedRow) or isinstance(b, MalformedRow):
            return None
        if len(a.ids) >= need:
            ids = np.asarray(a.ids[: limit + 1], dtype=np.int32)
            if len(b.ids) < limit + 1 or not np.array_equal(ids, b.ids[: limit + 1]):
                log.debug("prefix encodes disagree: tokenizing %d characters", len(text))
                return None
            inside = [(lo, min(hi, cut)) for lo, hi in spans if lo < cut]
            mask = token_mask(a, inside, len(a.ids))[: limit + 1]
            return Longer(ids, mask, len(text))
        cut *= 4
    return None


def span_mask(token_spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """uint8 mask of ``n`` tokens, 1 inside the token ranges."""
    mask = np.zeros(n, dtype=np.uint8)
    for lo, hi in token_spans:
        mask[lo:hi] = 1
    return mask


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
