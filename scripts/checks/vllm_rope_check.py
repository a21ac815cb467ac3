"""Our export's RoPE and context length as vLLM reads them, in the serve-check virtualenv.

    python scripts/checks/vllm_rope_check.py TARGET EXPORT OUTPUTS

1. vLLM's engine config for TARGET with EXPORT as its DFlash speculator (a DFlash-dialect
   folder), or for EXPORT alone when it is a speculators-dialect folder (vLLM's speculators
   config reader then takes the verifier from it, which must be TARGET);
2. from the draft model's config as vLLM patched it: ``rope_parameters``,
   ``max_position_embeddings`` and the draft's ``max_model_len``; and the rotary embedding
   vLLM's DFlash layers build from it (``get_rope`` with the arguments
   ``qwen3_dflash.DFlashQwen3DecoderLayer`` passes): its cos/sin cache, every position;
3. writes them to OUTPUTS (a ``torch.save`` dict) for ``long_context_check.py`` to compare
   with the trainer's drafter.

No model runs and no weights are read: this is vLLM's config machinery only.
"""

from __future__ import annotations

import json
import os
import sys


def main(target: str, export: str, outputs: str) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    common = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=256 << 20)  # fmt: skip
    if "speculators_model_type" in config:  # vLLM reads the verifier from the folder
        args = EngineArgs(model=export, **common)
    else:
        spec = {"method": "dflash", "model": export, "num_speculative_tokens": 3}
        args = EngineArgs(model=target, speculative_config=spec, **common)
    engine = args.create_engine_config()
    assert engine.speculative_config is not None
    draft = engine.speculative_config.draft_model_config
    hf = draft.hf_config
    torch.set_default_dtype(torch.float32)
    with set_current_vllm_config(engine):  # a CustomOp reads it when built
        rope = get_rope(
            hf.head_dim, max_position=hf.max_position_embeddings, is_neox_style=True,
            rope_parameters=hf.rope_parameters,
        )  # fmt: skip
    torch.save(
        {
            "verifier": engine.model_config.model,
            "rope_parameters": dict(hf.rope_parameters),
            "max_position_embeddings": int(hf.max_position_embeddings),
            "draft_max_model_len": int(draft.max_model_len),
            "target_max_model_len": int(engine.model_config.max_model_len),
            "rotary": type(rope).__name__,
            "cos_sin_cache": rope.cos_sin_cache.float(),
        },
        outputs,
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
