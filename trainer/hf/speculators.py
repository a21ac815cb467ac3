"""The vllm-project/speculators dialect of an export (``dflash-train export --format
speculators``): the same weights under the same names, and a ``config.json`` laid out as
speculators 0.9 saves a DFlash or DFlash2 checkpoint (its ``DFlashSpeculatorConfig`` /
``DFlash2SpeculatorConfig``), which speculators' ``from_pretrained`` and vLLM's speculators
config reader load; and back (``--init-drafter``): ``dflash_from_speculators`` inverts the
same mapping (``COPIED``, ``NON_TRANSFORMER``, ``VLLM_SHIFT``, ``causal_sliding``) into the
DFlash dialect, which ``trainer.hf.folder`` checks as it checks any DFlash folder.

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

import logging
from pathlib import Path
from typing import Any

from trainer.hf import ARCHITECTURES

log = logging.getLogger(__name__)

#: The speculators release whose layout this is (``speculators_version`` in its configs).
SPECULATORS_VERSION = "0.9.0"
#: The key that marks a speculators ``config.json`` (the DFlash dialect has none).
SPECULATORS_KEY = "speculators_model_type"
#: Keys of the DFlash dialect's ``config.json`` that are not the transformer's.
NON_TRANSFORMER = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")
#: DFlash2 fields speculators' DFlash2 config has (the others would be dropped silently).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: speculators' fields that are a DFlash-dialect value as it is, and where the DFlash dialect
#: keeps it (a top-level key, or ``dflash_config.KEY``): the writer takes each from there,
#: the reader puts it back there. DFlash2's only for DFlash2 drafters.
COPIED = {
    "block_size": "block_size",
    "draft_vocab_size": "vocab_size",
    "mask_token_id": "dflash_config.mask_token_id",
    "dtype": "dtype",
}
DFLASH2_COPIED = {k: f"dflash_config.{k}" for k in DFLASH2_FIELDS}
#: The copied fields a speculators folder must have for this drafter (the others, where
#: present, must agree with ``transformer_layer_config``).
REQUIRED = ("block_size", "mask_token_id", *DFLASH2_FIELDS)
#: vLLM numbers a target layer's output by the next layer's input: speculators'
#: ``aux_hidden_state_layer_ids`` are the DFlash dialect's ``target_layer_ids`` + this.
VLLM_SHIFT = 1
_NEUTRAL = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _copied(dflash2: bool) -> dict[str, str]:
    return {**COPIED, **(DFLASH2_COPIED if dflash2 else {})}


def _get(config: dict[str, Any], where: str) -> Any:
    """The DFlash-dialect value at ``where`` (``key`` or ``dflash_config.key``)."""
    head, _, key = where.rpartition(".")
    return (config.get(head) or {}).get(key) if head else config.get(key)


def causal_sliding(dflash: dict[str, Any]) -> bool:
    """Whether a DFlash-dialect config has causal sliding layers (unless ``is_causal`` is
    false, the engines' default for a sliding layer)."""
    kinds = dflash.get("layer_types") or []
    return _SLIDING in kinds and dflash.get("is_causal", True) is not False


def speculators_config(
    dflash: dict[str, Any], *, verifier: str, verifier_architectures: list[str], where: str
) -> dict[str, Any]:
    """The speculators ``config.json`` of an export whose DFlash-dialect config is
    ``dflash`` (``trainer.hf.export.folder_config``); ``where`` names it in errors."""
    inner = dflash["dflash_config"]
    dflash2 = dflash["architectures"] == [ARCHITECTURES["dflash2"]]
    _check_expressible(dflash, where)
    depth = int(dflash["num_target_layers"])
    transformer = {k: v for k, v in dflash.items() if k not in NON_TRANSFORMER}
    block = int(dflash["block_size"])
    ids = [i + VLLM_SHIFT for i in inner["target_layer_ids"] if i + VLLM_SHIFT != depth]
    return {
        "architectures": list(dflash["architectures"]),
        SPECULATORS_KEY: "dflash2" if dflash2 else "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": ids,
        **{k: _get(dflash, at) for k, at in _copied(dflash2).items()},
        "sample_from_anchor": False,
        # vLLM makes every layer causal unless this is true (dflash_config.causal): true for
        # full layers (bidirectional in the block) and bidirectional sliding ones.
        "sliding_window_non_causal": not causal_sliding(dflash),
        "target_hidden_size": None,
        "tie_word_embeddings": False,
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


def _check_expressible(dflash: dict[str, Any], where: str) -> None:
    """Refuse what the speculators layout cannot say (it would serve another model)."""
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
    if causal_sliding(dflash) and _FULL in (dflash.get("layer_types") or []):
        raise ValueError(
            f"{where}: causal sliding layers next to full ones: vLLM reads the speculators "
            "layout's one sliding_window_non_causal flag for every layer, so the full "
            "layers would be served causal; export the DFlash dialect (--format dflash)"
        )


# ---- reading (``--init-drafter``): the same mapping, inverted ----------------------------


def dflash_from_speculators(spec: dict[str, Any], file: Path) -> dict[str, Any]:
    """The DFlash-dialect ``config.json`` that a speculators one says, by
    ``speculators_config``'s mapping inverted: ``transformer_layer_config`` at the top level
    (Transformers' defaults where it is silent, as speculators loads it), each ``COPIED``
    field put back where the DFlash dialect keeps it, the layer ids in the trainer's
    numbering, ``sliding_window_non_causal`` as ``is_causal``. ``trainer.hf.folder`` then
    checks the result as it checks any DFlash folder; ``file`` names it in errors."""
    kind = spec.get(SPECULATORS_KEY)
    if kind not in ARCHITECTURES:
        raise ValueError(f"{file}: {SPECULATORS_KEY} {kind!r} is none of {sorted(ARCHITECTURES)}")
    arch = spec.get("architectures") or []
    if set(arch) & set(ARCHITECTURES.values()) - {ARCHITECTURES[kind]}:
        raise ValueError(f"{file}: architectures {arch} disagree with {SPECULATORS_KEY} {kind!r}")
    out = {**_transformer(spec, file), "architectures": [ARCHITECTURES[kind]]}
    out["dflash_config"] = {}
    for key, at in _copied(kind == "dflash2").items():
        _put_back(out, at, key, spec.get(key), file)
    ids = spec.get("aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError(f"{file}: no aux_hidden_state_layer_ids")
    if min(int(i) for i in ids) < VLLM_SHIFT:
        raise ValueError(
            f"{file}: aux_hidden_state_layer_ids {ids}: {min(ids)} is no target layer's output "
            f"(vLLM's numbering: layer i's output is i + {VLLM_SHIFT})"
        )
    out["dflash_config"]["target_layer_ids"] = [int(i) - VLLM_SHIFT for i in ids]
    if spec.get("sample_from_anchor") not in (None, False):
        raise ValueError(
            f"{file}: sample_from_anchor {spec['sample_from_anchor']!r} is not supported by "
            "this drafter"
        )
    _put_back_causality(out, spec.get("sliding_window_non_causal"), file)
    return out


def _transformer(spec: dict[str, Any], file: Path) -> dict[str, Any]:
    """``transformer_layer_config``, with its config class's values where it is silent
    (speculators saves only what differs from them); as it is where Transformers refuses
    it (the folder checks then say which field is wrong)."""
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{file}: no transformer_layer_config")
    clash = sorted(set(layer) & set(NON_TRANSFORMER))
    if clash:
        raise ValueError(
            f"{file}: transformer_layer_config.{clash[0]}: the layout keeps it at the top level"
        )
    from transformers import AutoConfig

    fields = {k: v for k, v in layer.items() if k != "model_type"}
    try:
        full = AutoConfig.for_model(layer.get("model_type", "qwen3"), **fields).to_dict()
    except Exception:  # one Transformers refuses: the folder checks name the field
        full = {}
    silent = {k: v for k, v in full.items() if k not in layer and k not in NON_TRANSFORMER}
    return {**silent, **layer}


def _put_back(out: dict[str, Any], at: str, key: str, value: Any, file: Path) -> None:
    """speculators' ``key`` where the DFlash dialect keeps it (``at``); one the transformer
    config already says must agree with it."""
    if value is None:
        if key in REQUIRED:
            raise ValueError(f"{file}: no {key}")
        return
    head, _, name = at.rpartition(".")
    into = out[head] if head else out
    if name in into and into[name] is not None and into[name] != value:
        raise ValueError(
            f"{file}: {key} {value!r} != transformer_layer_config.{name} {into[name]!r}"
        )
    into[name] = value


def _put_back_causality(out: dict[str, Any], non_causal: Any, file: Path) -> None:
    """``sliding_window_non_causal`` (false where absent: speculators' default) as the
    DFlash dialect says it: ``is_causal`` false for bidirectional sliding layers; what the
    writer's rule (``causal_sliding``) would not have written is refused."""
    flag = bool(non_causal)
    kinds = out.get("layer_types") or []
    if _SLIDING not in kinds:
        if not flag:
            log.warning(
                "%s: sliding_window_non_causal false: vLLM serves every layer of this folder "
                "causal; its full layers are read (and trained) bidirectional inside the "
                "block, as speculators trains them (export writes true)",
                file,
            )
        return
    if "is_causal" not in out and flag:
        out["is_causal"] = False
    if causal_sliding(out) == flag:
        raise ValueError(
            f"{file}: sliding_window_non_causal {flag} disagrees with "
            f"transformer_layer_config.is_causal {out.get('is_causal')!r}"
        )
    if causal_sliding(out) and _FULL in kinds:
        raise ValueError(
            f"{file}: sliding_window_non_causal false next to full_attention layers: vLLM "
            "serves every layer causal, this drafter's full layers are bidirectional inside "
            "the block"
        )
