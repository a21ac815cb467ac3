"""One conversation -> ``(input_ids, loss_mask)``: rendered with the tokenizer's chat template,
tokenized, and masked to what the assistant writes (``ChatEncoder``).

The loss mask is 1 exactly on what the assistant writes, and 0 on everything else (system and
user turns, role headers, template-inserted scaffolding, the newline after ``<|im_end|>``).
An assistant message's supervised span is the rendered text derived from its content, from
its first content-derived character to its last, plus the end-of-turn string that closes it
(``<|im_end|>`` for ChatML). Markup the content itself holds at its edges (added-token strings
such as ``<think>``, ``</think>``, ``<tool_call>``) counts as content where the rendered text
has it right there (whitespace between allowed: a template may rewrite the newlines around
it); text the template inserts is scaffolding: Qwen3's empty think block before a reply
without reasoning, the ``<think>\n`` it writes before a reply that had only a ``</think>``,
the blank line it puts after a closing ``</think>`` with nothing after it. A reply therefore
gets the same mask in every turn position where the template renders it the same (Qwen3's
``<think>\nR\n</think>\n\nA`` is supervised whole, ``<think>`` included, as the final reply
and as a reply after the last user query that a tool response follows); where the template
drops part of it (Qwen3 drops the reasoning of replies before the last user query) only what
is rendered is supervised (``A<|im_end|>``). A reply whose paired markup does not balance
(a literal ``</think>`` in an ordinary reply, which Qwen3 reads as the end of reasoning) is
masked as the template renders it, counted in ``notes["unbalanced_markup"]`` and warned
about once. It needs no ``{% generation %}`` markers:

* Per role sequence (``("system", "user", "assistant")``...), the template is rendered once
  with sentinel contents; splitting that text at the sentinels gives the scaffolding around
  each message (its *skeleton*, cached). The end-of-turn string is learned once, from the
  scaffolding after a final assistant reply: up to and including its first added token.
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
* With a token ``limit`` (``--max-length``), a conversation whose rendered text is far
  longer than ``limit`` tokens can be is not tokenized whole: a prefix of its text is, long
  enough to hold ``limit`` + 1 + ``PREFIX_MARGIN`` tokens, and its first ``limit`` + 1
  tokens and mask are the whole encode's (tokenization is local: cutting the text changes
  only the tokens near the cut; each such prefix encode is checked against a second,
  longer cut, and if they disagree the conversation is tokenized whole). A 50 MB row under
  ``--max-length 4096`` then costs a render and a few small encodes (``Longer``).
* Character spans become token spans without character offsets (computing them costs about
  a third of the encode): added tokens split the text into segments tokenized independently,
  so the k-th added token in the text is the k-th added-token id, which places every span
  end (the end-of-turn token); a span start follows a short header (``assistant\\n``) whose
  own tokens, cached, must be the first tokens of its segment. When they are not (a token
  straddles header and reply), that conversation is encoded again with offsets. A token
  that straddles a span boundary counts as supervised when it overlaps the span at all, the
  rule of Transformers' own ``{% generation %}`` masks.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainer.data.messages import MalformedRow, clip, normalize

log = logging.getLogger(__name__)

_SENTINEL = "\x00"
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


class _Run(NamedTuple):
    """A run of a content's text between its markup, as the exact fallback marks it:
    ``before``/``after``: the added-token strings between it and the previous/next run
    (or the content's start/end)."""

    mark: str
    before: tuple[str, ...]
    after: tuple[str, ...]


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
        self._pairs = _markup_pairs(self._added_ids)
        self.fallbacks = 0  # conversations masked by the exact (re-rendering) method
        self.offset_fallbacks = 0  # conversations placed with character offsets
        self.notes: Counter[str] = Counter()  # replies worth a look, by kind
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
                normalized.append(normalize(list(conv), "messages", require_assistant=True))
            except MalformedRow as e:
                normalized.append(e)
        out = self.encode_normalized(normalized)  # no limit: never a Longer
        return [r for r in out if not isinstance(r, Longer)]

    def prompt_ids(self, messages: Sequence[Mapping]) -> np.ndarray:
        """The messages rendered with the generation prompt, tokenized (int32): what the model
        sees before it answers."""
        msgs = normalize(list(messages), "messages", require_assistant=False)
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
            raise MalformedRow("template_error", clip(first, 120)) from None

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
        if self._pairs:
            self._note_markup(messages)
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
        """Per assistant message, render once more with its content replaced by its
        structure-preserving sentinel (module docstring): the characters that differ are
        its rendered text, widened over the content's own markup the text keeps at its
        edges, then the end-of-turn string."""
        spans: list[tuple[int, int]] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            done = spans[-1][1] if spans else 0  # widening never reaches into the last reply
            spans += [(max(a, done), b) for a, b in self._message_spans(text, messages, k)]
        return spans

    def _message_spans(
        self, text: str, messages: list[dict[str, str]], k: int
    ) -> list[tuple[int, int]]:
        m = messages[k]
        sentinel, runs = self._structure(m["content"])
        other = self._render([*messages[:k], {**m, "content": sentinel}, *messages[k + 1 :]])
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
        eot = self.end_of_turn
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
                mark = f"{_SENTINEL}{len(runs)}{_SENTINEL}"
                runs.append(_Run(mark, tuple(markup), ()))
                out.append(mark)
                markup = []
            elif 0 < i < len(pieces) - 1:
                out.append(piece)
        if not runs:
            return _SENTINEL, []
        runs[-1] = runs[-1]._replace(after=tuple(markup))
        return "".join(out), runs

    def _note_markup(self, messages: list[dict[str, str]]) -> None:
        """Count (and warn once about) replies whose paired markup does not balance: the
        template may read it as structure (Qwen3 takes any ``</think>`` as the end of the
        reasoning); the mask follows what it renders."""
        for m in messages:
            if m["role"] != "assistant":
                continue
            c = m["content"]
            for opener, closer, pattern in self._pairs:
                if (closer in c or opener in c) and not _balanced(pattern, opener, c):
                    self.notes["unbalanced_markup"] += 1
                    key = f"{self.name}: unbalanced_markup"
                    if key not in WARNED:  # once per tokenizer, whatever the markup
                        WARNED.add(key)
                        log.warning(
                            "%s: an assistant reply has unbalanced %s/%s markup: it is masked "
                            "as the chat template renders it; such replies are counted as "
                            "unbalanced_markup",
                            self.name,
                            opener,
                            closer,
                        )
                    break

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

    def encode_normalized(
        self,
        conversations: Sequence[list[dict[str, str]] | MalformedRow],
        limit: int | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray] | Longer | MalformedRow]:
        """Normalized conversations encoded in one batch. With ``limit``, one whose text is
        too long to fit in ``limit`` tokens may come back as ``Longer`` (its first
        ``limit`` + 1 tokens, without tokenizing the rest); shorter ones are encoded whole,
        as without ``limit``. A conversation that cannot be encoded gives its
        ``MalformedRow``, never an error for the batch."""
        out: list[Any] = list(conversations)
        todo, texts, spans = [], [], []
        for i, messages in enumerate(conversations):
            if isinstance(messages, MalformedRow):
                continue
            try:
                text = self._render(messages)
                sp = self._spans(text, messages)
                if limit is not None and (cut := self._prefix_encode(text, sp, limit)):
                    out[i] = cut
                    continue
            except MalformedRow as e:
                out[i] = e
                continue
            todo.append(i)
            texts.append(text)
            spans.append(sp)
        encoded = self._encode_each(self._encode_texts, texts)
        redo = []
        for i, enc, text, sp in zip(todo, encoded, texts, spans, strict=True):
            if isinstance(enc, MalformedRow):
                out[i] = enc
                continue
            ids = np.asarray(enc.ids, dtype=np.int32)
            token_spans = self._token_spans(text, ids, sp)
            if token_spans is None:
                redo.append((i, ids, text, sp))
            else:
                out[i] = _checked(ids, _span_mask(token_spans, len(ids)))
        if redo:  # character offsets for the few the anchors cannot place
            self.offset_fallbacks += len(redo)
            encs = self._encode_each(self._encode_offsets, [r[2] for r in redo])
            for (i, ids, _, sp), enc in zip(redo, encs, strict=True):
                out[i] = (
                    enc
                    if isinstance(enc, MalformedRow)
                    else _checked(ids, token_mask(enc, sp, len(ids)))
                )
        return out

    def _encode_each(self, encode: Callable[[list[str]], list[Any]], texts: list[str]) -> list[Any]:
        """``encode(texts)``; if the batch fails, each text alone, a failing one giving its
        MalformedRow (``encode_error``) in its place."""
        if not texts:
            return []
        try:
            return encode(texts)
        except Exception:
            if len(texts) == 1:
                return [self._encode_one(encode, texts[0])]
            return [self._encode_one(encode, t) for t in texts]

    @staticmethod
    def _encode_one(encode: Callable[[list[str]], list[Any]], text: str) -> Any:
        try:
            return encode([text])[0]
        except Exception as e:  # the tokenizer's own refusal, whatever its type
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return MalformedRow("encode_error", clip(first, 120))

    def _prefix_encode(self, text: str, spans: list[tuple[int, int]], limit: int) -> Any:
        """``Longer`` for a text too long to fit in ``limit`` tokens, from prefix encodes
        (module docstring); None when the text is short enough to encode whole, or the
        prefix encodes do not agree (then it is). Raises MalformedRow when nothing in it
        is supervised."""
        if not PREFIX_CHARS_PER_TOKEN:
            return None
        need = limit + 1 + PREFIX_MARGIN
        cut = need * int(PREFIX_CHARS_PER_TOKEN)
        while cut < len(text):
            if not any(b > a for a, b in spans):  # what the whole encode would say
                raise MalformedRow("no_supervised_tokens", "no assistant token survives rendering")
            longer = min(len(text), cut + max(cut // 4, 1024))
            a, b = self._encode_each(self._encode_offsets, [text[:cut], text[:longer]])
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


def _markup_pairs(added: Mapping[str, int]) -> list[tuple[str, str, re.Pattern[str]]]:
    """Paired added tokens (``<x>``/``</x>``, ``..._start..``/``..._end..``) and a pattern
    finding either."""
    pairs = []
    for opener in added:
        if opener.startswith("<") and not opener.startswith("</"):
            for closer in ("</" + opener[1:], opener.replace("_start", "_end")):
                if closer != opener and closer in added:
                    pattern = re.compile(f"{re.escape(opener)}|{re.escape(closer)}")
                    pairs.append((opener, closer, pattern))
                    break
    return pairs


def _balanced(pattern: re.Pattern[str], opener: str, text: str) -> bool:
    depth = 0
    for m in pattern.finditer(text):
        depth += 1 if m.group() == opener else -1
        if depth < 0:
            return False
    return depth == 0


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


WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in WARNED:
        WARNED.add(message)
        log.warning(message)


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
