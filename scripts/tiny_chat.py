"""Local stand-ins for a real chat setup, for the demo, tests and benchmarks (no downloads).

* ``generate_conversations``: deterministic synthetic chat data in the two shapes people
  ship: ShareGPT (``{"conversations": [{"from", "value"}]}``) and OpenAI
  (``{"messages": [{"role", "content"}]}``), with system prompts and several turns.
* ``build_tokenizer``: a byte-level BPE trained on such text with the ``tokenizers`` library,
  saved as a Transformers tokenizer folder with a chat template: ``chatml`` (Qwen2.5 style:
  ``<|im_start|>role\\n...<|im_end|>\\n``) or ``qwen3`` (ChatML plus Qwen3's empty
  ``<think>\\n\\n</think>\\n\\n`` before the last assistant reply and an ``enable_thinking``
  switch; no ``{% generation %}`` markers, like the real one).

``python -m scripts.tiny_chat OUT_DIR`` writes ``OUT_DIR/tokenizer`` and
``OUT_DIR/conversations.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's shape without its tool and reasoning-content branches: the last assistant reply
# after the last user turn gets an empty think block; the generation prompt gets one when
# thinking is off.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and loop.last %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen3": QWEN3_TEMPLATE}

_WORDS = (  # noqa: SIM905
    "the a of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school"
).split()
_SYSTEM = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one paragraph.",
    "You answer questions about numbers and words.",
]


def _sentence(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(len(_WORDS), size=n_words)
    text = " ".join(_WORDS[i] for i in words)
    return text[0].upper() + text[1:] + "."


def _text(rng: np.random.Generator, n_words: int) -> str:
    out, left = [], n_words
    while left > 0:
        k = int(min(left, rng.integers(6, 18)))
        out.append(_sentence(rng, k))
        left -= k
    return " ".join(out)


def _turns(rng: np.random.Generator, words: int) -> list[tuple[str, str]]:
    turns = []
    if rng.random() < 0.4:
        turns.append(("system", _SYSTEM[int(rng.integers(len(_SYSTEM)))]))
    n = int(rng.integers(1, 4))
    for _ in range(n):
        q = max(4, int(words * 0.2 / n))
        a = max(4, int(rng.normal(words * 0.8 / n, words * 0.1 / n)))
        turns.append(("user", _text(rng, q) + " ?"))
        turns.append(("assistant", _text(rng, a)))
    return turns


def generate_conversations(n: int, *, seed: int = 0, words: int = 120) -> Iterator[dict]:
    """``n`` conversations of about ``words`` words, alternating ShareGPT and OpenAI shapes
    (even index: OpenAI ``messages``; odd: ShareGPT ``conversations``)."""
    rng = np.random.default_rng(seed)
    sharegpt_role = {"system": "system", "user": "human", "assistant": "gpt"}
    for i in range(n):
        turns = _turns(rng, words)
        if i % 2 == 0:
            yield {"id": f"c{i}", "messages": [{"role": r, "content": t} for r, t in turns]}
        else:
            yield {
                "id": f"c{i}",
                "conversations": [{"from": sharegpt_role[r], "value": t} for r, t in turns],
            }


def write_jsonl(path: Path, rows: Iterator[dict] | list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def build_tokenizer(
    out_dir: Path,
    *,
    vocab_size: int = 1024,
    template: str = "chatml",
    texts: Iterator[str] | None = None,
) -> Path:
    """Train a byte-level BPE on ``texts`` (default: generated conversations) and save a
    Transformers tokenizer folder (``AutoTokenizer.from_pretrained(out_dir)``) with the given
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = (
            m["content"] if "messages" in c else m["value"]
            for c in generate_conversations(2000, seed=12345)
            for m in c.get("messages", c.get("conversations", []))
        )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|MASK|>"],
    )
    fast.chat_template = TEMPLATES[template]
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--words", type=int, default=120)
    p.add_argument("--template", choices=sorted(TEMPLATES), default="qwen3")
    p.add_argument("--vocab-size", type=int, default=1024)
    args = p.parse_args()
    tok = build_tokenizer(args.out_dir / "tokenizer", vocab_size=args.vocab_size,
                          template=args.template)  # fmt: skip
    rows = generate_conversations(args.conversations, words=args.words)
    data = write_jsonl(args.out_dir / "conversations.jsonl", rows)
    print(f"{tok}\n{data}")


if __name__ == "__main__":
    main()
