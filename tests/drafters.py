"""Drafters trained by the real loop for the export, sliding-window and DFlash2 tests: the
target's greedy continuations as a corpus, one run of ``Trainer`` saving checkpoints as
``dflash-train train`` does, the trained drafter read back, random documents, and the
options and edited folders the ``--init-drafter`` tests use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.hf.export import read_trained_drafter
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, apply_rotary, rotary
from trainer.model.verifier import greedy_generate
from trainer.options import TargetOptions
from trainer.run import run_meta
from trainer.sections import RunOptions
from trainer.train.batches import ListSource
from trainer.train.distributed import local_env
from trainer.train.loop import Trainer


def in_process(run_dir: Path, loss: LossConfig, **kw: Any) -> RunOptions:
    """The options of a trainer run in this process (no loader, no progress bar): ``loss``
    as its options, ``kw`` for the rest."""
    return RunOptions(
        endpoint="in-process", run_dir=run_dir, no_progress=True, **{**loss.options(), **kw}
    )


def greedy_samples(target, vocab: int, n: int = 8) -> list[tuple[list[int], list[int]]]:
    """``n`` random 8-token prompts (ids below ``vocab``) with the target's 32-token greedy
    continuations, all supervised: a drafter learns them in a few steps."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, vocab, (8,), generator=g)
        out.append((torch.cat([prompt, greedy_generate(target, prompt, 32)]).tolist(), [1] * 40))
    return out


def train_run(
    target, samples, run_dir: Path, drafter: DFlashDrafter, loss: LossConfig, steps: int,
    *, resume: bool = False,
) -> Path:  # fmt: skip
    """``steps`` optimizer steps of ``drafter`` on ``samples`` (4 rows per micro-batch)."""
    tc = in_process(run_dir, loss, steps=steps, lr=3e-3, warmup=2, resume=resume)
    Trainer(
        tc, target=target, drafter=drafter, source=ListSource(samples, rows=4), env=local_env(),
        meta=run_meta(TargetOptions(), target),
    ).run()  # fmt: skip
    return run_dir


def trained_drafter(run_dir: Path) -> DFlashDrafter:
    """The newest checkpoint's drafter of ``run_dir``, in eval mode."""
    src = read_trained_drafter(run_dir)
    drafter = DFlashDrafter(src.config)
    drafter.load_state_dict(src.weights)
    return drafter.eval()


def random_docs(n_docs: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n_docs`` documents of random ids (1..511) of 20, 27, 34, ... tokens, the first 5 of
    each unsupervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(n_docs):
        n = 20 + 7 * d
        out.append((torch.randint(1, 512, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5)))
    return out


def run_opts(**over) -> RunOptions:
    """Train options for ``resolve_init_drafter`` and ``build_drafter`` (nothing runs)."""
    base = dict(endpoint="unused", run_dir=Path("unused"), attention="sdpa", steps=1)
    return RunOptions(**{**base, **over})


def edited(folder: Path, dest: Path, **changes) -> Path:
    """A copy of drafter ``folder`` at ``dest`` with top-level config keys replaced, and
    ``dflash_config`` keys merged (a None value removes the key)."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            cfg[key] = {k: v for k, v in {**cfg[key], **value}.items() if v is not None}
        else:
            cfg[key] = value
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def dense_layout(drafter: DFlashDrafter, feats: torch.Tensor, anchors: list[int], b: int):
    """The written-out references' setup for one document's blocks at ``anchors``: the
    dense mask ``[A*B, T + A*B]`` (context before the anchor, the whole own block), the
    projected context ``[T, H]``, and the rotations of the queries and of the keys."""
    cfg = drafter.config
    a = torch.tensor(anchors)
    t = torch.arange(feats.shape[1])
    blk = torch.arange(len(anchors) * b) // b
    mask = torch.cat([t[None, :] < a[blk][:, None], blk[:, None] == blk[None, :]], dim=1)
    ctx = drafter.hidden_norm(drafter.fc(feats[0]))
    pos = (a[:, None] + torch.arange(b)).view(-1)
    rope_k = rotary(torch.cat([t, pos]), cfg.head_dim, cfg.rope_theta)
    return mask, ctx, rotary(pos, cfg.head_dim, cfg.rope_theta), rope_k


def dense_attention(att, x, ctx, mask, rope_q, rope_k) -> torch.Tensor:
    """A drafter attention written out: block queries ``x [S, H]`` over ``[ctx; x]`` under
    a dense ``mask``, one SDPA call; ``o_proj``'s output ``[S, H]``."""
    kv_in = torch.cat([ctx, x])
    q = apply_rotary(att.q_norm(att._split(att.q_proj(x), att.heads)), *rope_q)
    k = apply_rotary(att.k_norm(att._split(att.k_proj(kv_in), att.kv_heads)), *rope_k)
    v = att._split(att.v_proj(kv_in), att.kv_heads)
    rep = att.heads // att.kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
    return att.o_proj(o.transpose(1, 2).reshape(x.shape[0], -1))
