"""The options of a training run, as typed values: built once from the command line, written
to the run's ``config.json`` and read back from it.

``TargetOptions`` names the target (``--target`` and the ``--tiny-*`` shape), which
``regen`` and ``save-target`` take too; ``RunOptions`` is every ``dflash-train train`` option
(field name = click's parameter name, so the keys of ``config.json`` are the option names).
Reading a ``config.json`` names every unknown and missing key and every value of the wrong
type instead of failing later on one of them.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

CONFIG_FILE = "config.json"
#: What ``config.json`` records about the run besides its options.
RUN_FACTS = ("requested_loader_spec", "world_size")
#: Options that runs written before they existed lack, with the value those runs had.
ADDED_LATER: dict[str, Any] = {"tiny_heads": 4, "tiny_kv_heads": 2, "tiny_intermediate": None}

_Options = TypeVar("_Options", bound="TargetOptions")


@dataclass(frozen=True, kw_only=True)
class TargetOptions:
    """``--target`` (``tiny``: a seeded random Qwen3 shaped by the ``--tiny-*`` options, or a
    local Hugging Face model directory)."""

    target: str = "tiny"
    tiny_vocab: int = 512
    tiny_layers: int = 4
    tiny_hidden: int = 128
    tiny_seed: int = 0
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate: int | None = None  # None: 3 x hidden

    def __post_init__(self) -> None:
        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            if not _has_type(value, hint):
                raise ValueError(f"option {name} must be {_type_name(hint)}, got {value!r}")

    @classmethod
    def pick(cls: type[_Options], kwargs: Mapping[str, Any]) -> _Options:
        """These options out of a command's keyword arguments (which may hold others)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls)})

    @classmethod
    def from_record(cls: type[_Options], record: Mapping[str, Any], source: str) -> _Options:
        """These options out of a JSON record (a run's ``config.json``, which may hold
        others); ``source`` names the record in errors."""
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in record and k not in ADDED_LATER]
        if missing:
            raise ValueError(f"{source}: missing option(s) {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        values = {k: _from_json(record[k], hints[k]) for k in names if k in record}
        try:
            return cls(**{**{k: ADDED_LATER[k] for k in names if k not in record}, **values})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict: paths as strings, tuples as lists."""
        return {f.name: _to_json(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class RunOptions(TargetOptions):
    """Every ``dflash-train train`` option; the defaults are the command line's (a unit test
    holds them equal)."""

    endpoint: str
    job: str = "train"
    layers: str | None = None  # target layer ids "0,1,2" (None: spread)
    drafter_layers: int | None = None  # None: resolved by trainer.run.resolve_init_drafter
    block_size: int | None = None  # None: resolved by trainer.run.resolve_init_drafter
    init_drafter: Path | None = None
    num_anchors: int = 512
    max_anchors: int = 2048
    loss_chunk: int = 1024
    attention: str = "auto"
    mask_token_id: int | None = None
    learned_mask: bool = False
    gamma: float = 7.0
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    steps: int | None = None
    epochs: int | None = None
    grad_accum: int | None = None
    token_budget: int | None = None
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    layout: str | None = None
    spec_pairs: tuple[str, ...] = ()
    cost_profile: Path | None = None
    cost_samples: int = 2000
    run_dir: Path
    resume: bool = False
    eval_every: int = 0
    eval_prompts: Path | None = None
    num_eval_prompts: int = 16
    eval_new_tokens: int = 64
    ckpt_every: int = 0
    keep_checkpoints: int = 3
    seed: int = 0
    timeout_s: float = 60.0
    device: str | None = None
    no_progress: bool = False

    @classmethod
    def read(cls, run_dir: Path) -> RunOptions:
        """The options a run was started with, from its ``config.json``."""
        path = Path(run_dir) / CONFIG_FILE
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(record).__name__}")
        known = {f.name for f in fields(cls)} | set(RUN_FACTS)
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}")
        return cls.from_record(record, str(path))

    def write(self, requested_loader_spec: dict[str, Any], world_size: int) -> Path:
        """``run_dir/config.json``: these options and the run's facts."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = self.to_record()
        record.update(requested_loader_spec=requested_loader_spec, world_size=world_size)
        path = self.run_dir / CONFIG_FILE
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        return path


def _to_json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _from_json(value: Any, hint: Any) -> Any:
    """``value`` as read from JSON, in the form ``hint`` declares (a path, a tuple)."""
    kinds = _kinds(hint)
    if Path in kinds and isinstance(value, str):
        return Path(value)
    if any(typing.get_origin(k) is tuple for k in kinds) and isinstance(value, list):
        return tuple(value)
    return value


def _kinds(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _has_type(value: Any, hint: Any) -> bool:
    return any(_is(value, kind) for kind in _kinds(hint))


def _is(value: Any, kind: Any) -> bool:
    if kind is type(None):
        return value is None
    if isinstance(value, bool) and kind is not bool:  # bool is an int to Python, not to us
        return False
    if kind is float:  # JSON and users write 1 for 1.0
        return isinstance(value, int | float)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(isinstance(v, item) for v in value)
    return isinstance(value, kind)


def _type_name(hint: Any) -> str:
    return " or ".join(
        "null" if k is type(None) else getattr(k, "__name__", str(k)) for k in _kinds(hint)
    )
