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

A ``DFlash2DraftModel`` export: speculators 0.9 ships no DFlash2 converter, so its DFlash
converter's recipe runs with its DFlash2 classes (the converter's config, plus the
folder's ``dflash_config`` convolution and selector fields; the weights loaded strictly
but for the verifier's, which it fills; saved, then validated by ``from_pretrained``).
Its forward adds the selector's teacher-forced candidate scores (``score_candidates`` of
the unary top-K after the true previous token) to ``OUTPUTS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def convert_dflash2(export: str, target: str, out: str) -> None:
    """DFlashConverter's steps with speculators' DFlash2 classes (see the docstring)."""
    from speculators.convert.dflash.converter import _VERIFIER_FILLED_KEYS, DFlashConverter
    from speculators.convert.utils import load_checkpoint_config, load_checkpoint_weights
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    source = load_checkpoint_config(Path(export))
    base = DFlashConverter()._build_config(source, target, None)
    fields = {k: source["dflash_config"][k] for k in DFLASH2_FIELDS}
    config = DFlash2SpeculatorConfig(**{
        **base.model_dump(exclude={"speculators_model_type", "architectures"}), **fields,
        "sliding_window_non_causal": not source.get("is_causal", True),
    })  # fmt: skip
    config.speculators_config.algorithm = "dflash2"
    model = DFlash2DraftModel(config=config)
    missing, unexpected = model.load_state_dict(load_checkpoint_weights(Path(export)), strict=False)
    if unexpected or set(missing) - _VERIFIER_FILLED_KEYS:
        raise ValueError(f"unexpected {unexpected}, missing {sorted(set(missing))}")
    model.load_verifier_weights()
    model.save_pretrained(out)
    DFlash2DraftModel.from_pretrained(out)  # the converter's validation


def main(export: str, target: str, out: str, inputs: str, outputs: str) -> None:
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash.utils import select_anchors
    from speculators.models.dflash2 import DFlash2DraftModel

    arch = json.loads((Path(export) / "config.json").read_text())["architectures"]
    dflash2 = "DFlash2DraftModel" in arch
    if dflash2:
        convert_dflash2(export, target, out)
        model = DFlash2DraftModel.from_pretrained(out).float().eval()
    else:
        DFlashConverter().convert(export, out, base_model=target, validate=True)
        model = DFlashDraftModel.from_pretrained(out).float().eval()
    x = torch.load(inputs)
    seed, anchors_n, block = 0, int(x["num_anchors"]), int(model.block_size)
    torch.manual_seed(seed)
    anchors, valid = select_anchors(x["loss_mask"], anchors_n, block)
    torch.manual_seed(seed)  # _backbone_forward draws the same anchors first
    with torch.no_grad():
        hidden, unary, _, _, block_indices = model._backbone_forward(
            x["features"].float(), x["input_ids"], x["loss_mask"],
            torch.zeros(*x["input_ids"].shape, model.config.transformer_layer_config.hidden_size),
            torch.zeros_like(x["input_ids"]), max_anchors=anchors_n,
        )  # fmt: skip
        extra = {}
        if dflash2:
            selector = model.candidate_selector
            prev = model._predecessor_ids(x["input_ids"], block_indices).reshape(1, -1)
            cands = unary.topk(selector.top_k, dim=-1).indices
            scores = selector.score_candidates(unary, hidden, prev, cands)
            extra = {"candidates": cands[0], "scores": scores[0]}
    config = json.loads((Path(out) / "config.json").read_text())
    torch.save(
        {
            "hidden": hidden[0], "anchors": anchors, "valid": valid, **extra,
            "aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids"),
            "speculators_model_type": config.get("speculators_model_type"),
        },
        outputs,
    )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:6])
