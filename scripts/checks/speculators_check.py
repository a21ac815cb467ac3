"""Our DFlash export through vllm-project/speculators, in the serve-check virtualenv.

Run by ``scripts/checks/serve_check.py`` with the vLLM virtualenv's Python (speculators 0.9 wants
Transformers <= 5.19, which that virtualenv has; the project's does not):

    python scripts/checks/speculators_check.py EXPORT TARGET OUT INPUTS OUTPUTS [OURS]

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

``OURS``: the same drafter exported with ``--format speculators``; speculators'
``from_pretrained`` loads it, and its weights and config are compared with the converted
checkpoint's (``OUTPUTS["ours"]``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
        # speculators' DFlash2 default; false only for causal sliding layers
        "sliding_window_non_causal": not (
            "sliding_attention" in (source.get("layer_types") or [])
            and source.get("is_causal", True) is not False
        ),
    })  # fmt: skip
    config.speculators_config.algorithm = "dflash2"
    model = DFlash2DraftModel(config=config)
    missing, unexpected = model.load_state_dict(load_checkpoint_weights(Path(export)), strict=False)
    if unexpected or set(missing) - _VERIFIER_FILLED_KEYS:
        raise ValueError(f"unexpected {unexpected}, missing {sorted(set(missing))}")
    model.load_verifier_weights()
    model.save_pretrained(out)
    DFlash2DraftModel.from_pretrained(out)  # the converter's validation


#: Keys a Transformers config writes by its own version (or speculators by its save).
_NOT_COMPARED = {
    "auto_map.", "transformers_version", "transformer_layer_config.transformers_version",
    "transformer_layer_config.torch_dtype", "transformer_layer_config.rope_theta",
    "transformer_layer_config.bos_token_id", "transformer_layer_config.eos_token_id",
    "transformer_layer_config.pad_token_id", "transformer_layer_config.initializer_range",
}  # fmt: skip


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def compare_ours(ours: str, converted: str, cls: Any) -> dict:
    """Our speculators-dialect export against the converted checkpoint: both loaded by
    speculators; weights equal, config keys equal (but version-written ones)."""
    mine = cls.from_pretrained(ours).state_dict()
    theirs = cls.from_pretrained(converted).state_dict()
    same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a = _flat(json.loads((Path(ours) / "config.json").read_text()))
    b = _flat(json.loads((Path(converted) / "config.json").read_text()))
    keys = (set(a) | set(b)) - _NOT_COMPARED
    differ = {k: [a.get(k), b.get(k)] for k in sorted(keys) if a.get(k) != b.get(k)}
    return {"weights_equal": same, "tensors": len(mine), "config_keys": len(keys),
            "config_differs": differ}  # fmt: skip


def main(export: str, target: str, out: str, inputs: str, outputs: str, ours: str = "") -> None:
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
            "ours": compare_ours(ours, out, type(model)) if ours else None,
            "aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids"),
            "speculators_model_type": config.get("speculators_model_type"),
        },
        outputs,
    )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:7])
