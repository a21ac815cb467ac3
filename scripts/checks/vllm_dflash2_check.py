"""Our DFlash2 export in vLLM's own model class, on CPU, in the serve-check virtualenv.

vLLM's CPU build cannot serve a DFlash2 drafter (its V1 model runner refuses "DFlash
candidate-head drafts", and the V2 runner that serves them needs Triton). Its model class
still builds and loads weights on CPU, and its CPU paths of the DFlash2 pieces run:

    python scripts/checks/vllm_dflash2_check.py TARGET EXPORT INPUTS OUTPUTS

1. builds vLLM's engine config for TARGET with EXPORT as its DFlash speculator (with the
   V1 runner's refusal of candidate-head drafts skipped: no runner starts here), then
   ``DFlash2Qwen3ForCausalLM`` from it, and loads EXPORT's tensors through its
   ``load_weights``;
2. runs, on the tensors of ``INPUTS`` (a ``torch.save`` dict written by serve-check): every
   layer's ``attention_conv`` / ``mlp_conv`` ``prepare`` and ``finish``, the candidate
   selector's edge scores, and ``compute_candidates`` (the unary top-K through vLLM's
   candidate logits processor, with the target's LM head);
3. writes its results, the parameters its loader filled and all of its parameters to ``OUTPUTS``
   for serve-check to compare with the trainer's drafter.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(target: str, export: str, inputs: str, outputs: str) -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    # The V1 runner (the CPU build's only one) refuses DFlash candidate heads; building
    # the model class needs no runner, so that refusal alone is skipped.
    VllmConfig._validate_v1_model_runner = lambda self: None
    x = torch.load(inputs)
    spec = {"method": "dflash", "model": export, "num_speculative_tokens": int(x["block"]) - 1}
    args = EngineArgs(
        model=target, dtype="float32", max_model_len=1024, enforce_eager=True,
        speculative_config=spec, kv_cache_memory_bytes=256 << 20,
    )  # fmt: skip
    config = args.create_engine_config()
    assert config.speculative_config is not None
    with set_current_vllm_config(config):
        model, tensors, loaded = _load(config, export, x["lm_head"])
        with torch.no_grad():
            results = _pieces(model, x)
    torch.save(
        {
            **results,
            "loaded": sorted(loaded), "exported": sorted(tensors),
            "params": sorted(n for n, _ in model.named_parameters()),
            "architectures": config.speculative_config.draft_model_config.architectures,
            "top_k": model.model.candidate_selector.top_k,
            # vLLM embeds mask_token_id unless a mask_embedding.pt ships: then unused
            "unused": [] if model.model.has_separate_mask_embedding else ["model.mask_embedding"],
        },
        outputs,
    )  # fmt: skip


def _load(config: Any, export: str, lm_head: Any) -> tuple[Any, dict[str, Any], set[str]]:
    """``DFlash2Qwen3ForCausalLM`` built from ``config`` (in vLLM's current config) with
    EXPORT's tensors loaded through its ``load_weights`` and the target's LM head: the
    model, the exported tensors, and the parameters vLLM's loader filled."""
    import torch
    from safetensors.torch import load_file
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM
    from vllm.model_executor.models.utils import AutoWeightsLoader

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{_port()}",
    )  # fmt: skip
    initialize_model_parallel(1, 1)
    model = DFlash2Qwen3ForCausalLM(vllm_config=config).float().eval()
    tensors = load_file(os.path.join(export, "model.safetensors"))
    loaded: set[str] = set()  # the parameters vLLM's loader filled (it returns them)
    fill = AutoWeightsLoader.load_weights

    def recording(self, *args, **kwargs):
        out = fill(self, *args, **kwargs)
        loaded.update(out or ())
        return out

    AutoWeightsLoader.load_weights = recording
    model.load_weights(tensors.items())
    with torch.no_grad():
        model.lm_head.weight.copy_(lm_head)  # the target's (vLLM shares it)
    # As vLLM's loader does next (on CPU: packs the linear layers for oneDNN).
    draft_config = config.speculative_config.draft_model_config
    process_weights_after_loading(model, draft_config, torch.device("cpu"))
    return model, tensors, loaded


def _pieces(model: Any, x: dict[str, Any]) -> dict[str, Any]:
    """vLLM's DFlash2 pieces on the inputs ``x``: each layer's convolutions, the unary
    top-K candidates and the candidate selector's edges."""
    convs = []
    for i, layer in enumerate(model.model.layers):
        for side in ("attention_conv", "mlp_conv"):
            conv = getattr(layer, side)
            y, coefficients = conv.prepare(x["conv_in"][i])
            convs.append((y, conv.finish(x["conv_out"][i], coefficients)))
    cands, unary = model.compute_candidates(x["hidden"])
    edges = model.model.candidate_selector(
        x["candidates"][None], x["unary"][None], x["hidden"][None], x["anchor"]
    )[0]
    return {"convs": convs, "candidates": cands, "unary": unary, "edges": edges}


if __name__ == "__main__":
    main(*sys.argv[1:5])
