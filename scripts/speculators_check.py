"""Our DFlash export through vllm-project/speculators, in the serve-check virtualenv.

Run by ``scripts/serve_check.py`` with the vLLM virtualenv's Python (speculators 0.9 wants
Transformers <= 5.19, which that virtualenv has; the project's does not):

    python scripts/speculators_check.py EXPORT TARGET OUT INPUTS OUTPUTS

1. speculators' own converter (``DFlashConverter``) turns the exported z-lab folder into a
   speculators checkpoint (``OUT``) and validates it (``from_pretrained``, no NaN);
2. that checkpoint, loaded by speculators' ``DFlashDraftModel`` (fp32), drafts the blocks of
   ``INPUTS`` (a ``torch.save`` dict: the target's features at the drafter's layers, token
   ids, loss mask, anchors) through its own training forward (``_backbone_forward``, its own
   attention masks); the last hidden state of every block slot and the anchors it drew go
   to ``OUTPUTS``, for serve-check to compare with the trainer's drafter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(export: str, target: str, out: str, inputs: str, outputs: str) -> None:
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash.utils import select_anchors

    DFlashConverter().convert(export, out, base_model=target, validate=True)
    model = DFlashDraftModel.from_pretrained(out).float().eval()
    x = torch.load(inputs)
    seed, anchors_n, block = 0, int(x["num_anchors"]), int(model.block_size)
    torch.manual_seed(seed)
    anchors, valid = select_anchors(x["loss_mask"], anchors_n, block)
    torch.manual_seed(seed)  # _backbone_forward draws the same anchors first
    with torch.no_grad():
        hidden, *_ = model._backbone_forward(
            x["features"].float(), x["input_ids"], x["loss_mask"],
            torch.zeros(*x["input_ids"].shape, model.config.transformer_layer_config.hidden_size),
            torch.zeros_like(x["input_ids"]), max_anchors=anchors_n,
        )  # fmt: skip
    config = json.loads((Path(out) / "config.json").read_text())
    torch.save(
        {
            "hidden": hidden[0], "anchors": anchors, "valid": valid,
            "aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids"),
            "speculators_model_type": config.get("speculators_model_type"),
        },
        outputs,
    )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:6])
