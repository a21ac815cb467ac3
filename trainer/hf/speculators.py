"""The vllm-project/speculators dialect of an export (``dflash-train export --format
speculators``): the same weights under the same names, and a ``config.json`` laid out as
speculators 0.9 saves a DFlash or DFlash2 checkpoint (its ``DFlashSpeculatorConfig`` /
``DFlash2SpeculatorConfig``), which speculators' ``from_pretrained`` and vLLM's speculators
config reader load.

* ``speculators_model_type`` ``dflash`` / ``dflash2`` and ``architectures`` (the model
  class: ``DFlashDraftModel`` / ``DFlash2DraftModel``);
* ``transformer_layer_config``: the drafter's Qwen3 shape (what the DFlash dialect keeps at
  the top level, less ``architectures``, ``auto_map``, ``block_size``, ``dflash_config``
  and ``num_target_layers``, as speculators' converter takes it);
* ``aux_hidden_state_layer_ids``: the target layers in vLLM's numbering (id + 1), without
  the one past the target's last layer (speculators' converter drops it);
* ``block_size``, ``mask_token_id``, ``draft_vocab_size``, ``sample_from_anchor``,
  ``sliding_window_non_causal`` (true unless the sliding layers are causal: vLLM applies
  its negation, ``dflash_config.causal``, to every layer, full ones included); DFlash2's
  ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``;
* ``speculators_config``: greedy proposals of ``block_size - 1`` tokens against the
  verifier ``name_or_path`` (the run's ``--target``).

speculators saves no embedding or LM head (it borrows the verifier's, as engines do), so
the folder holds the drafter's tensors only. Refused, because the layout cannot say them:
DFlash2's ``output_multiplier``, ``final_logit_softcapping`` and ``input_embedding_scale``
(no field); the target's last layer among the drafter's (no id for it in vLLM's
numbering); causal sliding layers next to full ones (one causality flag for all layers).
"""

from __future__ import annotations

from typing import Any

from trainer.hf.folder import ARCHITECTURES

#: The speculators release whose layout this is (``speculators_version`` in its configs).
SPECULATORS_VERSION = "0.9.0"
#: Keys of the DFlash dialect's ``config.json`` that are not the transformer's.
NON_TRANSFORMER = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")
#: DFlash2 fields speculators' DFlash2 config has (the others would be dropped silently).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_NEUTRAL = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def speculators_config(
    dflash: dict[str, Any], *, verifier: str, verifier_architectures: list[str], where: str
) -> dict[str, Any]:
    """The speculators ``config.json`` of an export whose DFlash-dialect config is
    ``dflash`` (``trainer.hf.export.folder_config``); ``where`` names it in errors."""
    inner = dflash["dflash_config"]
    dflash2 = dflash["architectures"] == [ARCHITECTURES["dflash2"]]
    causal_sliding = _check_expressible(dflash, where)
    depth = int(dflash["num_target_layers"])
    transformer = {k: v for k, v in dflash.items() if k not in NON_TRANSFORMER}
    block = int(dflash["block_size"])
    return {
        "architectures": list(dflash["architectures"]),
        "speculators_model_type": "dflash2" if dflash2 else "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": [i + 1 for i in inner["target_layer_ids"] if i + 1 != depth],
        "block_size": block,
        "draft_vocab_size": int(dflash["vocab_size"]),
        "mask_token_id": inner["mask_token_id"],
        "sample_from_anchor": False,
        # vLLM makes every layer causal unless this is true (dflash_config.causal): true for
        # full layers (bidirectional in the block) and bidirectional sliding ones.
        "sliding_window_non_causal": not causal_sliding,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": dflash["dtype"],
        **({k: inner[k] for k in DFLASH2_FIELDS} if dflash2 else {}),
        "speculators_config": {
            "algorithm": "dflash2" if dflash2 else "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": transformer,
    }


def _check_expressible(dflash: dict[str, Any], where: str) -> bool:
    """Refuse what the speculators layout cannot say (it would serve another model);
    whether the sliding layers are causal."""
    inner = dflash["dflash_config"]
    for key, neutral in _NEUTRAL.items():
        if inner.get(key, neutral) != neutral:
            raise ValueError(
                f"{where}: {key} {inner[key]!r}: speculators' DFlash2 config has no such "
                "field, so a speculators folder would serve another model; export the "
                "DFlash dialect (--format dflash)"
            )
    depth = int(dflash["num_target_layers"])
    if depth - 1 in inner["target_layer_ids"]:
        raise ValueError(
            f"{where}: target layer {depth - 1} (the last) is one of the drafter's layers: "
            "speculators' layout names layers by vLLM's numbering (+1) and has no id for it, "
            "so its fc would lose those inputs; export the DFlash dialect (--format dflash)"
        )
    kinds = dflash.get("layer_types") or []
    causal_sliding = "sliding_attention" in kinds and dflash.get("is_causal", True) is not False
    if causal_sliding and "full_attention" in kinds:
        raise ValueError(
            f"{where}: causal sliding layers next to full ones: vLLM reads the speculators "
            "layout's one sliding_window_non_causal flag for every layer, so the full "
            "layers would be served causal; export the DFlash dialect (--format dflash)"
        )
    return causal_sliding
