"""The loss mask with the real Qwen3 tokenizer and chat template (``qwen3_tokenizer``).

* A reply's ``<think>`` block is supervised the same in every turn position where the template
  renders it the same: the reply's own markup is content, what the template inserts (the
  empty think block before a reply without reasoning) is not, and what it drops (the
  reasoning of turns before the last user query) is not there to supervise.
* On real conversations (``scripts/fixtures/real_chats.py``) our ids and masks equal an independent
  reference: ids from tiktoken over a plain jinja2 render of the template, masks from
  Transformers' ``{% generation %}`` markers in a copy of the template that mark the same rule.
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from scripts.fixtures.qwen3_tokenizer import (
    ADDED,
    NUM_RANKS,
    PATTERN,
    TEMPLATE,
    load_ranks,
    ranks_file,
)
from scripts.fixtures.real_chats import long_set, short_set
from trainer.data.encoder import WARNED, ChatEncoder
from trainer.data.messages import MalformedRow, normalize, to_messages

REASON = "The user wants the weather; call the tool."
REPLY = f"<think>\n{REASON}\n</think>\n\ncalling the weather tool"
#: The whole reply, as the template renders it where it keeps the reasoning.
KEPT = f"<think>\n{REASON}\n</think>\n\ncalling the weather tool<|im_end|>"
LITERAL = "Close it with </think> and go on."
SYSTEM = {"role": "system", "content": "You are a weather bot."}
QUERY = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_RESULT = {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
NEXT_QUERY = {"role": "user", "content": "And tomorrow?"}
CALL = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def said(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


DONE = said("It is 21 degrees.")
DONE_TEXT = "It is 21 degrees.<|im_end|>"

#: name: (conversation, the decoded runs of supervised tokens, unbalanced replies in it)
CASES: dict[str, tuple[list[dict[str, str]], list[str], int]] = {
    "final": ([QUERY, said(REPLY)], [KEPT], 0),
    "final_after_system": ([SYSTEM, QUERY, said(REPLY)], [KEPT], 0),
    "after_last_query_then_tool_response": (
        [QUERY, said(REPLY), TOOL_RESULT, DONE],
        [KEPT, DONE_TEXT],
        0,
    ),
    "tool_call_after_last_query": (
        [QUERY, said(REPLY + CALL), TOOL_RESULT, DONE],
        [KEPT.replace("<|im_end|>", CALL + "<|im_end|>"), DONE_TEXT],
        0,
    ),
    "before_last_query": (  # the template drops the reasoning: the answer is what is left
        [QUERY, said(REPLY), NEXT_QUERY, DONE],
        ["calling the weather tool<|im_end|>", DONE_TEXT],
        0,
    ),
    "no_think_final": (  # the empty think block the template inserts is not supervised
        [QUERY, said("calling the weather tool")],
        ["calling the weather tool<|im_end|>"],
        0,
    ),
    "no_think_after_last_query": (
        [QUERY, said("calling the weather tool"), TOOL_RESULT, DONE],
        ["calling the weather tool<|im_end|>", DONE_TEXT],
        0,
    ),
    "no_newlines_final": (  # the template's own newlines fall inside the reply
        [QUERY, said(f"<think>{REASON}</think>calling the weather tool")],
        [KEPT],
        0,
    ),
    "leading_newlines_final": (  # stripped by the template: nothing to supervise
        [QUERY, said("\n\ncalling the weather tool")],
        ["calling the weather tool<|im_end|>"],
        0,
    ),
    "reasoning_only_final": (  # the blank line the template adds after </think> is not
        [QUERY, said(f"<think>\n{REASON}\n</think>")],
        [f"<think>\n{REASON}\n</think>", "<|im_end|>"],
        0,
    ),
    "close_only_final": (  # the template's <think>\n before the reply's own </think>: not
        [QUERY, said("</think>\n\ncalling the weather tool")],
        ["</think>\n\ncalling the weather tool<|im_end|>"],
        1,
    ),
    "literal_close_final": (  # read as the end of reasoning: masked as rendered, counted
        [QUERY, said(LITERAL)],
        ["Close it with \n</think>\n\n and go on.<|im_end|>"],
        1,
    ),
    "literal_close_before_last_query": (
        [QUERY, said(LITERAL), NEXT_QUERY, DONE],
        [" and go on.<|im_end|>", DONE_TEXT],
        1,
    ),
}


@pytest.fixture(scope="module")
def encoders(qwen3_tokenizer: Path) -> dict[bool | None, ChatEncoder]:
    return {
        None: ChatEncoder(qwen3_tokenizer),
        False: ChatEncoder(qwen3_tokenizer, enable_thinking=False),
    }


def supervised_runs(enc: ChatEncoder, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded runs of supervised tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    decode = enc.tokenizer.decode
    return [decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class TestThinkBlock:
    """The same reply in every turn position: exact masks, as decoded text."""

    @pytest.mark.parametrize("thinking", [None, False], ids=["default", "thinking_off"])
    @pytest.mark.parametrize("name", list(CASES))
    def test_mask(self, encoders, name, thinking):
        enc = encoders[thinking]
        conv, want, unbalanced = CASES[name]
        before = enc.notes["unbalanced_markup"]
        ids, mask = enc.encode(conv)
        assert supervised_runs(enc, ids, mask) == want
        assert enc.notes["unbalanced_markup"] - before == unbalanced
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        out = enc.tokenizer.apply_chat_template(conv, tokenize=True, **kwargs)
        assert ids.tolist() == list(out["input_ids"])

    def test_empty_think_block_is_scaffolding(self, encoders):
        enc = encoders[None]
        ids, mask = enc.encode(CASES["no_think_final"][0])
        block = enc.tokenizer.backend_tokenizer.encode("<think>\n\n</think>\n\n").ids
        at = next(i for i in range(len(ids)) if ids[i : i + len(block)].tolist() == block)
        assert not mask[at : at + len(block)].any() and mask[at + len(block)]

    def test_kept_reply_masks_alike_in_both_positions(self, encoders):
        """The bug of issue 26: the same think block, final and not, masked alike."""
        enc = encoders[None]
        final = enc.encode(CASES["final"][0])
        nonfinal = enc.encode(CASES["after_last_query_then_tool_response"][0])
        start = int(np.argmax(final[1]))
        head = final[0][start : start + 2].tolist()
        assert enc.tokenizer.convert_ids_to_tokens(head)[0] == "<think>"
        for ids, mask in (final, nonfinal):
            run = ids[mask.astype(bool)].tolist()
            assert run[:2] == head  # <think> and its newline: supervised in both

    def test_tool_role_is_not_a_message_role(self):
        """Tool results reach the template as user turns holding ``<tool_response>``: our
        message normalizer has no ``tool`` role (when it gets one, add its positions here)."""
        with pytest.raises(MalformedRow, match="unknown_role"):
            normalize([{"role": "tool", "content": "21"}], "messages", require_assistant=False)

    def test_unbalanced_markup_is_counted_and_warned_once(self, qwen3_tokenizer, caplog):
        enc = ChatEncoder(qwen3_tokenizer)
        WARNED.discard(f"{enc.name}: unbalanced_markup")
        with caplog.at_level("WARNING", logger="trainer.data.encoder"):
            for _ in range(2):
                enc.encode(CASES["literal_close_final"][0])
            enc.encode([QUERY, said("an unclosed <tool_call> here")])
            enc.encode(CASES["final"][0])
        assert enc.notes == {"unbalanced_markup": 3}
        assert [r.getMessage() for r in caplog.records] == [
            f"{enc.name}: an assistant reply has unbalanced <think>/</think> markup: it is "
            "masked as the chat template renders it; such replies are counted as "
            "unbalanced_markup"
        ]

    def test_fallback_masks_a_verbatim_reply_as_the_fast_path(self, encoders):
        """Before the last query the template renders a reply without ``</think>`` as it is.
        Alone it takes the fast path; after a reply whose think block the template drops,
        the exact fallback: its supervised text is the same (markup and whitespace at its
        edges included)."""
        enc = encoders[None]
        rng = random.Random(26)
        parts = ["\n", "\n\n", " ", "<tool_call>", "</tool_call>", "<think>", "word", "a b", "é"]
        dropped = said("<think>reasoning</think>answer")
        for _ in range(200):
            reply = "".join(rng.choice(parts) for _ in range(rng.randint(1, 6)))
            if not reply.strip():
                continue
            conv = [QUERY, said(reply), NEXT_QUERY, DONE]
            fallbacks = enc.fallbacks
            fast = supervised_runs(enc, *enc.encode(conv))
            assert enc.fallbacks == fallbacks
            exact = supervised_runs(enc, *enc.encode([QUERY, dropped, *conv]))
            assert enc.fallbacks == fallbacks + 1
            assert exact[1:] == fast, reply


# --------------------------------------------------------------------------- the reference


def marked_template(template: str) -> str:
    """The Qwen3 template with Transformers' ``{% generation %}`` markers around what the
    assistant writes, by the rule: the reply's own markup and text as the template renders
    them, from the first to the last, and ``<|im_end|>`` when anything of the reply is
    rendered; the empty think block it inserts before a reply with no ``</think>`` is not.
    The ``<think>\\n`` it writes before kept reasoning counts when the reply had ``<think>``
    before its ``</think>`` (the reply's own, kept), not otherwise."""
    kept = (
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
        " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    )
    marked_kept = """{%- set r = reasoning_content.strip('\\n') %}
                {%- set c = content.lstrip('\\n') %}
                {%- set closed = '</think>' in message.content %}
                {{- '<|im_start|>' + message.role + '\\n' }}
                {%- if not closed %}
                    {{- '<think>\\n\\n</think>\\n\\n' }}
                    {%- generation %}{{- c }}{%- endgeneration %}
                {%- else %}
                    {%- if '<think>' in message.content.split('</think>')[0] %}
                        {%- generation %}{{- '<think>\\n' + r + '\\n</think>' }}{%- endgeneration %}
                    {%- elif r %}
                        {{- '<think>\\n' }}
                        {%- generation %}{{- r + '\\n</think>' }}{%- endgeneration %}
                    {%- else %}
                        {{- '<think>\\n\\n' }}{%- generation %}{{- '</think>' }}{%- endgeneration %}
                    {%- endif %}
                    {%- if c %}
                        {%- generation %}{{- '\\n\\n' + c }}{%- endgeneration %}
                    {%- else %}
                        {{- '\\n\\n' }}
                    {%- endif %}
                {%- endif %}
                {%- set supervised = true %}"""
    verbatim = "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    marked_verbatim = (
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- generation %}{{- content }}{%- endgeneration %}"
        "{%- set supervised = content != '' %}"
    )
    end = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    marked_end = (
        "        {%- if supervised %}"
        "{%- generation %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
        "{%- else %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
        '    {%- elif message.role == "tool" %}'
    )
    for old, new, count in ((kept, marked_kept, 1), (verbatim, marked_verbatim, 2),
                            (end, marked_end, 1)):  # fmt: skip
        assert template.count(old) == count, old
        template = template.replace(old, new)
    return template


def real_conversations() -> list[list[dict[str, str]]]:
    """``short_set()`` as it is (the think block before the last query: dropped), cut after
    the first reply (final: kept), and with the second question a tool response (the first
    reply after the last query, not final: kept); and a few ``long_set()`` rows."""
    short = [to_messages(r) for r in short_set()]
    convs = list(short)
    convs += [c[:3] for c in short]
    for c in short:
        result = f"<tool_response>\n{c[3]['content']}\n</tool_response>"
        convs.append([*c[:3], {"role": "user", "content": result}, c[4]])
    convs += [to_messages(r) for r in long_set(limit=12)]
    return convs


def test_ids_and_masks_equal_an_independent_reference(qwen3_tokenizer, encoders):
    """Ids: tiktoken (Qwen's ranks, pattern and added tokens) over a plain jinja2 render of
    the template, NFC-normalized. Masks: Transformers' mask of ``marked_template``. Neither
    uses the encoder's code; both must agree with it on every conversation."""
    import tiktoken
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import PreTrainedTokenizerFast

    special = {token: NUM_RANKS + i for i, (token, _) in enumerate(ADDED)}
    tik = tiktoken.Encoding(
        name="qwen3-reference",
        pat_str=PATTERN,
        mergeable_ranks=load_ranks(ranks_file()),
        special_tokens=special,
    )
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(TEMPLATE.read_text())
    marked = marked_template(TEMPLATE.read_text())
    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen3_tokenizer))

    convs = real_conversations()
    enc = encoders[None]
    ours = enc.encode_many(convs)
    ref = hf.apply_chat_template(
        convs,
        chat_template=marked,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert hf.apply_chat_template(convs, chat_template=marked, tokenize=False) == [
        plain.render(messages=c, add_generation_prompt=False) for c in convs
    ]  # the markers add no text
    id_bad, mask_bad, kept = [], [], 0
    for k, (conv, got) in enumerate(zip(convs, ours, strict=True)):
        assert not isinstance(got, MalformedRow), got
        ids, mask = got
        text = plain.render(messages=conv, add_generation_prompt=False)
        text = unicodedata.normalize("NFC", text)  # the tokenizer's normalizer
        want_ids = tik.encode(text, allowed_special="all")
        if ids.tolist() != want_ids or ref["input_ids"][k] != want_ids:
            id_bad.append(k)
        elif mask.tolist() != ref["assistant_masks"][k]:
            mask_bad.append(k)
        kept += text.count("<think>\nThe task is")
    assert (id_bad, mask_bad) == ([], []), (id_bad[:5], mask_bad[:5])
    assert kept == 2 * 55  # the sets hold the kept think block, final and not
