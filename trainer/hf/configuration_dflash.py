"""Configuration of a DFlash draft model (the z-lab ``DFlashDraftModel`` folder format).

A Qwen3 config (``model_type`` "qwen3": the shape fields are Qwen3's) plus the DFlash keys.
Which loader reads which key (checked against their sources):

* ``dflash_config.target_layer_ids``: target layers whose outputs (``hidden_states[i + 1]``)
  are concatenated as context. z-lab ``dflash/model.py`` (``_draft_value``: dflash_config,
  then top level), SGLang ``speculative/dflash_utils.parse_dflash_draft_config`` (same
  order), vLLM ``eagle3_utils.get_eagle3_aux_layers_from_config`` (adds 1; it reads
  ``eagle_aux_hidden_state_layer_ids`` first, and older vLLM reads only that key, so the
  export writes it too, already shifted). Transformers' ``DFlashTokenCandidateGenerator``
  reads ``config.target_layer_ids``: the property below.
* ``dflash_config.mask_token_id``: the token whose target embedding fills the MASK slots.
  z-lab and SGLang (dflash_config, then top level), vLLM ``qwen3_dflash`` (same);
  Transformers reads ``config.mask_token_id``: the property below.
* ``block_size`` (top level): z-lab and SGLang read ``dflash_config.block_size`` first, then
  the top level; Transformers reads ``config.block_size``. vLLM takes the number of drafted
  tokens from ``--speculative-config num_speculative_tokens`` (block_size - 1).
* ``num_target_layers``: the TARGET's depth (not the number of captured layers); SGLang
  checks the layer ids against it.
* ``vocab_size`` must be the target's: vLLM builds a draft-to-target token map otherwise.
* ``layer_types``: "full_attention" layers SGLang and vLLM attend bidirectionally
  (non-causal) inside the block, "sliding_attention" ones causally within
  ``sliding_window`` positions (``use_sliding_window`` true, or Transformers' Qwen3Config
  drops the window), as the drafter was trained; vLLM's V1 runner serves all-sliding or
  all-full drafters only.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

# dflash_config keys this drafter's math knows (anything else, e.g. DFlash2's selector or
# convolutions, changes the math and is refused by the trainer's --init-drafter).
DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers")


class DFlashConfig(Qwen3Config):
    """``Qwen3Config`` + ``block_size``, ``num_target_layers`` and ``dflash_config``.

    ``target_layer_ids`` and ``mask_token_id`` are views of ``dflash_config`` (one source of
    truth, the one the serving engines read); a top-level value of either, as some
    configs carry, is folded into ``dflash_config`` and must agree with it.
    """

    model_type = "qwen3"

    def __init__(
        self,
        block_size: int = 16,
        num_target_layers: int | None = None,
        dflash_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        top_level = {k: kwargs.pop(k) for k in ("target_layer_ids", "mask_token_id") if k in kwargs}
        super().__init__(**kwargs)
        merged = dict(dflash_config or {})
        for key, value in top_level.items():
            if value is not None and merged.setdefault(key, value) != value:
                raise ValueError(
                    f"{key} is {value!r} at the top level but {merged[key]!r} in dflash_config"
                )
        nested = merged.get("block_size")
        if nested is not None and int(nested) != int(block_size):
            raise ValueError(f"block_size {block_size} != dflash_config.block_size {nested}")
        self.dflash_config = merged
        self.block_size = int(block_size)
        self.num_target_layers = num_target_layers

    @property
    def target_layer_ids(self) -> list[int] | None:
        ids = self.dflash_config.get("target_layer_ids")
        return None if ids is None else [int(i) for i in ids]

    @property
    def mask_token_id(self) -> int | None:
        value = self.dflash_config.get("mask_token_id")
        return None if value is None else int(value)


__all__ = ["DFlashConfig"]
