"""Steps whose micro-batches hold anchors but no supervised slot, on two gloo ranks
(``tests/integration/test_step_objective.py``):

    python -m torch.distributed.run --standalone --nproc-per-node 2 empty_slots.py OUT

A DFlash2 drafter (its candidate selector runs outside the drafter's forward, so a rank
whose loss never reaches it leaves DDP's reducer out of step) trains, under each
normalization, three steps of two micro-batches per rank:

1. "mixed": rank 0's last micro-batch (the one DDP synchronizes) holds only documents
   whose anchors predict unsupervised tokens (a supervised token every B-th position), the
   rest are ordinary;
2. "mixed" again (DDP reports a parameter that got no gradient at the *next* forward);
3. "empty": every micro-batch of both ranks is such documents: no rank has weight.

Rank 0 writes ``OUT/<normalization>.json``: each step's record (loss, whether it was
applied), whether every gradient was finite, and how far the weights moved in each step.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import TinyTargetSpec, load_target
from trainer.sections import RunOptions
from trainer.train.batches import Batch, pack_batch
from trainer.train.distributed import barrier, init_distributed, shutdown
from trainer.train.loop import Trainer
from trainer.train.step import step_record

B = 4
VOCAB = 256
STEPS = ("mixed", "mixed", "empty")


def document(seed: int, *, slots: bool) -> tuple[list[int], list[int]]:
    """64 random ids; supervised mostly (``slots``), or only every B-th token: 16 anchors'
    worth of supervised tokens (>= 2B: the document is kept), none at an anchor's offsets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (64,), generator=g).tolist()
    mask = [1] * 64 if slots else [int(t % B == 0) for t in range(64)]
    return ids, mask


class Steps:
    """This rank's micro-batches of the three steps, as a ``BatchSource``."""

    def __init__(self, rank: int) -> None:
        self.batches: list[Batch] = []
        for step, kind in enumerate(STEPS):
            for micro in range(2):
                slots = kind == "mixed" and not (rank == 0 and micro == 1)
                docs = [document(100 * step + 10 * rank + micro + k, slots=slots) for k in (0, 1)]
                ids = [1000 * step + 100 * rank + 10 * micro + k for k in (0, 1)]
                self.batches.append(pack_batch(docs, sample_ids=ids, step=step, micro=micro,
                                               steps_per_epoch=len(STEPS)))  # fmt: skip
        self.steps_per_epoch = len(STEPS)
        self.effective_spec: dict[str, Any] = {"grad_accum": 2}

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def run(out: Path, env: Any, normalization: str) -> None:
    shape = TinyTargetSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, seed=3)
    target = load_target("tiny", tiny=shape, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=VOCAB - 1,
        variant="dflash2", selector_rank=8, selector_top_k=5, conv_group_size=32,
    )  # fmt: skip
    drafter = DFlashDrafter(cfg)
    opts = RunOptions(
        endpoint="in-process", run_dir=out / "runs" / f"{normalization}-{env.rank}",
        steps=len(STEPS), grad_accum=2, block_size=B, anchors_per_doc=8, tokens_per_anchor=2,
        loss_normalization=normalization, cost_samples=0, no_progress=True, log_every_s=0,
        warmup=0, lr=1e-2, weight_decay=0.1,
    )  # fmt: skip
    trainer = Trainer(opts, target=target, drafter=drafter, source=Steps(env.rank), env=env)
    it = iter(trainer.source)
    assert trainer._begin(it)
    steps = []
    for _ in STEPS:
        before = [p.detach().clone() for p in drafter.parameters()]
        grads_finite = True

        def hook(grad: torch.Tensor) -> None:
            nonlocal grads_finite
            grads_finite &= bool(torch.isfinite(grad).all())

        handles = [p.register_hook(hook) for p in drafter.parameters()]
        raw = trainer.train_step(it)
        for h in handles:
            h.remove()
        rec = step_record(raw, env, step=trainer.step, epoch=0, normalization=normalization)
        moved = max(float((p.detach() - b).abs().max()) for p, b in
                    zip(drafter.parameters(), before, strict=True))  # fmt: skip
        steps.append({"loss": rec["loss"], "blocks": rec["blocks"], "moved": moved,
                      "grads_finite": grads_finite,
                      "skipped_nonfinite": rec.get("skipped_nonfinite", 0),
                      "skipped_empty": rec.get("skipped_empty", 0)})  # fmt: skip
    if env.is_main:
        (out / f"{normalization}.json").write_text(json.dumps(steps))
    trainer._close()
    del trainer
    gc.collect()


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed("cpu")
    torch.set_num_threads(1)
    try:
        for normalization in ("step", "micro-batch"):
            run(out, env, normalization)
        barrier(env)
    finally:
        shutdown(env)


if __name__ == "__main__":
    main()
