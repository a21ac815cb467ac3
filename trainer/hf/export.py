"""Hugging Face drafter folders: ``dflash-train export`` writes one, ``--init-drafter`` reads one.

The folder is the z-lab ``DFlashDraftModel`` format that SGLang, vLLM and Transformers load
(``trainer/hf/configuration_dflash.py`` lists which loader reads which key):

* ``config.json``: ``architectures ["DFlashDraftModel"]``, ``model_type "qwen3"``, the Qwen3
  shape fields of the drafter, ``vocab_size``/``max_position_embeddings`` of the target,
  ``num_hidden_layers`` (drafter layers), ``block_size``, ``num_target_layers`` (the
  target's depth), ``dflash_config {mask_token_id, target_layer_ids}``,
  ``eagle_aux_hidden_state_layer_ids`` (the same layers in vLLM's numbering, +1), dtype,
  and ``auto_map`` to the remote code;
* ``model.safetensors``: ``fc``, ``hidden_norm``, ``layers.*`` and ``norm`` weights under the
  drafter's own names (they are Qwen3's), no embedding and no LM head;
* ``configuration_dflash.py`` + ``modeling_dflash.py`` (``trust_remote_code``);
* ``README.md`` and ``dflash_export.json``: where it came from (run, step, target, layers;
  with ``--best SET``, why that step: ``best tau/SET = 2.41 at step 300``).

What the export needs from the target (its vocabulary, depth, RoPE and context length) is
recorded in the checkpoint's ``meta["target_config"]`` at save time (``target_record``);
checkpoints written before that are served by the run's ``config.json`` (``--target``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loader_server.wire.files import read_json
from trainer.files import atomic_output, check_output
from trainer.hf import remote_code_paths
from trainer.hf.folder import ARCHITECTURES, WEIGHTS, weight_names
from trainer.hf.speculators import speculators_config
from trainer.model.drafter import FULL_ATTENTION, DFlashDrafter, DrafterConfig
from trainer.model.target import target_from_options, target_record
from trainer.options import CONFIG_FILE, DFLASH2_DEFAULTS, TargetOptions
from trainer.train import checkpoint as ckpt
from trainer.train.evaluation import set_key
from trainer.train.metrics import metrics_path, read_metrics

log = logging.getLogger(__name__)

INFO = "dflash_export.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


# ---- the target, as recorded at save time ----------------------------------------------


def _target_from_run_config(run_dir: Path) -> dict[str, Any]:
    """The target record of a run whose checkpoints predate ``meta["target_config"]``."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing and the checkpoint records no target config: cannot tell the "
            "target's vocabulary, depth and RoPE"
        )
    opts = TargetOptions.from_record(read_json(path, "a run's config.json"), str(path))
    if opts.tiny:
        return target_record(target_from_options(opts, "meta").config)
    target = Path(opts.target)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: --target {str(target)!r} has no config.json here, and the checkpoint "
            "records no target config"
        )
    from transformers import AutoConfig

    return target_record(AutoConfig.from_pretrained(target, local_files_only=True))


# ---- reading a checkpoint --------------------------------------------------------------


@dataclass(frozen=True)
class TrainedDrafter:
    """A checkpoint's drafter: weights, shape and what it was trained against."""

    checkpoint: Path
    step: int
    config: DrafterConfig
    weights: dict[str, torch.Tensor]
    target_name: str
    target: dict[str, Any]
    layer_ids: list[int]
    loss_config: dict[str, Any]  # the objective that trained it (trainer.model.blocks)


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {ckpt.checkpoint_dir(run_dir)}")
    if step is None:
        return found[-1]
    path = ckpt.checkpoint_dir(run_dir) / f"step-{step:08d}"
    if path not in found:
        steps = ", ".join(p.name for p in found)
        raise FileNotFoundError(f"no checkpoint {path.name} in {path.parent} (have: {steps})")
    return path


def read_trained_drafter(run_dir: Path, step: int | None = None) -> TrainedDrafter:
    """The drafter of ``run_dir``'s newest complete checkpoint (or of ``step``). Each is
    verified first (``trainer.train.checkpoint.verify_checkpoint``); without ``step`` a
    torn one is skipped with a warning for the next older one. Non-finite weights are
    refused, naming the checkpoint."""
    if step is not None:
        return _read_drafter(run_dir, find_checkpoint(run_dir, step))
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {ckpt.checkpoint_dir(run_dir)}")
    skipped: list[str] = []
    for path in reversed(found):
        try:
            src = _read_drafter(run_dir, path)
        except ckpt.TornCheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            skipped.append(f"{path.name}: {e}")
            continue
        if skipped:
            log.warning("exporting %s, the newest complete checkpoint", path)
        return src
    raise ckpt.TornCheckpointError(
        f"no complete checkpoint in {ckpt.checkpoint_dir(run_dir)} ({'; '.join(skipped)})"
    )


def _read_drafter(run_dir: Path, path: Path) -> TrainedDrafter:
    ckpt.verify_checkpoint(path, only=["model.pt"])
    file = path / "model.pt"
    # mmap: the optimizer state next to the weights is never read.
    shared = ckpt.load_file(file, mmap=True)
    record = ckpt.CheckpointRecord.from_shared(shared, file)
    others = [p.name for p in ckpt.list_checkpoints(run_dir) if p != path]
    hint = f"; export an earlier one with --step N (have: {', '.join(others)})" if others else ""
    ckpt.check_finite(record.drafter, str(path), f": it cannot be exported{hint}")
    meta = record.meta
    trained = meta.get("trained") or {}
    if trained.get("blocks") == 0:
        raise ValueError(
            f"{path}: the run trained no block in its {trained.get('steps')} step(s) (the "
            "drafter is its initialisation): nothing to export; the run's error says which "
            "spec fields to change"
        )
    if "layer_ids" not in meta:
        raise ValueError(f"{file}: the checkpoint records no target layer ids (meta.layer_ids)")
    target = meta.get("target_config") or _target_from_run_config(run_dir)
    return TrainedDrafter(
        checkpoint=path,
        step=record.step,
        config=DrafterConfig(**record.drafter_config),
        weights=record.drafter,
        target_name=str(meta.get("target", "?")),
        target=target,
        layer_ids=[int(i) for i in meta["layer_ids"]],
        loss_config=dict(record.loss_config),
    )


# ---- choosing a checkpoint by tau (--best) -----------------------------------------------


@dataclass(frozen=True)
class BestStep:
    """The checkpoint ``export --best`` chose: its step and the measurement that won."""

    step: int
    key: str  # the record key compared, tau/NAME
    value: float

    def reason(self) -> str:
        return f"best {self.key} = {self.value:.4g} at step {self.step}"


def _step_list(steps: list[int], most: int = 8) -> str:
    """``0, 100, 200`` (a long list: its first and last few and the count)."""
    if len(steps) <= most:
        return ", ".join(map(str, steps)) or "none"
    head, tail = steps[: most // 2], steps[-(most // 2) :]
    return f"{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))} ({len(steps)} steps)"


def best_step(records: list[dict[str, Any]], kept: list[int], name: str, source: str) -> BestStep:
    """Among the checkpoint steps ``kept``, the one whose record in ``records`` (a run's
    metrics) has the highest ``tau/NAME`` (ties: the later step). Raises ``ValueError``
    naming the set and what was measured when the set never was (``source`` names the
    metrics file), or when no kept checkpoint was measured (the steps of both)."""
    key = set_key("tau", name)
    measured = {
        int(r["step"]): float(r[key])
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    }
    if not measured:
        names = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("tau/")})
        have = (
            f"the sets measured: {', '.join(names)}"
            if names
            else "no evaluation set was measured (train with --eval-sets NAME=PATH)"
        )
        raise ValueError(f"--best {name}: {source} holds no {key}; {have}")
    candidates = [s for s in kept if s in measured]
    if not candidates:
        raise ValueError(
            f"--best {name}: no kept checkpoint has a {key} measurement ({key} measured at "
            f"steps {_step_list(sorted(measured))}; checkpoints kept at steps "
            f"{_step_list(sorted(kept))}): checkpoint at evaluated steps (--ckpt-every a "
            "multiple of --eval-every)"
        )
    step = max(candidates, key=lambda s: (measured[s], s))
    return BestStep(step=step, key=key, value=measured[step])


def choose_best(run_dir: Path, name: str) -> BestStep:
    """``best_step`` over ``run_dir``'s metrics and the checkpoints still on disk."""
    kept = [int(p.name.removeprefix("step-")) for p in ckpt.list_checkpoints(run_dir)]
    if not kept:
        raise FileNotFoundError(f"no checkpoint in {ckpt.checkpoint_dir(run_dir)}")
    path = metrics_path(run_dir)
    return best_step(read_metrics(path), kept, name, str(path))


# ---- writing the folder ----------------------------------------------------------------


def check_servable(src: TrainedDrafter) -> None:
    """Refuse what no serving engine can express, naming the checkpoint."""
    cfg, where = src.config, src.checkpoint
    if cfg.mask_token_id is None:
        raise ValueError(
            f"{where}: the drafter has a learned MASK vector (--learned-mask); SGLang, vLLM "
            "and Transformers embed a mask token id instead, so it cannot be exported"
        )
    vocab = src.target["vocab_size"]
    if not 0 <= cfg.mask_token_id < vocab:
        raise ValueError(
            f"{where}: mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"({vocab} tokens)"
        )
    if len(src.layer_ids) != cfg.num_target_layers:
        raise ValueError(
            f"{where}: {len(src.layer_ids)} layer ids {src.layer_ids} but the drafter takes "
            f"{cfg.num_target_layers} layers of features"
        )
    theta = src.target.get("rope_theta")
    if theta is not None and float(theta) != cfg.rope_theta:
        raise ValueError(f"{where}: drafter rope_theta {cfg.rope_theta} != target's {theta}")
    _check_rope_scaling(src)
    _warn_serving(src)


def _check_rope_scaling(src: TrainedDrafter) -> None:
    """The drafter rotates as the target does (``trainer.model.rope``): the export writes
    the scaling it was trained with. A drafter trained with plain RoPE against a scaled
    target (checkpoints from before the drafter followed the target's scaling) is exported
    as trained, with a warning; any other difference is refused."""
    cfg, where = src.config, src.checkpoint
    if "rope_scaling" in src.target:
        theirs = src.target["rope_scaling"]
    elif src.target.get("rope_type", "default") != "default":  # a record of older code
        theirs = {"rope_type": src.target["rope_type"]}
    else:
        theirs = None
    if cfg.rope_scaling is None and theirs is not None:
        log.warning(
            "target uses RoPE %r; the drafter was trained (and is exported) with plain RoPE, "
            "theta %s: engines serve it so, unlike the target past its original context "
            "(retrain with this code, which follows the target's scaling)",
            theirs["rope_type"],
            cfg.rope_theta,
        )
    elif cfg.rope_scaling != theirs:
        raise ValueError(
            f"{where}: drafter rope_scaling {cfg.rope_scaling} != the target's {theirs}"
        )


def _warn_serving(src: TrainedDrafter) -> None:
    """What serves, but maybe not as the target computes it."""
    depth = src.target["num_hidden_layers"]
    if depth - 1 in src.layer_ids:
        log.warning(
            "layer id %d is the target's last layer: Transformers reports its output normed, "
            "SGLang and vLLM capture layer inputs (id + 1) and may not provide it",
            depth - 1,
        )


def folder_config(src: TrainedDrafter, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the export (see the module docstring for who reads what)."""
    import transformers

    cfg, tgt = src.config, src.target
    dflash2 = cfg.variant == "dflash2"
    # DFlash2's fields, in dflash_config where vLLM and SGLang read them.
    extra = {k: getattr(cfg, k) for k in DFLASH2_DEFAULTS} if dflash2 else {}
    # Transformers' DFlash loop runs DFlash v1 only: the remote code goes with v1 folders.
    auto_map = {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashDraftModel",
    }
    return {
        "architectures": [ARCHITECTURES[cfg.variant]],
        **({} if dflash2 else {"auto_map": auto_map}),
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg),
        "max_position_embeddings": tgt["max_position_embeddings"],
        "vocab_size": tgt["vocab_size"],
        "tie_word_embeddings": False,
        # Sliding layers (if any): Transformers keeps sliding_window only with
        # use_sliding_window; SGLang and vLLM read layer_types and sliding_window, and serve
        # sliding layers causal inside the block, full ones bidirectional, as trained.
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.num_layers,
        "layer_types": list(cfg.layer_types or [FULL_ATTENTION] * cfg.num_layers),
        # Bidirectional sliding layers: is_causal false (vLLM and SGLang read it first);
        # causal ones need nothing (each engine's default for a sliding layer).
        **({} if cfg.sliding_causal else {"is_causal": False}),
        "block_size": cfg.block_size,
        "num_target_layers": tgt["num_hidden_layers"],
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": src.layer_ids,
            **extra,
        },
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in src.layer_ids],
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
        "transformers_version": transformers.__version__,
    }


def rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """RoPE as the drafter was trained, the target's (``trainer.model.rope``):
    ``rope_parameters`` (Transformers 5, vLLM, speculators) and, when scaled, the same as
    ``rope_scaling`` (what Transformers 4.x and engines on it read)."""
    scaling = dict(cfg.rope_scaling or {"rope_type": "default"})
    out: dict[str, Any] = {
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta},
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _state_for_export(src: TrainedDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, checked against the drafter's parameter names."""
    with torch.device("meta"):
        expected = set(DFlashDrafter(src.config).state_dict())
    got = set(src.weights)
    if expected - got:
        raise ValueError(
            f"{src.checkpoint}: drafter weight {weight_names(expected - got)} is missing"
        )
    if got - expected:
        raise ValueError(
            f"{src.checkpoint}: unexpected drafter weight {weight_names(got - expected)}"
        )
    return {k: src.weights[k].to(dtype).contiguous() for k in sorted(expected)}


def _info(src: TrainedDrafter, dtype: torch.dtype, best: BestStep | None) -> dict[str, Any]:
    dflash2 = src.config.variant == "dflash2"
    chosen = {} if best is None else {
        "chosen": {"by": best.key, "value": best.value, "reason": best.reason()}
    }  # fmt: skip
    return {
        "format": "DFlash2DraftModel (z-lab dflash; SGLang, vLLM)"
        if dflash2
        else "DFlashDraftModel (z-lab dflash; SGLang, vLLM, Transformers)",
        "architecture": ARCHITECTURES[src.config.variant],
        "checkpoint": str(src.checkpoint),
        "step": src.step,
        "target": src.target_name,
        "target_config": src.target,
        "target_layer_ids": src.layer_ids,
        "mask_token_id": src.config.mask_token_id,
        "block_size": src.config.block_size,
        "drafter_layers": src.config.num_layers,
        "dtype": _DTYPE_NAMES[dtype],
        "trained_with": objective(src.loss_config),
        **chosen,
    }


def objective(loss: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's loss config says of the objective that trained it: the loss
    weighting, the normalization, the anchor draw and rule."""
    keys = ("weighting", "dpace_alpha", "gamma", "normalization", "divisor", "anchor_draw",
            "anchors_per_doc", "tokens_per_anchor", "max_anchors")  # fmt: skip
    out = {k: loss[k] for k in keys if k in loss}
    out.pop("dpace_alpha" if out.get("weighting") != "dpace" else "gamma", None)
    return out


def _readme(info: dict[str, Any]) -> str:
    dflash2 = info["architecture"] == ARCHITECTURES["dflash2"]
    transformers_line = (
        "Transformers' DFlash loop drafts DFlash v1 only; vLLM's DFlash2 path needs a GPU "
        "(Triton kernels)."
        if dflash2
        else "Transformers: `target.generate(ids, assistant_model=AutoModel.from_pretrained("
        'DRAFT, trust_remote_code=True, dtype=target.dtype), speculation_type="dflash", '
        "do_sample=False)`."
    )
    chosen = f": {info['chosen']['reason']}" if "chosen" in info else ""
    return f"""# {"DFlash2" if dflash2 else "DFlash"} drafter

Trained by dflash-loader's trainer (`dflash-train export`).

* target: `{info["target"]}` ({info["target_config"]["num_hidden_layers"]} layers, vocabulary \
{info["target_config"]["vocab_size"]})
* target layer ids: {info["target_layer_ids"]}; MASK token id: {info["mask_token_id"]}
* block size: {info["block_size"]}; drafter layers: {info["drafter_layers"]}; \
weights: {info["dtype"]}
* from: `{info["checkpoint"]}` (step {info["step"]}{chosen})
* trained with: {", ".join(f"{k} {v}" for k, v in info["trained_with"].items())}

Serve it next to its target (DRAFT = this folder):

```bash
python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\
    --speculative-draft-model-path DRAFT --trust-remote-code
vllm serve TARGET --speculative-config \\
    '{{"method": "dflash", "model": "DRAFT", "num_speculative_tokens": {info["block_size"] - 1}}}'
```

{transformers_line}
"""


def _verifier_architectures(src: TrainedDrafter) -> list[str]:
    """The target's ``architectures`` (its folder's config), else its model type's
    causal-LM class (the tiny target: ``Qwen3ForCausalLM``)."""
    file = Path(src.target_name) / "config.json"
    if file.is_file():
        config = read_json(file, "the target's config.json")
        found = config.get("architectures") if isinstance(config, dict) else None
        if found:
            return [str(a) for a in found]
    return [f"{src.target['model_type'].capitalize()}ForCausalLM"]


def _write_folder(
    folder: Path, src: TrainedDrafter, dtype: torch.dtype, fmt: str, best: BestStep | None
) -> None:
    from safetensors.torch import save_file

    config = folder_config(src, dtype)
    if fmt == "speculators":
        if not (Path(src.target_name) / "config.json").is_file():
            log.warning(
                "target %r is not a folder: speculators loads the verifier from "
                "speculators_config.verifier.name_or_path, so point it at the target's folder "
                "before loading (dflash-train save-target writes the tiny one)",
                src.target_name,
            )
        config = speculators_config(
            config, verifier=src.target_name, verifier_architectures=_verifier_architectures(src),
            where=str(src.checkpoint),
        )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_state_for_export(src, dtype), str(folder / WEIGHTS), metadata={"format": "pt"})
    for path in remote_code_paths() if (src.config.variant, fmt) == ("dflash", "dflash") else ():
        shutil.copyfile(path, folder / path.name)
    info = {**_info(src, dtype, best), "dialect": fmt}
    (folder / INFO).write_text(json.dumps(info, indent=2) + "\n")
    (folder / "README.md").write_text(_readme(info))
    for file in folder.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


FORMATS = ("dflash", "speculators")


def export_drafter(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    best: str | None = None,
    dtype: str = "bf16",
    force: bool = False,
    fmt: str = "dflash",
) -> Path:
    """Write ``run_dir``'s drafter (newest checkpoint, or ``step``, or with ``best`` the kept
    checkpoint with the highest ``tau/BEST``: ``choose_best``) to ``out``, atomically
    (``trainer.files.atomic_output``), in the DFlash dialect (z-lab's; SGLang, vLLM,
    Transformers) or, ``fmt="speculators"``, speculators' (``trainer.hf.speculators``). An
    existing non-empty ``out`` needs ``force``; an ``out`` that is, contains or lies inside
    the checkpoint read is refused."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if best is not None and step is not None:
        raise ValueError("--best and --step exclude each other")
    out = Path(out)
    check_output(out, inputs=[Path(run_dir) / CONFIG_FILE], force=force)  # before reading
    chosen = choose_best(Path(run_dir), best) if best is not None else None
    src = read_trained_drafter(Path(run_dir), chosen.step if chosen else step)
    check_servable(src)
    inputs = [src.checkpoint, Path(run_dir) / CONFIG_FILE]
    # --force: the old export goes only once the new one is in place
    with atomic_output(out, folder=True, force=force, inputs=inputs) as tmp:
        _write_folder(tmp, src, DTYPES[dtype], fmt, chosen)
    log.info("exported %s (step %d%s) to %s", src.checkpoint, src.step,
             f": {chosen.reason()}" if chosen else "", out)  # fmt: skip
    return out
