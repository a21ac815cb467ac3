"""Reading a DFlash drafter folder (``--init-drafter``): its ``config.json`` checked for what
this drafter can express, its options filled in, its weights loaded. ``export`` writes the
same formats (``trainer.hf.export``): the DFlash dialect (z-lab's, Transformers') as it is,
and speculators' (``speculators_model_type``), read through ``trainer.hf.speculators``'s
mapping into the DFlash dialect first, so both meet the same checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from loader_server.wire.files import file_error, read_json
from trainer.hf import ARCHITECTURES
from trainer.hf.configuration_dflash import DFLASH_KEYS
from trainer.hf.speculators import SPECULATORS_KEY, dflash_from_speculators
from trainer.model.drafter import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING,
    DFlashDrafter,
    DrafterConfig,
)
from trainer.model.rope import check_scaling, scaling_from_config
from trainer.option_values import layer_kinds, parse_int_list
from trainer.options import DFLASH2_DEFAULTS
from trainer.sections import RunOptions

if TYPE_CHECKING:
    from trainer.model.target import Target

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: DFlash2's ``dflash_config`` keys every engine needs (vLLM reads them without a default).
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def weight_names(names: set[str]) -> str:
    """``a`` or ``a (and 3 more)``: the first of ``names`` for a one-line error."""
    first = sorted(names)
    return first[0] + (f" (and {len(first) - 1} more)" if len(first) > 1 else "")


@dataclass(frozen=True)
class DrafterFolder:
    """A DFlash drafter folder's ``config.json`` (checked for what this drafter can express)."""

    path: Path
    config: dict[str, Any]  # in the DFlash dialect (a speculators config mapped to it)
    dialect: str = "dflash"  # or "speculators": the layout of the folder's config.json

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
    def layer_types(self) -> tuple[str, ...] | None:
        """Per layer full_attention / sliding_attention; None when every layer is full."""
        kinds = tuple(self.config.get("layer_types") or ())
        return kinds if SLIDING in kinds else None

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (``dflash_config.swa_window_size``, else the
        top-level ``sliding_window``, vLLM's order); None without sliding layers."""
        if self.layer_types is None:
            return None
        value = self.dflash.get("swa_window_size", self.config.get("sliding_window"))
        return None if value is None else int(value)

    @property
    def sliding_causal(self) -> bool:
        """Whether sliding layers are causal inside the block: unless ``is_causal`` (vLLM
        and SGLang read it first) or ``dflash_config.causal`` says false. True without
        sliding layers (the drafter config's spelling)."""
        if self.layer_types is None:
            return True
        for key in ("is_causal", "causal"):
            if self.value(key) is not None:
                return bool(self.value(key))
        return True

    @property
    def variant(self) -> str:
        """``dflash`` or ``dflash2``, by the folder's architecture."""
        arch = self.config.get("architectures") or []
        return next((v for v, a in ARCHITECTURES.items() if a in arch), "dflash")

    @property
    def dflash2(self) -> dict[str, Any]:
        """The DFlash2 fields of the drafter config (``DFLASH2_DEFAULTS`` where the folder
        is silent); empty for a DFlash folder."""
        if self.variant != "dflash2":
            return {}
        out = {k: self.dflash.get(k) for k in DFLASH2_DEFAULTS}  # where vLLM reads them
        return {k: DFLASH2_DEFAULTS[k] if v is None else v for k, v in out.items()}

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The scaling of its RoPE (``rope_parameters``, else ``rope_scaling``), as the
        drafter config says it (``trainer.model.rope``); None for plain RoPE."""
        keys = ("rope_parameters", "rope_scaling", "max_position_embeddings")
        return scaling_from_config(SimpleNamespace(**{k: self.config.get(k) for k in keys}))

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
        raise FileNotFoundError(
            f"{path}: no config.json, so not a drafter folder (export makes one)"
        )
    config = read_json(file, "a drafter folder's config.json (JSON)")
    if not isinstance(config, dict):
        raise ValueError(f"{file}: a drafter's config is a JSON object, this is a "
                         f"{type(config).__name__}")  # fmt: skip
    if SPECULATORS_KEY in config:
        folder = DrafterFolder(Path(path), dflash_from_speculators(config, file), "speculators")
    else:
        folder = DrafterFolder(Path(path), config)
    _check_kind(folder, file)
    _check_layer_types(folder, file)
    if folder.layer_types is not None:
        _check_sliding(folder, file)
    _check_shape_rules(folder, file)
    return folder


def _check_kind(folder: DrafterFolder, file: Path) -> None:
    """A DFlash or DFlash2 drafter with its target layers, and nothing it cannot train."""
    arch = folder.config.get("architectures") or []
    if not set(ARCHITECTURES.values()) & set(arch):
        raise ValueError(
            f"{file}: architectures {arch} is none of {sorted(ARCHITECTURES.values())}"
        )
    if not folder.target_layer_ids:
        raise ValueError(f"{file}: no dflash_config.target_layer_ids")
    dflash2 = folder.variant == "dflash2"
    if dflash2:
        missing = [k for k in DFLASH2_REQUIRED if folder.dflash.get(k) is None]
        if missing:
            raise ValueError(f"{file}: a {arch[0]} needs dflash_config.{missing[0]}")
    for key, neutral in _UNSUPPORTED.items():
        if dflash2 and key in DFLASH2_DEFAULTS:
            continue  # DFlash2's own fields
        value = folder.value(key)
        if value not in (None, neutral, False, 0):
            raise ValueError(f"{file}: {key} = {value!r} is not supported by this drafter")


def _check_layer_types(folder: DrafterFolder, file: Path) -> None:
    kinds = list(folder.config.get("layer_types") or [FULL_ATTENTION])
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{file}: layer_types {unknown}: only {' and '.join(LAYER_TYPES)}")
    if folder.layer_types is not None and len(kinds) != folder.config.get("num_hidden_layers"):
        raise ValueError(
            f"{file}: layer_types has {len(kinds)} entries for num_hidden_layers "
            f"{folder.config.get('num_hidden_layers')}"
        )


def _check_sliding(folder: DrafterFolder, file: Path) -> None:
    """Sliding layers as Transformers, SGLang and vLLM read them."""
    if folder.sliding_window is None or folder.sliding_window < 1:
        raise ValueError(
            f"{file}: sliding_attention layers but sliding_window is "
            f"{folder.config.get('sliding_window')!r}"
        )
    if folder.config.get("use_sliding_window") is not True:
        raise ValueError(
            f"{file}: sliding_attention layers with use_sliding_window "
            f"{folder.config.get('use_sliding_window')!r} (Transformers then drops "
            "sliding_window, and vLLM refuses the folder): it must be true"
        )
    nested, top = folder.dflash.get("swa_window_size"), folder.config.get("sliding_window")
    if nested is not None and top is not None and int(nested) != int(top):
        raise ValueError(f"{file}: dflash_config.swa_window_size {nested} != sliding_window {top}")
    for key in ("is_causal", "causal"):
        if folder.value(key) not in (None, False):
            raise ValueError(
                f"{file}: {key} = {folder.value(key)!r}: full layers are bidirectional "
                "inside the block here; only false (bidirectional sliding layers) or "
                "unset (the engines' default: sliding layers causal) is supported"
            )


def _check_shape_rules(folder: DrafterFolder, file: Path) -> None:
    """RoPE the drafter rotates as Transformers does (plain, or ``trainer.model.rope``'s
    scaled types), SiLU without attention bias, and no dflash_config key this trainer does
    not know."""
    check_scaling(folder.rope_scaling, str(file))
    if folder.config.get("hidden_act", "silu") != "silu" or folder.config.get("attention_bias"):
        raise ValueError(f"{file}: only hidden_act silu without attention_bias is supported")
    known = {*DFLASH_KEYS, *_UNSUPPORTED, *DFLASH2_DEFAULTS, "mask_token", "swa_window_size"}
    extra = sorted(set(folder.dflash) - known)
    if extra:
        raise ValueError(f"{file}: unknown dflash_config keys {extra}")


def _agree(flag: str, mine: Any, key: str, theirs: Any, file: Path) -> Any:
    """The folder's value, which the user's (if given) must equal."""
    if theirs is None:
        raise ValueError(f"{file}: no {key}")
    if mine is not None and mine != theirs:
        raise ValueError(f"{flag} {mine} differs from {file}'s {key} {theirs}: drop {flag}")
    return theirs


def options_from_folder(opts: RunOptions, folder: DrafterFolder) -> RunOptions:
    """``opts`` with ``--layers``, ``--drafter-layers``, ``--block-size``, ``--layer-types``,
    ``--sliding-window`` and ``--mask-token-id`` taken from ``folder`` where the user gave
    none; a value the user gave must agree with the folder's (the MASK token may be
    overridden, with a warning)."""
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
    _agree_on_sliding(opts, folder, drafter_layers, file)
    kinds = folder.layer_types
    variant = _agree("--drafter", opts.drafter, "architectures", folder.variant, file)
    dflash2 = _dflash2_options(opts, folder, file)
    if opts.learned_mask:
        raise ValueError(f"--learned-mask: {file} embeds a mask token id instead")
    return replace(
        opts,
        layers=",".join(str(i) for i in ids),
        drafter_layers=drafter_layers,
        block_size=block_size,
        mask_token_id=_mask_token(opts.mask_token_id, folder.mask_token_id, file),
        layer_types=None if kinds is None else ",".join(kinds),
        sliding_window=folder.sliding_window,
        sliding_bidirectional=not folder.sliding_causal,
        drafter=variant,
        **dflash2,
    )


def _agree_on_sliding(opts: RunOptions, folder: DrafterFolder, layers: int, file: Path) -> None:
    """``--sliding-window``, ``--layer-types`` and ``--sliding-bidirectional``, where given,
    say what the folder's layers are."""
    window = folder.sliding_window
    if opts.sliding_window is not None and opts.sliding_window != window:
        raise ValueError(
            f"--sliding-window {opts.sliding_window} differs from {file}'s sliding_window "
            f"{window}: drop --sliding-window"
        )
    if opts.layer_types is not None:
        mine = layer_kinds(opts.layer_types, layers)
        if (mine if SLIDING in mine else None) != folder.layer_types:
            raise ValueError(
                f"--layer-types {opts.layer_types} differs from {file}'s layer_types "
                f"{list(folder.layer_types or [FULL_ATTENTION] * layers)}: drop "
                "--layer-types"
            )
    if opts.sliding_bidirectional and folder.sliding_causal:
        raise ValueError(
            f"--sliding-bidirectional: {file}'s sliding layers are causal (or it has none): "
            "drop --sliding-bidirectional"
        )


def _dflash2_options(opts: RunOptions, folder: DrafterFolder, file: Path) -> dict[str, Any]:
    """The folder's DFlash2 fields, which the user's (where given) must equal."""
    dflash2 = {}
    for k, theirs in folder.dflash2.items():
        flag, mine = "--" + k.replace("_", "-"), getattr(opts, k)
        if theirs is None and mine is not None:
            raise ValueError(f"{flag} {mine} differs from {file}'s {k} (unset): drop {flag}")
        if theirs is not None:
            dflash2[k] = _agree(flag, mine, k, theirs, file)
    return dflash2


def _mask_token(mine: int | None, theirs: int | None, file: Path) -> int | None:
    """The folder's MASK token, or the user's ``--mask-token-id`` over it (with a warning)."""
    if mine is None:
        return theirs
    if theirs is not None and mine != theirs:
        log.warning("--mask-token-id %d overrides %s's mask_token_id %d", mine, file, theirs)
    return mine


def check_folder_against(folder: DrafterFolder, drafter: DFlashDrafter, target: Target) -> None:
    """The folder's shape, vocabulary and depth against this run's drafter and target; a
    feature this trainer would compute otherwise than the folder's writer is refused, and
    what it reads otherwise than the target says (the MASK token) said once."""
    file, cfg, c = folder.path / "config.json", drafter.config, folder.config
    _check_last_layer(folder, target, file)
    _say_mask_token(folder, target, file)
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
        ("rope_scaling", folder.rope_scaling, cfg.rope_scaling),
        ("vocab_size", c.get("vocab_size"), target.vocab_size),
        ("num_target_layers", folder.value("num_target_layers"), target.num_layers),
        ("target_layer_ids", folder.target_layer_ids, target.layer_ids),
        ("layer_types", folder.layer_types, cfg.layer_types),
        ("sliding_window", folder.sliding_window, cfg.sliding_window),
        ("sliding causal", folder.sliding_causal, cfg.sliding_causal),
        ("architectures", folder.variant, cfg.variant),
        *((k, v, getattr(cfg, k)) for k, v in folder.dflash2.items()),
    )
    for key, theirs, mine in fields:
        if theirs is None and key in ("num_target_layers", "rms_norm_eps", "rope_theta"):
            continue  # optional in released configs; the weights' shapes still decide
        if theirs != mine:
            raise ValueError(f"{file}: {key} {theirs} != {mine} (this run's drafter and target)")


def _check_last_layer(folder: DrafterFolder, target: Target, file: Path) -> None:
    """A speculators folder naming the target's depth (vLLM's numbering: the last layer's
    output *before* the final norm) maps to this trainer's last layer id, whose feature is
    the output *after* the norm (as Transformers reports it, and z-lab's dialect means):
    the drafter would read another input than it was trained on. Refused, not mended."""
    last = target.num_layers - 1
    if folder.dialect == "speculators" and last in (folder.target_layer_ids or ()):
        raise ValueError(
            f"{file}: aux_hidden_state_layer_ids holds {last + 1}, the target's depth: in "
            "speculators' and vLLM's numbering the last layer's output before the final "
            "norm, which this trainer does not compute (its last layer's feature is after "
            "the norm, as Transformers and z-lab's dialect have it), so the drafter would "
            "read another input than it was trained on; it cannot be loaded here"
        )


def _say_mask_token(folder: DrafterFolder, target: Target, file: Path) -> None:
    """Once per folder: a MASK token other than the target's own (the drafter drafts, and
    engines serve it, with the folder's)."""
    from trainer.model.target import mask_token_id

    mine, theirs = mask_token_id(target), folder.mask_token_id
    if mine is not None and theirs is not None and mine != theirs and file not in _SAID:
        _SAID.add(file)
        log.warning(
            "%s: the drafter's MASK token is %d, the target's %d: it drafts with token %d's "
            "embedding row, as it was trained (engines read the folder's too)",
            file, theirs, mine, theirs,
        )  # fmt: skip


#: Folders whose reinterpretations were said (once each, whatever reads them again).
_SAID: set[Path] = set()


def config_from_folder(folder: DrafterFolder, target: Target) -> DrafterConfig:
    """The drafter config a folder describes, on ``target`` (whose width it takes)."""
    return DrafterConfig.from_target(
        target.config,
        num_target_layers=len(target.layer_ids),
        num_layers=int(folder.config["num_hidden_layers"]),
        block_size=int(folder.value("block_size")),
        mask_token_id=folder.mask_token_id,
        layer_types=folder.layer_types,
        sliding_window=folder.sliding_window,
        sliding_causal=folder.sliding_causal,
        **({"variant": "dflash2", **folder.dflash2} if folder.variant == "dflash2" else {}),
    )


def read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder (``model.safetensors`` or a sharded index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / WEIGHTS_INDEX
    if index.is_file():
        doc = read_json(index, "a safetensors index (JSON)")
        try:
            files = sorted(set(doc["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{index}: no 'weight_map' object naming the shards") from None
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{folder}: neither {WEIGHTS} nor {WEIGHTS_INDEX}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            out.update(load_file(str(folder / name)))
        except SafetensorError as e:  # cut short, or not safetensors at all
            raise file_error(folder / name, "safetensors weights", e) from None
    return out


def load_folder_weights(folder: DrafterFolder, drafter: DFlashDrafter) -> None:
    """Fill every drafter parameter from the folder and use every tensor of it."""
    where = folder.path / WEIGHTS
    tensors = read_folder_weights(folder.path)
    params = drafter.state_dict()
    missing, extra = set(params) - set(tensors), set(tensors) - set(params)
    if missing:
        raise ValueError(
            f"{where}: no tensor {weight_names(missing)} (the drafter needs every one)"
        )
    if extra:
        raise ValueError(f"{where}: tensor {weight_names(extra)} is not a drafter weight")
    for name, value in tensors.items():
        if value.shape != params[name].shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(value.shape)}, the drafter's is "
                f"{list(params[name].shape)}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(param.dtype))


def init_drafter(drafter: DFlashDrafter, folder: DrafterFolder, target: Target) -> None:
    """``--init-drafter``: the folder's weights into ``drafter`` after checking the folder
    against this run's drafter and target."""
    check_folder_against(folder, drafter, target)
    if drafter.mask_embedding is not None:
        raise ValueError(f"{folder.path}: a learned MASK vector cannot be initialised from it")
    load_folder_weights(folder, drafter)
    log.info("drafter initialised from %s (%s dialect)", folder.path, folder.dialect)
