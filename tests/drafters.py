"""Drafters trained by the real loop for the export and sliding-window tests: the target's
greedy continuations as a corpus, and one run of ``Trainer`` saving checkpoints as
``dflash-train train`` does."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter
from trainer.model.verifier import greedy_generate
from trainer.options import TargetOptions
from trainer.run import run_meta
from trainer.train.batches import ListSource
from trainer.train.distributed import local_env
from trainer.train.loop import TrainConfig, Trainer


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
    tc = TrainConfig(
        run_dir=run_dir, loss=loss, steps=steps, lr=3e-3, warmup=2, progress=False,
        resume=resume,
    )  # fmt: skip
    Trainer(
        tc, target=target, drafter=drafter, source=ListSource(samples, rows=4), env=local_env(),
        meta=run_meta(TargetOptions(), target),
    ).run()  # fmt: skip
    return run_dir
