"""A tokenizer's chat template as the chat encoder renders it (``ChatTemplate``): a
conversation's text (a template error becomes the row's ``MalformedRow``), the scaffolding
around each message of a role sequence, and the string that ends an assistant turn.

* Per role sequence (``("system", "user", "assistant")``...), the template is rendered once
  with sentinel contents; splitting that text at the sentinels gives the scaffolding around
  each message (its *skeleton*, cached). The end-of-turn string is learned once, from the
  scaffolding after a final assistant reply: up to and including its first added token.
* Rendering calls the compiled template directly when it renders probes exactly as
  ``apply_chat_template`` does (that call spends about as long again copying the messages).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.data.messages import MalformedRow, clip

#: A character no real content holds: contents are replaced by marks built from it.
SENTINEL = "\x00"


@dataclass(frozen=True)
class Skeleton:
    """The template's text around the messages of one role sequence."""

    scaffold: tuple[str, ...]  # len(roles) + 1 pieces
    eot_follows: tuple[bool, ...]  # per message: the end-of-turn string starts the next piece


class ChatTemplate:
    """Render conversations with ``tokenizer``'s chat template, ``kwargs`` passed to it
    (``enable_thinking``); ``added`` finds the tokenizer's added tokens (the end of turn
    ends at the first). ``name`` names the tokenizer in errors."""

    def __init__(
        self, tokenizer: Any, name: str, kwargs: dict[str, Any], added: re.Pattern[str]
    ) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self._kwargs = kwargs
        self._render_text = self._direct_renderer() or self._apply_template
        self._skeletons: dict[tuple[str, ...], Skeleton | None] = {}
        self.end_of_turn = self._learn_end_of_turn(added)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation's text; raises MalformedRow (``template_error``)."""
        try:
            return self._render_text(messages, add_generation_prompt)
        except Exception as e:  # the template is arbitrary code; report its error per row
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MalformedRow("template_error", clip(first, 120)) from None

    def reference_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """``apply_chat_template(tokenize=True)``'s ids: what the encoder's must equal."""
        out = self._tokenizer.apply_chat_template(messages, tokenize=True, **self._kwargs)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def skeleton(self, roles: tuple[str, ...]) -> Skeleton | None:
        """The scaffolding around messages of these roles (cached), or None when the
        template does not render sentinel contents verbatim, once each."""
        if roles not in self._skeletons:
            if len(self._skeletons) >= 4096:
                self._skeletons.clear()
            self._skeletons[roles] = self._build_skeleton(roles)
        return self._skeletons[roles]

    def _apply_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
        )

    def _direct_renderer(self) -> Callable[[list[dict[str, str]], bool], str] | None:
        """The compiled template called directly: ``apply_chat_template`` spends about as long
        again copying the messages (ours are plain strings already). Used only if it renders
        the probes exactly as ``apply_chat_template`` does."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self._tokenizer.chat_template)
        except Exception:
            return None
        env = {**self._tokenizer.special_tokens_map, **self._kwargs}

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

    def _build_skeleton(self, roles: tuple[str, ...]) -> Skeleton | None:
        scaffold = self._scaffold(roles)
        if scaffold is None:
            return None
        eot = self.end_of_turn
        follows = tuple(
            bool(eot) and r == "assistant" and scaffold[k + 1].startswith(eot)
            for k, r in enumerate(roles)
        )
        return Skeleton(scaffold, follows)

    def _scaffold(self, roles: tuple[str, ...]) -> tuple[str, ...] | None:
        """The text around sentinel contents, ``len(roles) + 1`` pieces; None when a
        content is not rendered verbatim, once, in order."""
        marks = [f"{SENTINEL}{k}{SENTINEL}" for k in range(len(roles))]
        try:
            text = self.render(
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
        if any(SENTINEL in p for p in pieces):  # a content rendered twice or mangled
            return None
        return tuple(pieces)

    def _learn_end_of_turn(self, added: re.Pattern[str]) -> str:
        """What closes an assistant reply: the text after a final reply's content up to and
        including the first added token ('' when the template adds none)."""
        scaffold = self._scaffold(("user", "assistant"))
        if scaffold is None:
            raise ValueError(
                f"{self.name}: the chat template cannot render a user/assistant conversation "
                f"with its contents verbatim"
            )
        tail = scaffold[-1]
        m = added.search(tail)
        return tail[: m.end()] if m else ""
