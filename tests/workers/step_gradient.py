"""One optimizer step's gradient over the same documents, however the step is cut
(``tests/integration/test_step_objective.py``). Run as one process for the cuts of one
rank, or under torchrun with 2 gloo ranks on CPU for the cuts of two:

    python step_gradient.py OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 step_gradient.py OUT

For every layout (padded, packed), dtype (float32, float64), objective (the step
normalization with the decay or D-PACE weights, the old micro-batch normalization; under
D-PACE in packed rows and float64 also divided by the slots or per document) and cut
of this world size, a trainer (``trainer.train.loop.Trainer``, DDP under 2 ranks) runs
``step_gradients`` over hand-cut micro-batches of the same 12 documents; rank 0 writes the
drafter's gradients and the step's logged loss to
``OUT/<layout>-<dtype>-<normalization>-<weighting>[-<divisor>]-<cut>.pt``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import TinyTargetSpec, load_target
from trainer.sections import RunOptions
from trainer.train.batches import Batch, pack_batch, pad_batch
from trainer.train.distributed import barrier, init_distributed, shutdown
from trainer.train.loop import Trainer
from trainer.train.step import StepResult, StepSums, step_record

B = 4
VOCAB = 256
# Two long documents and ten short ones: a micro-batch of one long document holds many
# more blocks than one of a few short ones (and the old normalization weighs them alike).
LENGTHS = (150, 120, 22, 30, 26, 40, 24, 28, 35, 21, 33, 25)
LONG, SHORT = [0, 1], list(range(2, 12))
#: Documents of each (rank, micro) of a cut, per world size.
CUTS: dict[int, dict[str, list[list[list[int]]]]] = {
    1: {
        "1x1": [[LONG + SHORT]],
        "1x4": [[[0], [1], SHORT[:8], SHORT[8:]]],
    },
    2: {
        "2x2": [[[0, *SHORT[:3]], [SHORT[3]]], [[1], SHORT[4:]]],
    },
}


def documents() -> list[tuple[list[int], list[int]]]:
    """The 12 documents: random ids, a prompt unsupervised, the rest mostly supervised."""
    g = torch.Generator().manual_seed(11)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        mask = (torch.rand(n, generator=g) < 0.85).int()
        mask[: n // 5] = 0
        out.append((ids, mask.tolist()))
    return out


class CutSource:
    """This rank's micro-batches of one step, as a ``BatchSource``."""

    def __init__(self, batches: list[Batch], grad_accum: int) -> None:
        self.batches = batches
        self.steps_per_epoch = 1
        self.effective_spec: dict[str, Any] = {"grad_accum": grad_accum}

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


#: (normalization, weighting, divisor) of the runs; the divisors other than the weights'
#: under D-PACE, in packed rows and float64 (their own files: ``...-dpace-slots-...``).
OBJECTIVES = (("step", "decay", "weight"), ("micro-batch", "decay", "weight"),
              ("step", "dpace", "weight"), ("step", "dpace", "slots"),
              ("step", "dpace", "sequence"))  # fmt: skip


def one_cut(
    out: Path, env, layout: str, dtype: torch.dtype, objective: tuple[str, str], cut: str
) -> None:
    norm, weighting, divisor = objective
    name = "-".join([norm, weighting] + ([divisor] if divisor != "weight" else []))
    docs = documents()
    mine = CUTS[env.world_size][cut][env.rank]
    make = pack_batch if layout == "packed" else pad_batch
    batches = [
        make([docs[i] for i in part], sample_ids=part, micro=m, steps_per_epoch=1)
        for m, part in enumerate(mine)
    ]
    shape = TinyTargetSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, seed=3)
    target = load_target("tiny", tiny=shape, dtype=dtype)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=VOCAB - 1
    )
    drafter = DFlashDrafter(cfg).to(dtype)
    loss = LossConfig(block_size=B, anchors_per_doc=9, tokens_per_anchor=3, normalization=norm,
                      weighting=weighting, divisor=divisor)  # fmt: skip
    run_dir = out / "runs" / f"{layout}-{name}-{cut}-{env.rank}"
    train = RunOptions(
        endpoint="in-process", run_dir=run_dir,
        steps=1, grad_accum=len(mine), cost_samples=0, no_progress=True, log_every_s=0,
        **loss.options(),
    )  # fmt: skip
    trainer = Trainer(train, target=target, drafter=drafter, source=CutSource(batches, len(mine)),
                      env=env)  # fmt: skip
    sums: StepSums = trainer.step_gradients(iter(trainer.source))
    sums.step_time += 1.0  # the record's rates divide by it
    rec = step_record(
        StepResult(sums, torch.zeros(()), 0.0), env, step=1, epoch=0, normalization=norm
    )
    if env.is_main:
        grads = {n: p.grad.detach().double().clone() for n, p in drafter.named_parameters()}
        file = f"{layout}-{str(dtype).split('.')[-1]}-{name}-{cut}.pt"
        torch.save({"grads": grads, "loss": rec["loss"], "blocks": rec["blocks"]}, out / file)
    # Each cut's DDP wrapper and writer threads go before the next (and before the process
    # group at the end): a DDP reducer outliving its group aborts the process at exit.
    trainer._close()
    del trainer
    gc.collect()


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed("cpu")
    torch.set_num_threads(1)
    try:
        for layout in ("padded", "packed"):
            for dtype in (torch.float32, torch.float64):
                for objective in OBJECTIVES:
                    # the old normalization and the other divisors are read in float64 only
                    # (the divisors in packed rows)
                    norm, _, divisor = objective
                    if (norm != "step" or divisor != "weight") and dtype != torch.float64:
                        continue
                    if divisor != "weight" and layout != "packed":
                        continue
                    for cut in CUTS[env.world_size]:
                        one_cut(out, env, layout, dtype, objective, cut)
        barrier(env)
    finally:
        shutdown(env)


if __name__ == "__main__":
    main()
