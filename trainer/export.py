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
* ``README.md`` and ``dflash_export.json``: where it came from (run, step, target, layers).

What the export needs from the target (its vocabulary, depth, RoPE and context length) is
recorded in the checkpoint's ``meta["target_config"]`` at save time (``target_record``);
checkpoints written before that are served by the run's ``config.json`` (``--target``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.hf import remote_code_paths
from trainer.hf.configuration_dflash import DFLASH_KEYS
from trainer.options import CONFIG_FILE, RunOptions, TargetOptions

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
INFO = "dflash_export.json"
ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


# ---- the target, as recorded at save time ----------------------------------------------


def target_record(config: Any) -> dict[str, Any]:
    """What an export needs from the target's Hugging Face config (kept in checkpoint meta)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope = dict(rope or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return {
        "model_type": str(getattr(config, "model_type", "")),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "max_position_embeddings": int(config.max_position_embeddings),
        "rope_type": str(rope.get("rope_type", rope.get("type", "default"))),
        "rope_theta": None if theta is None else float(theta),
    }


def _target_from_run_config(run_dir: Path) -> dict[str, Any]:
    """The target record of a run whose checkpoints predate ``meta["target_config"]``."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing and the checkpoint records no target config: cannot tell the "
            "target's vocabulary, depth and RoPE"
        )
    opts = TargetOptions.from_record(json.loads(path.read_text()), str(path))
    if opts.target == "tiny":
        from trainer.run import target_from_opts

        return target_record(target_from_opts(opts, "meta").config)
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
    """The drafter of ``run_dir``'s newest checkpoint (or of ``step``)."""
    path = find_checkpoint(run_dir, step)
    file = path / "model.pt"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {file}")
    # mmap: the optimizer state next to the weights is never read.
    shared = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if shared.get("version") != ckpt.CHECKPOINT_VERSION:
        raise ValueError(f"{file}: checkpoint version {shared.get('version')} is not supported")
    meta = shared.get("meta") or {}
    if "layer_ids" not in meta:
        raise ValueError(f"{file}: the checkpoint records no target layer ids (meta.layer_ids)")
    target = meta.get("target_config") or _target_from_run_config(run_dir)
    return TrainedDrafter(
        checkpoint=path,
        step=int(shared["step"]),
        config=DrafterConfig(**shared["drafter_config"]),
        weights=dict(shared["drafter"]),
        target_name=str(meta.get("target", "?")),
        target=target,
        layer_ids=[int(i) for i in meta["layer_ids"]],
    )


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
    _warn_serving(src)


def _warn_serving(src: TrainedDrafter) -> None:
    """What serves, but maybe not as the target computes it."""
    depth = src.target["num_hidden_layers"]
    if depth - 1 in src.layer_ids:
        log.warning(
            "layer id %d is the target's last layer: Transformers reports its output normed, "
            "SGLang and vLLM capture layer inputs (id + 1) and may not provide it",
            depth - 1,
        )
    if src.target.get("rope_type", "default") != "default":
        log.warning(
            "target uses RoPE %r; the drafter was trained (and is exported) with plain RoPE, "
            "theta %s",
            src.target["rope_type"],
            src.config.rope_theta,
        )


def folder_config(src: TrainedDrafter, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the export (see the module docstring for who reads what)."""
    import transformers

    cfg, tgt = src.config, src.target
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": {
            "AutoConfig": "configuration_dflash.DFlashConfig",
            "AutoModel": "modeling_dflash.DFlashDraftModel",
        },
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
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": tgt["max_position_embeddings"],
        "vocab_size": tgt["vocab_size"],
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "block_size": cfg.block_size,
        "num_target_layers": tgt["num_hidden_layers"],
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": src.layer_ids},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in src.layer_ids],
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
        "transformers_version": transformers.__version__,
    }


def _names(names: set[str]) -> str:
    """``a`` or ``a (and 3 more)``: the first of ``names`` for a one-line error."""
    first = sorted(names)
    return first[0] + (f" (and {len(first) - 1} more)" if len(first) > 1 else "")


def _state_for_export(src: TrainedDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, checked against the drafter's parameter names."""
    with torch.device("meta"):
        expected = set(DFlashDrafter(src.config).state_dict())
    got = set(src.weights)
    if expected - got:
        raise ValueError(f"{src.checkpoint}: drafter weight {_names(expected - got)} is missing")
    if got - expected:
        raise ValueError(f"{src.checkpoint}: unexpected drafter weight {_names(got - expected)}")
    return {k: src.weights[k].to(dtype).contiguous() for k in sorted(expected)}


def _info(src: TrainedDrafter, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "format": "DFlashDraftModel (z-lab dflash; SGLang, vLLM, Transformers)",
        "checkpoint": str(src.checkpoint),
        "step": src.step,
        "target": src.target_name,
        "target_config": src.target,
        "target_layer_ids": src.layer_ids,
        "mask_token_id": src.config.mask_token_id,
        "block_size": src.config.block_size,
        "drafter_layers": src.config.num_layers,
        "dtype": _DTYPE_NAMES[dtype],
    }


def _readme(info: dict[str, Any]) -> str:
    return f"""# DFlash drafter

Trained by dflash-loader's trainer (`dflash-train export`).

* target: `{info["target"]}` ({info["target_config"]["num_hidden_layers"]} layers, vocabulary \
{info["target_config"]["vocab_size"]})
* target layer ids: {info["target_layer_ids"]}; MASK token id: {info["mask_token_id"]}
* block size: {info["block_size"]}; drafter layers: {info["drafter_layers"]}; \
weights: {info["dtype"]}
* from: `{info["checkpoint"]}` (step {info["step"]})

Serve it next to its target (DRAFT = this folder):

```bash
python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\
    --speculative-draft-model-path DRAFT --trust-remote-code
vllm serve TARGET --speculative-config \\
    '{{"method": "dflash", "model": "DRAFT", "num_speculative_tokens": {info["block_size"] - 1}}}'
```

Transformers: `target.generate(ids, assistant_model=AutoModel.from_pretrained(DRAFT, \
trust_remote_code=True, dtype=target.dtype), speculation_type="dflash", do_sample=False)`.
"""


def _write_folder(folder: Path, src: TrainedDrafter, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = folder_config(src, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_state_for_export(src, dtype), str(folder / WEIGHTS), metadata={"format": "pt"})
    for path in remote_code_paths():
        shutil.copyfile(path, folder / path.name)
    info = _info(src, dtype)
    (folder / INFO).write_text(json.dumps(info, indent=2) + "\n")
    (folder / "README.md").write_text(_readme(info))
    for file in folder.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _check_out(out: Path, force: bool) -> None:
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.exists() and not force:
        raise ValueError(f"{out} exists and is not empty: pass --force to replace it")


def export_drafter(
    run_dir: Path, out: Path, *, step: int | None = None, dtype: str = "bf16", force: bool = False
) -> Path:
    """Write ``run_dir``'s drafter (newest checkpoint, or ``step``) to ``out``, atomically:
    built in ``OUT.tmp`` and renamed. An existing non-empty ``out`` needs ``force``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    _check_out(out, force)
    src = read_trained_drafter(Path(run_dir), step)
    check_servable(src)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    for stale in (tmp, old):
        _remove(stale)
    _write_folder(tmp, src, DTYPES[dtype])
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        os.replace(out, old)  # --force: the old export goes only once the new one is in place
    os.replace(tmp, out)
    _remove(old)
    log.info("exported %s (step %d) to %s", src.checkpoint, src.step, out)
    return out


# ---- reading a folder (--init-drafter) -------------------------------------------------


@dataclass(frozen=True)
class DrafterFolder:
    """A DFlash drafter folder's ``config.json`` (checked for what this drafter can express)."""

    path: Path
    config: dict[str, Any]

    @property
    def dflash(self) -> dict[str, Any]:
        return dict(self.config.get("dflash_config") or {})

    def value(self, key: str) -> Any:
        """``dflash_config[key]``, else the top-level key (the serving engines' order)."""
        return self.dflash.get(key, self.config.get(key))

    @property
    def target_layer_ids(self) -> list[int] | None:
        ids = self.value("target_layer_ids")
        return None if ids is None else [int(i) for i in ids]

    @property
    def mask_token_id(self) -> int | None:
        value = self.value("mask_token_id")
        return None if value is None else int(value)

    @property
    def rope_theta(self) -> float | None:
        rope = self.config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", self.config.get("rope_theta"))
        return None if theta is None else float(theta)


# Keys (dflash_config or top level) that change the math, with their neutral value.
_UNSUPPORTED = {
    "conv_kernel_size": 0,
    "selector_rank": 0,
    "projector_type": None,
    "attention_sink_bias": False,
    "attention_value_scale": None,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
    "use_swa": False,
    "causal": None,
    "is_causal": None,
    "has_embed_tokens": None,
}


def read_drafter_folder(path: Path) -> DrafterFolder:
    """``path``'s config, refused where it is not a DFlash drafter this trainer can load."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"--init-drafter {path}: no config.json")
    folder = DrafterFolder(Path(path), json.loads(file.read_text()))
    arch = folder.config.get("architectures") or []
    if ARCHITECTURE not in arch:
        raise ValueError(f"{file}: architectures {arch} is not [{ARCHITECTURE!r}]")
    if not folder.target_layer_ids:
        raise ValueError(f"{file}: no dflash_config.target_layer_ids")
    for key, neutral in _UNSUPPORTED.items():
        value = folder.value(key)
        if value not in (None, neutral, False, 0):
            raise ValueError(f"{file}: {key} = {value!r} is not supported by this drafter")
    kinds = set(folder.config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{file}: layer_types {sorted(kinds)}: only full_attention is supported")
    rope = folder.config.get("rope_parameters") or folder.config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{file}: rope_type {kind!r}: only plain RoPE is supported")
    if folder.config.get("hidden_act", "silu") != "silu" or folder.config.get("attention_bias"):
        raise ValueError(f"{file}: only hidden_act silu without attention_bias is supported")
    extra = sorted(set(folder.dflash) - set(DFLASH_KEYS) - set(_UNSUPPORTED) - {"mask_token"})
    if extra:
        raise ValueError(f"{file}: unknown dflash_config keys {extra}")
    return folder


def _agree(flag: str, mine: Any, key: str, theirs: Any, file: Path) -> Any:
    """The folder's value, which the user's (if given) must equal."""
    if theirs is None:
        raise ValueError(f"{file}: no {key}")
    if mine is not None and mine != theirs:
        raise ValueError(f"{flag} {mine} differs from {file}'s {key} {theirs}: drop {flag}")
    return theirs


def options_from_folder(opts: RunOptions, folder: DrafterFolder) -> RunOptions:
    """``opts`` with ``--layers``, ``--drafter-layers``, ``--block-size`` and
    ``--mask-token-id`` taken from ``folder`` where the user gave none; a value the user gave
    must agree with the folder's (the MASK token may be overridden, with a warning)."""
    from trainer.run import parse_int_list

    file, c = folder.path / "config.json", folder.config
    ids = _agree(
        "--layers", parse_int_list(opts.layers), "target_layer_ids",
        folder.target_layer_ids, file,
    )  # fmt: skip
    layers = c.get("num_hidden_layers")
    drafter_layers = int(
        _agree("--drafter-layers", opts.drafter_layers, "num_hidden_layers", layers, file)
    )
    block = folder.value("block_size")
    block_size = int(_agree("--block-size", opts.block_size, "block_size", block, file))
    if opts.learned_mask:
        raise ValueError(f"--learned-mask: {file} embeds a mask token id instead")
    mask = folder.mask_token_id
    mask_token_id = opts.mask_token_id
    if mask_token_id is None:
        mask_token_id = mask
    elif mask is not None and mask_token_id != mask:
        log.warning("--mask-token-id %d overrides %s's mask_token_id %d", mask_token_id, file, mask)
    return replace(
        opts,
        layers=",".join(str(i) for i in ids),
        drafter_layers=drafter_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
    )


def check_folder_against(folder: DrafterFolder, drafter: DFlashDrafter, target: Any) -> None:
    """The folder's shape, vocabulary and depth against this run's drafter and target."""
    file, cfg, c = folder.path / "config.json", drafter.config, folder.config
    fields = (
        ("hidden_size", c.get("hidden_size"), cfg.hidden_size),
        ("intermediate_size", c.get("intermediate_size"), cfg.intermediate_size),
        ("num_attention_heads", c.get("num_attention_heads"), cfg.num_heads),
        ("num_key_value_heads", c.get("num_key_value_heads"), cfg.num_kv_heads),
        ("head_dim", c.get("head_dim"), cfg.head_dim),
        ("num_hidden_layers", c.get("num_hidden_layers"), cfg.num_layers),
        ("block_size", folder.value("block_size"), cfg.block_size),
        ("rms_norm_eps", c.get("rms_norm_eps"), cfg.rms_norm_eps),
        ("rope_theta", folder.rope_theta, cfg.rope_theta),
        ("vocab_size", c.get("vocab_size"), target.vocab_size),
        ("num_target_layers", folder.value("num_target_layers"), target.num_layers),
        ("target_layer_ids", folder.target_layer_ids, target.layer_ids),
    )
    for key, theirs, mine in fields:
        if theirs is None and key in ("num_target_layers", "rms_norm_eps", "rope_theta"):
            continue  # optional in released configs; the weights' shapes still decide
        if theirs != mine:
            raise ValueError(f"{file}: {key} {theirs} != {mine} (this run's drafter and target)")


def read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (``model.safetensors`` or a sharded index)."""
    from safetensors.torch import load_file

    index = folder / WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{folder}: neither {WEIGHTS} nor {WEIGHTS_INDEX}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return out


def load_folder_weights(folder: DrafterFolder, drafter: DFlashDrafter) -> None:
    """Fill every drafter parameter from the folder and use every tensor of it."""
    where = folder.path / WEIGHTS
    tensors = read_folder_weights(folder.path)
    params = drafter.state_dict()
    missing, extra = set(params) - set(tensors), set(tensors) - set(params)
    if missing:
        raise ValueError(f"{where}: no tensor {_names(missing)} (the drafter needs every one)")
    if extra:
        raise ValueError(f"{where}: tensor {_names(extra)} is not a drafter weight")
    for name, value in tensors.items():
        if value.shape != params[name].shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(value.shape)}, the drafter's is "
                f"{list(params[name].shape)}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(param.dtype))


def init_drafter(drafter: DFlashDrafter, folder: DrafterFolder, target: Any) -> None:
    """``--init-drafter``: the folder's weights into ``drafter`` after checking the folder
    against this run's drafter and target."""
    check_folder_against(folder, drafter, target)
    if drafter.mask_embedding is not None:
        raise ValueError(f"{folder.path}: a learned MASK vector cannot be initialised from it")
    load_folder_weights(folder, drafter)
    log.info("drafter initialised from %s", folder.path)
