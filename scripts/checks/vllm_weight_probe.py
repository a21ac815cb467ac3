"""serve-check's probe in vLLM's processes: what vLLM's DFlash drafter loaded.

Not imported by the project: ``scripts/checks/serve_weights.py`` copies this file as
``sitecustomize.py`` into a folder on vLLM's ``PYTHONPATH``, and vLLM imports it at start-up
in every process (API server, engine core, worker). It wraps
``AutoWeightsLoader.load_weights`` (the vLLM parameter names each model's loader filled),
``DFlashQwen3ForCausalLM.load_weights`` (the checkpoint tensors vLLM read and, right after,
where their values lie among the drafter's parameters: before
``process_weights_after_loading``, which on CPU packs every linear weight for oneDNN and
leaves an empty tensor behind) and the speculator's ``load_model`` (which parameters are the
target's by then: the shared embedding and LM head); it writes the report to
``$DFLASH_SERVE_CHECK_REPORT``.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any

_REPORT = os.environ.get("DFLASH_SERVE_CHECK_REPORT")
_SEEN: dict[str, Any] = {"checkpoint": [], "loaded": {}}


def _patch_utils(mod):
    orig = mod.AutoWeightsLoader.load_weights

    def load_weights(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        names = _SEEN["loaded"].setdefault(type(self.module).__name__, set())
        names.update(out or ())
        return out

    mod.AutoWeightsLoader.load_weights = load_weights


def _patch_dflash(mod):
    orig = mod.DFlashQwen3ForCausalLM.load_weights

    def load_weights(self, weights):
        tensors = {}

        def named():
            for name, tensor in weights:
                tensors[name] = tensor.detach().clone()
                yield name, tensor

        out = orig(self, named())
        # Before process_weights_after_loading: on CPU it packs every linear weight for
        # oneDNN and leaves an empty tensor in its place.
        _SEEN["checkpoint"] = list(tensors)
        _SEEN["values"] = _compare(self, tensors)
        return out

    mod.DFlashQwen3ForCausalLM.load_weights = load_weights


def _matches(param, tensor):
    """Row offsets where ``tensor`` lies in ``param`` (stacked along dim 0), exactly."""
    import torch

    p, t = param.detach().float(), tensor.float()
    if p.dim() != t.dim() or p.dim() == 0 or p.shape[1:] != t.shape[1:] or len(p) < len(t):
        return []
    n = len(t)
    first = (p == t[0]) if p.dim() == 1 else (p == t[0]).all(dim=1)
    offsets = [int(o) for o in first.nonzero().flatten() if o + n <= len(p)]
    return [o for o in offsets if torch.equal(p[o : o + n], t)]


def _compare(drafter, tensors):
    """Where each checkpoint tensor's values lie among the drafter's parameters."""
    params = dict(drafter.named_parameters())
    covered: dict[str, set] = {n: set() for n in params}
    found = {}
    for tname, tensor in tensors.items():
        hits = []
        for pname, param in params.items():
            for o in _matches(param, tensor):
                hits.append([pname, o])
                covered[pname].update(range(o, o + len(tensor)))
        found[tname] = hits
    rows = {n: int(p.shape[0]) if p.dim() else 1 for n, p in params.items()}
    return {
        "tensors_found": found,
        "rows": rows,
        "rows_covered": {n: len(c) for n, c in covered.items()},
        "shapes": {n: list(p.shape) for n, p in params.items()},
    }


def _report(proposer, target_model):
    drafter = proposer.model
    target = {id(p): n for n, p in target_model.named_parameters()}
    loaded = _SEEN["loaded"].get(type(drafter).__name__, set())
    values = _SEEN.get("values")
    if values is None:
        return {"error": "DFlashQwen3ForCausalLM.load_weights was not called"}
    separate_mask = getattr(getattr(drafter, "model", None), "has_separate_mask_embedding", True)
    out = {}
    for n, p in drafter.named_parameters():
        out[n] = {
            "shape": values["shapes"].get(n, list(p.shape)),
            "loaded": n in loaded,
            "shared_with_target": target.get(id(p)),
            "rows": values["rows"].get(n, 0),
            "rows_covered": values["rows_covered"].get(n, 0),
            "unused": n.endswith("mask_embedding") and not separate_mask,
        }
    return {
        "drafter_class": type(drafter).__name__,
        "proposer_class": type(proposer).__name__,
        "checkpoint_names": _SEEN["checkpoint"],
        "tensors_found": values["tensors_found"],
        "params": out,
    }


def _patch_proposer(mod):
    orig = mod.SpecDecodeBaseProposer.load_model

    def load_model(self, target_model):
        orig(self, target_model)
        try:
            report = _report(self, target_model)
        except Exception as e:  # the check reports it; serving goes on
            report = {"error": repr(e)}
        if _REPORT:
            with open(_REPORT + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(_REPORT + ".tmp", _REPORT)

    mod.SpecDecodeBaseProposer.load_model = load_model


_PATCHES = {
    "vllm.model_executor.models.utils": _patch_utils,
    "vllm.model_executor.models.qwen3_dflash": _patch_dflash,
    "vllm.v1.spec_decode.llm_base_proposer": _patch_proposer,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _REPORT:
    sys.meta_path.insert(0, _Finder())
