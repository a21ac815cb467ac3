"""The speculators dialect of an export (``trainer.hf.speculators``), from a DFlash-dialect
``config.json``: the layer ids in vLLM's numbering, the causality flag vLLM applies to every
layer, DFlash2's fields, and the refusals of what the layout cannot say."""

from __future__ import annotations

import pytest

from trainer.hf.speculators import speculators_config


def dflash(**over) -> dict:
    base = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "x"},
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "layer_types": ["full_attention", "full_attention"], "vocab_size": 512,
        "block_size": 8, "num_target_layers": 4, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": 511, "target_layer_ids": [0, 1, 2]},
    }  # fmt: skip
    dflash_config = {**base["dflash_config"], **over.pop("dflash_config", {})}
    return {**base, **over, "dflash_config": dflash_config}


def spec(cfg: dict) -> dict:
    return speculators_config(cfg, verifier="/t", verifier_architectures=["Q"], where="ckpt")


def test_a_dflash_config_in_speculators_layout():
    out = spec(dflash())
    assert out["speculators_model_type"] == "dflash" and out["architectures"] == [
        "DFlashDraftModel"
    ]
    assert out["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (out["block_size"], out["mask_token_id"], out["draft_vocab_size"]) == (8, 511, 512)
    proposal = out["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 7 and proposal["proposal_type"] == "greedy"
    assert out["speculators_config"]["verifier"] == {"name_or_path": "/t", "architectures": ["Q"]}
    layer = out["transformer_layer_config"]
    assert layer["hidden_size"] == 64 and not {"auto_map", "dflash_config", "block_size"} & set(
        layer
    )
    assert "conv_kernel_size" not in out


@pytest.mark.parametrize(
    "kinds, is_causal, non_causal",
    [
        (["full_attention"] * 2, None, True),  # full layers are bidirectional in the block
        (["sliding_attention"] * 2, None, False),  # the engines' causal sliding layers
        (["sliding_attention"] * 2, False, True),
        (["sliding_attention", "full_attention"], False, True),
    ],
)
def test_the_one_causality_flag_vllm_applies_to_every_layer(kinds, is_causal, non_causal):
    extra = {} if is_causal is None else {"is_causal": is_causal}
    assert spec(dflash(layer_types=kinds, **extra))["sliding_window_non_causal"] is non_causal


def test_dflash2_fields_and_refusals():
    fields = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
              "selector_top_k": 4, "output_multiplier": 1.0, "final_logit_softcapping": None,
              "input_embedding_scale": 1.0}  # fmt: skip
    out = spec(dflash(architectures=["DFlash2DraftModel"], dflash_config=fields))
    assert out["speculators_model_type"] == "dflash2"
    assert out["speculators_config"]["algorithm"] == "dflash2"
    assert (out["conv_group_size"], out["selector_rank"], out["selector_top_k"]) == (16, 8, 4)
    capped = dflash(architectures=["DFlash2DraftModel"],
                    dflash_config={**fields, "final_logit_softcapping": 30.0})  # fmt: skip
    with pytest.raises(ValueError, match=r"ckpt: final_logit_softcapping 30\.0"):
        spec(capped)


def test_what_the_layout_cannot_say_is_refused():
    with pytest.raises(ValueError, match=r"target layer 3 \(the last\)"):
        spec(dflash(dflash_config={"target_layer_ids": [1, 2, 3]}))
    with pytest.raises(ValueError, match="causal sliding layers next to full ones"):
        spec(dflash(layer_types=["sliding_attention", "full_attention"]))


def test_a_folder_without_config_is_named_not_a_flag(tmp_path):
    # read by train's --init-drafter and by eval's DRAFTERS alike: the path says which
    from trainer.hf.folder import read_drafter_folder

    with pytest.raises(FileNotFoundError) as e:
        read_drafter_folder(tmp_path)
    assert str(e.value) == f"{tmp_path}: no config.json, so not a drafter folder (export makes one)"
