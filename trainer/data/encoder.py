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
about once.

It needs no ``{% generation %}`` markers. The steps, each in its module (whose docstring
explains it), with ``ChatEncoder`` here composing them:

* ``trainer.data.template``: the template rendered once per role sequence with sentinel
  contents gives the scaffolding around each message (its skeleton) and the end-of-turn
  string;
* ``trainer.data.spans``: each reply's character span, by arithmetic when the render is the
  skeleton with the contents put in (the fast path), else by the exact fallback, which
  renders again with structure-preserving sentinels;
* ``trainer.data.token_spans``: character spans become token spans from the ids alone
  (from character offsets where a token straddles a span start), and with a token
  ``limit`` a conversation far longer than it is encoded only as a prefix (``Longer``);
* ``trainer.data.tokenizer``: the tokenizer loaded, its added tokens, and the raw encodes
  that reproduce ``apply_chat_template``'s ids.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.data.messages import MalformedRow, normalize
from trainer.data.spans import SpanFinder
from trainer.data.template import ChatTemplate
from trainer.data.token_spans import Longer, TokenPlacer, prefix_encode, span_mask, token_mask
from trainer.data.tokenizer import (
    AddedTokens,
    Encode,
    encode_each,
    load_tokenizer,
    reproducing_encodes,
)

log = logging.getLogger(__name__)

#: A conversation ready to encode: its index in the batch, rendered text, character spans.
_Todo = tuple[int, str, list[tuple[int, int]]]
#: One the anchors cannot place: its index, ids, rendered text, character spans.
_Redo = tuple[int, np.ndarray, str, list[tuple[int, int]]]


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
        kwargs = {"enable_thinking": enable_thinking} if passed else {}
        added = AddedTokens.of(self.tokenizer)
        self._template = ChatTemplate(self.tokenizer, self.name, kwargs, added.pattern)
        self.end_of_turn = self._template.end_of_turn
        self._finder = SpanFinder(self._template, added.pattern)
        self._pairs = _markup_pairs(added.ids)
        self.offset_fallbacks = 0  # conversations placed with character offsets
        self.notes: Counter[str] = Counter()  # replies worth a look, by kind
        self._encode_ids, self._encode_offsets = self._check_ids()
        self._placer = TokenPlacer(added, self._encode_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def fallbacks(self) -> int:
        """Conversations masked by the exact (re-rendering) method."""
        return self._finder.fallbacks

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
        text = self._template.render(msgs, add_generation_prompt=True)
        return np.asarray(self._encode_ids([text])[0].ids, dtype=np.int32)

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
        todo: list[_Todo] = []
        for i, messages in enumerate(conversations):
            if isinstance(messages, MalformedRow):
                continue
            try:
                text, spans = self._text_spans(messages)
                if limit is not None and (
                    cut := prefix_encode(self._encode_offsets, text, spans, limit)
                ):
                    out[i] = cut
                    continue
            except MalformedRow as e:
                out[i] = e
                continue
            todo.append((i, text, spans))
        for i, result in self._encode_batch(todo):
            out[i] = result
        return out

    # the steps

    def _text_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and its replies' character spans; raises MalformedRow."""
        text = self._template.render(messages)
        if self._pairs:
            self._note_markup(messages)
        return text, self._finder.spans(text, messages)

    def _encode_batch(self, todo: list[_Todo]) -> list[tuple[int, Any]]:
        """``(index, (ids, mask) or MalformedRow)`` of each text, encoded in one batch; the
        spans are placed from the ids, or from character offsets for the few the anchors
        cannot place."""
        done: list[tuple[int, Any]] = []
        redo: list[_Redo] = []
        encoded = encode_each(self._encode_ids, [text for _, text, _ in todo])
        for (i, text, spans), enc in zip(todo, encoded, strict=True):
            if isinstance(enc, MalformedRow):
                done.append((i, enc))
                continue
            ids = np.asarray(enc.ids, dtype=np.int32)
            token_spans = self._placer.token_spans(text, ids, spans)
            if token_spans is None:
                redo.append((i, ids, text, spans))
            else:
                done.append((i, _checked(ids, span_mask(token_spans, len(ids)))))
        if redo:
            done += self._offset_masks(redo)
        return done

    def _offset_masks(self, redo: list[_Redo]) -> list[tuple[int, Any]]:
        """The texts the anchors cannot place, encoded again (one batch) with character
        offsets: ``(index, (ids, mask) or MalformedRow)``."""
        self.offset_fallbacks += len(redo)
        encs = encode_each(self._encode_offsets, [text for _, _, text, _ in redo])
        out: list[tuple[int, Any]] = []
        for (i, ids, _, spans), enc in zip(redo, encs, strict=True):
            if isinstance(enc, MalformedRow):
                out.append((i, enc))
            else:
                out.append((i, _checked(ids, token_mask(enc, spans, len(ids)))))
        return out

    def _check_ids(self) -> tuple[Encode, Encode]:
        """Our ids must equal ``apply_chat_template(tokenize=True)``; if the raw Rust encode
        differs for this tokenizer, go through the tokenizer's own call instead. Returns the
        encodes for ids and for ids with character offsets."""
        probe = [
            {"role": "user", "content": "Hi there, what is 2+2? héllo 世界"},
            {"role": "assistant", "content": "It is 4.\n\nAnything else? 👋"},
        ]
        want = self._template.reference_ids(probe)
        encodes = reproducing_encodes(self.tokenizer, self._template.render(probe), want)
        if encodes is None:
            raise ValueError(f"{self.name}: cannot reproduce apply_chat_template's token ids")
        return encodes

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


def _checked(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | MalformedRow:
    if not mask.any():
        return MalformedRow("no_supervised_tokens", "no assistant token survives rendering")
    return ids, mask


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


WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in WARNED:
        WARNED.add(message)
        log.warning(message)
