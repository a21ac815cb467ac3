"""Where each assistant reply's supervised text lies in a rendered conversation: character
spans ``[a, b)``, in order (``SpanFinder``; the rule they follow is in
``trainer.data.encoder``'s docstring).

* Each conversation is rendered once; if the text equals the skeleton with the real contents
  put in, every content's character span is known by arithmetic (the fast path). Otherwise
  the template changed the content (stripped it, split a think block out of it...) and the
  exact fallback renders the conversation again once per assistant message with that
  message's content replaced by a *structure-preserving* sentinel: its markup kept, each run
  of text between markup that is not only whitespace replaced by a distinct mark (without
  the run's surrounding whitespace: where the template keeps the content's whitespace, the
  renders differ there too), whitespace-only runs between markup kept. The template then
  takes the same branches as for the real content (it finds the same ``</think>``), and
  the part of the text that differs runs from the first surviving run to the last. It is
  widened over the markup the content has before its first surviving run (after the last
  dropped one) and after its last, where the real text has it right there, then over the
  end-of-turn string (right after, or after only whitespace). A content of markup alone is
  replaced whole by one mark. Fallbacks are counted in the report.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from trainer.data.template import SENTINEL, ChatTemplate

Span = tuple[int, int]


class _Run(NamedTuple):
    """A run of a content's text between its markup, as the exact fallback marks it:
    ``before``/``after``: the added-token strings between it and the previous/next run
    (or the content's start/end)."""

    mark: str
    before: tuple[str, ...]
    after: tuple[str, ...]


class SpanFinder:
    """The supervised character spans of conversations rendered by ``template``; ``added``
    finds the tokenizer's added tokens (the markup a content may hold). ``fallbacks``
    counts the conversations the exact fallback placed."""

    def __init__(self, template: ChatTemplate, added: re.Pattern[str]) -> None:
        self._template = template
        self._added = added
        self.fallbacks = 0

    def spans(self, text: str, messages: list[dict[str, str]]) -> list[Span]:
        """The spans of ``messages``' assistant replies in ``text``, their render; raises
        MalformedRow when a fallback render fails."""
        spans = self._spans_fast(text, messages)
        if spans is None:
            self.fallbacks += 1
            spans = self._spans_exact(text, messages)
        return spans

    def _spans_fast(self, text: str, messages: list[dict[str, str]]) -> list[Span] | None:
        sk = self._template.skeleton(tuple(m["role"] for m in messages))
        if sk is None:
            return None
        parts, spans, pos = [sk.scaffold[0]], [], len(sk.scaffold[0])
        eot = len(self._template.end_of_turn)
        for k, m in enumerate(messages):
            c, after = m["content"], sk.scaffold[k + 1]
            parts += (c, after)
            if m["role"] == "assistant":
                spans.append((pos, pos + len(c) + (eot if sk.eot_follows[k] else 0)))
            pos += len(c) + len(after)
        return spans if "".join(parts) == text else None

    def _spans_exact(self, text: str, messages: list[dict[str, str]]) -> list[Span]:
        """Per assistant message, render once more with its content replaced by its
        structure-preserving sentinel (module docstring): the characters that differ are
        its rendered text, widened over the content's own markup the text keeps at its
        edges, then the end-of-turn string."""
        spans: list[Span] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            done = spans[-1][1] if spans else 0  # widening never reaches into the last reply
            spans += [(max(a, done), b) for a, b in self._message_spans(text, messages, k)]
        return spans

    def _message_spans(self, text: str, messages: list[dict[str, str]], k: int) -> list[Span]:
        m = messages[k]
        sentinel, runs = self._structure(m["content"])
        other = self._template.render(
            [*messages[:k], {**m, "content": sentinel}, *messages[k + 1 :]]
        )
        a = _common_prefix(text, other)
        b = len(text) - _common_suffix(text, other, min(len(text), len(other)) - a)
        if b <= a:
            return []
        first = next((r for r in runs if r.mark in other), None)
        if first is not None and other.startswith(first.mark, a):
            a = _markup_before(text, a, first.before)
        last = next((r for r in reversed(runs) if r.mark in other), None)
        end = b + len(other) - len(text)  # b's place in the sentinel render
        if (
            last is not None
            and end >= len(last.mark)
            and other.startswith(last.mark, end - len(last.mark))
        ):
            b = _markup_after(text, b, last.after)
        return self._with_end_of_turn(text, a, b)

    def _with_end_of_turn(self, text: str, a: int, b: int) -> list[Span]:
        """``[a, b)`` widened over the end-of-turn string right after it, or with it as a
        span of its own after only whitespace (the template's, after closing markup)."""
        eot = self._template.end_of_turn
        if eot and text.startswith(eot, b):
            return [(a, b + len(eot))]
        j = text.find(eot, b) if eot else -1
        if j > b and text[b:j].isspace():  # the template's whitespace after closing markup
            return [(a, b), (j, j + len(eot))]
        return [(a, b)]

    def _structure(self, content: str) -> tuple[str, list[_Run]]:
        """The content with each run of text between its added-token strings that is not
        only whitespace replaced by a distinct mark (the run's own leading and trailing
        whitespace dropped), whitespace-only runs kept between markup and dropped at the
        content's ends; and the runs, each with the markup between it and its neighbours.
        A content with no such run (markup only) is one mark as a whole."""
        pieces: list[str] = []  # alternately text run, added token, text run...
        pos = 0
        for t in self._added.finditer(content):
            pieces += (content[pos : t.start()], t.group())
            pos = t.end()
        pieces.append(content[pos:])
        out: list[str] = []
        runs: list[_Run] = []
        markup: list[str] = []  # added tokens since the last run
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(piece)
                markup.append(piece)
            elif piece.strip():
                if runs:
                    runs[-1] = runs[-1]._replace(after=tuple(markup))
                mark = f"{SENTINEL}{len(runs)}{SENTINEL}"
                runs.append(_Run(mark, tuple(markup), ()))
                out.append(mark)
                markup = []
            elif 0 < i < len(pieces) - 1:
                out.append(piece)
        if not runs:
            return SENTINEL, []
        runs[-1] = runs[-1]._replace(after=tuple(markup))
        return "".join(out), runs


def _markup_before(text: str, a: int, markup: tuple[str, ...]) -> int:
    """``a`` moved back over ``markup`` (added-token strings, last first) where ``text`` has
    it right before ``a``, whitespace between the strings allowed: the content's own
    leading markup the template kept."""
    for token in reversed(markup):
        j = a
        while j > 0 and text[j - 1].isspace():
            j -= 1
        if not text.startswith(token, j - len(token)):
            break
        a = j - len(token)
    return a


def _markup_after(text: str, b: int, markup: tuple[str, ...]) -> int:
    """``b`` moved forward over ``markup`` where ``text`` has it right after ``b``."""
    for token in markup:
        j = b
        while j < len(text) and text[j].isspace():
            j += 1
        if not text.startswith(token, j):
            break
        b = j + len(token)
    return b


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
