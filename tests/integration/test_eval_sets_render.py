"""Prompt sets rendered with a real chat template (``trainer.eval.sets.render``): the Qwen3
tokenizer built offline from pinned files (``qwen3_tokenizer``), thinking off and on, and the
MT-Bench second turn after the target's own first reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.eval.sets import EvalPrompt, conversation, load_set, render, thinking_modes

pytestmark = pytest.mark.integration

EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
FASTCHAT_ROW = {
    "question_id": 81,
    "category": "writing",
    "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii.",
        "Rewrite your previous response. Start every sentence with the letter A.",
    ],
}


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer))


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_thinking_off_renders_qwen3_s_empty_think_block_and_on_does_not(tokenizer):
    humaneval = load_set("humaneval", None, limit=1)
    messages = conversation(humaneval.prompts[0], 0, [])
    off, on = (render(tokenizer, messages, thinking=t) for t in thinking_modes("both"))
    assert text(tokenizer, off).endswith("```<|im_end|>\n" + EMPTY_THINK)
    assert text(tokenizer, on).endswith("```<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in text(tokenizer, on)
    assert off[: len(on)] == on  # the same prompt, then the empty block
    user = text(tokenizer, on)
    assert user.startswith("<|im_start|>user\nWrite a solution to the following problem")
    assert "```python\nfrom typing import List\n" in user


def test_the_ids_are_the_template_s_own_and_z_lab_s_for_qwen3(tokenizer):
    # z-lab renders the text and encodes it; for Qwen3 (no BOS) that gives the same ids
    messages = [{"role": "user", "content": "How many positive divisors does 196 have?"}]
    for thinking in (False, True):
        ids = render(tokenizer, messages, thinking=thinking)
        as_text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert ids == tokenizer.encode(as_text)
        assert all(isinstance(i, int) for i in ids)


def test_the_mt_bench_second_turn_follows_the_target_s_first_reply(tokenizer, tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(FASTCHAT_ROW) + "\n")
    prompt = load_set("mt-bench", path).prompts[0]
    reply = "Aloha! My week on Oahu began at dawn on Waikiki beach."
    ids = render(tokenizer, conversation(prompt, 1, [reply]), thinking=False)
    assert text(tokenizer, ids) == (
        f"<|im_start|>user\n{FASTCHAT_ROW['turns'][0]}<|im_end|>\n"
        f"<|im_start|>assistant\n{reply}<|im_end|>\n"
        f"<|im_start|>user\n{FASTCHAT_ROW['turns'][1]}<|im_end|>\n" + EMPTY_THINK
    )


def test_a_system_prompt_is_rendered_first(tokenizer):
    prompt = EvalPrompt("1", ("Name a prime.",), "You are terse.")
    ids = render(tokenizer, conversation(prompt, 0, []), thinking=True)
    assert text(tokenizer, ids) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a prime.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_ignores_enable_thinking_renders_the_same_either_way(qwen3_tokenizer):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(qwen3_tokenizer))
    plain.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}]
    off, on = (render(plain, messages, thinking=t) for t in (False, True))
    assert off == on
    assert text(plain, on) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
