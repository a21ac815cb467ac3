"""``dflash-train regen``: rewrite each sample's response with the target's greedy output.

Released DFlash drafters are trained on responses the target itself generated: the drafter
learns to predict *the target*, which is what speculative decoding rewards. For a sample
whose first supervised token is at ``s`` (``loss_mask`` 1), the prompt is ``ids[:s]`` (at
least one token) and everything from ``s`` to the end is replaced by the target's greedy
continuation of the prompt, as many tokens as there were (cut after an EOS if the model has
one). The loss mask is kept, so the schema and, without EOS, the lengths stay the same:
``input_ids`` ``list<int32>``, ``loss_mask`` ``list<uint8>``, one Arrow IPC file, which the
loader serves as it is. Multi-turn samples (several supervised spans) get everything after
the first span's start regenerated: right for one-turn chat data, approximate otherwise.

Batching: samples are read in chunks; inside a chunk they are sorted by response length and
generated ``batch_size`` at a time with left padding, so a batch runs about as many decoding
steps as its longest member needs. The last ``holdout`` samples are left out of the corpus
and their prompts written to a JSONL file (``trainer.data.corpus.write_heldout``) the trainer
uses as held-out verifier prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import pyarrow as pa
import torch

from loader_server.data.dataset import ArrowDataset, open_dataset, record_batch
from trainer.data.corpus import SCHEMA, HeldoutPrompt, read_heldout, write_heldout
from trainer.files import atomic_output, check_output
from trainer.model.target import Target
from trainer.options import RegenOptions
from trainer.progress import progress_bar

if TYPE_CHECKING:
    from transformers import GenerationMixin


def split_prompt(mask: np.ndarray) -> int:
    """Index of the first supervised token (at least 1, so the prompt is never empty);
    ``len(mask)`` when nothing is supervised (the sample is kept as it is)."""
    hits = np.flatnonzero(mask)
    return len(mask) if hits.size == 0 else max(int(hits[0]), 1)


@torch.no_grad()
def greedy_batch(target: Target, prompts: list[np.ndarray], max_new: list[int]) -> list[np.ndarray]:
    """Greedy continuations, ``max_new[i]`` tokens for ``prompts[i]``, one left-padded batch."""
    device = target.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.from_numpy(p.astype(np.int64))
        attn[r, width - len(p) :] = 1
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    model = cast("GenerationMixin", target.model)  # a causal LM: it generates
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        max_new_tokens=max(max_new),
        do_sample=False,
        pad_token_id=0,
    )
    new = out[:, width:].cpu().numpy()
    eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    result = []
    for r, n in enumerate(max_new):
        toks = new[r, :n]
        stop = next((i for i, t in enumerate(toks) if int(t) in eos_ids), None)
        result.append(toks if stop is None else toks[: stop + 1])
    return result


def _regen_chunk(
    target: Target,
    ids: list[np.ndarray],
    masks: list[np.ndarray],
    batch_size: int,
    tick: Callable[[int], None],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    splits = [split_prompt(m) for m in masks]
    todo = sorted(
        (i for i in range(len(ids)) if splits[i] < len(ids[i])),
        key=lambda i: len(ids[i]) - splits[i],
    )
    out_ids, out_masks = list(ids), list(masks)
    for lo in range(0, len(todo), batch_size):
        part = todo[lo : lo + batch_size]
        gen = greedy_batch(
            target, [ids[i][: splits[i]] for i in part], [len(ids[i]) - splits[i] for i in part]
        )
        for i, g in zip(part, gen, strict=True):
            out_ids[i] = np.concatenate([ids[i][: splits[i]], g]).astype(np.int32)
            out_masks[i] = masks[i][: len(out_ids[i])].astype(np.uint8)
        tick(len(part))
    tick(len(ids) - len(todo))
    return out_ids, out_masks


def regen_corpus(
    target: Target,
    src: Path,
    out: Path,
    spec: RegenOptions,
    *,
    holdout_out: Path | None = None,
    progress: bool = True,
    force: bool = False,
) -> dict[str, object]:
    """Write the regenerated corpus to ``out`` (one Arrow IPC file, built beside it and
    moved into place: ``trainer.files.atomic_output``; an existing ``out`` or held-out file
    needs ``force``), and the held-out prompts to ``holdout_out`` once the corpus is made
    (a regen that fails leaves neither). A token id outside the target's vocabulary is
    refused before anything is generated."""
    check_output(Path(out), inputs=[src], force=force)
    if holdout_out is not None and spec.holdout:
        check_output(Path(holdout_out), inputs=[src], force=force)
    ds = open_dataset(src, vocab_size=target.vocab_size)  # every id the target can read
    n_keep = len(ds) - spec.holdout
    if n_keep < 1:
        fix = f"--holdout {len(ds) - 1} or less" if len(ds) > 1 else "--holdout 0"
        raise ValueError(
            f"{src}: --holdout {spec.holdout} leaves no sample to regenerate: the corpus has "
            f"{len(ds)}. Pass {fix}"
        )
    n = n_keep if spec.limit is None else min(spec.limit, n_keep)
    bar = progress_bar(n, "regen", "sample", progress)
    tokens = 0
    with (
        atomic_output(Path(out), folder=False, force=force, inputs=[src]) as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        pa.ipc.new_file(sink, SCHEMA) as writer,
    ):
        for lo in range(0, n, spec.chunk_samples):
            rows = range(lo, min(lo + spec.chunk_samples, n))
            ids = [np.asarray(ds.input_ids(i)) for i in rows]
            masks = [_mask(ds, i, len(ids[k])) for k, i in enumerate(rows)]
            new_ids, new_masks = _regen_chunk(target, ids, masks, spec.batch_size, bar.update)
            tokens += sum(len(x) for x in new_ids)
            writer.write_batch(_record_batch(new_ids, new_masks))
        if holdout_out is not None and spec.holdout:  # last: a failed regen leaves neither
            held = heldout_prompts(ds, src, range(n_keep, len(ds)))
            write_heldout(holdout_out, held, force=force, inputs=[src])
    bar.close()
    return {"samples": n, "tokens": tokens, "holdout": spec.holdout, "out": str(out)}


def _mask(ds: ArrowDataset, i: int, length: int) -> np.ndarray:
    if not ds.has_loss_mask:
        return np.ones(length, dtype=np.uint8)
    return np.asarray(ds.loss_mask(i)).astype(np.uint8)


def _record_batch(ids: list[np.ndarray], masks: list[np.ndarray]) -> pa.RecordBatch:
    lengths = np.array([len(x) for x in ids], dtype=np.int32)
    flat_ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return record_batch(flat_ids, flat_mask, lengths)


def heldout_prompts(ds: ArrowDataset, src: Path, rows: range) -> Iterator[HeldoutPrompt]:
    """The prompt (tokens before the first supervised one) of each of ``rows`` of ``ds``."""
    for i in rows:
        ids = np.asarray(ds.input_ids(i))
        s = split_prompt(_mask(ds, i, len(ids)))
        yield HeldoutPrompt(i, ids[:s].tolist(), str(src), i)


def load_prompts(
    path: Path, max_prompt_len: int | None = None, vocab_size: int | None = None
) -> list[torch.Tensor]:
    """The held-out prompts of ``path`` (``trainer.data.corpus.read_heldout``) as tensors."""
    prompts = read_heldout(path, max_prompt_len, vocab_size)
    return [torch.tensor(p, dtype=torch.long) for p in prompts]
