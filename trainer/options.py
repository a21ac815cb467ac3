"""Every option of ``dflash-train``, stated once: typed dataclasses whose fields carry their
flag, help and default. The click flags are generated from them (``trainer.cli.flags``), a
training run writes its options to ``config.json`` and reads them back from it.

``TargetOptions`` names the target (``--target`` and the ``--tiny-*`` shape), which
``regen`` and ``save-target`` take too; ``RunOptions`` is every ``dflash-train train`` option
(field name = click's parameter name, so the keys of ``config.json`` are the option names);
``TokenizeOptions`` is how conversations become a corpus, for ``tokenize`` and for
``regen --server``, which tokenizes what it regenerated. Reading a ``config.json`` names every
unknown and missing key and every value of the wrong type instead of failing later on one.

This module is the trainer's foundation: it imports nothing of the trainer but
``trainer.option_values`` (how a value is checked and read), the loader spec's declaration
(``loader_server.wire.spec``: the spec flags' help and choices are its fields'), and no
torch.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from loader_server.wire.spec import SPEC_FIELDS, field_help
from trainer.option_values import (
    from_json,
    has_type,
    to_json,
    type_name,
)

if TYPE_CHECKING:
    from dataclasses import Field

CONFIG_FILE = "config.json"
#: What ``config.json`` records about the run besides its options.
RUN_FACTS = ("requested_loader_spec", "world_size")
#: Options that runs written before they existed lack, with the value those runs had.
ADDED_LATER: dict[str, Any] = {"tiny_heads": 4, "tiny_kv_heads": 2, "tiny_intermediate": None,
                               "max_nonfinite_steps": 0, "max_empty_steps": 0,
                               "log_every_s": 60.0, "report_to": (), "eval_sets": (),
                               "eval_set_limit": 32, "eval_thinking": "off",
                               "eval_batch": 16, "target_shard": "none",
                               # the objective before it was one however a step is cut
                               "tokens_per_anchor": 1, "loss_weighting": "decay",
                               "dpace_alpha": 0.5, "loss_normalization": "micro-batch",
                               "anchor_draw": "micro-batch",
                               # before targets served by an engine
                               "target_engine": "none", "engine_url": None,
                               "vllm_python": None, "engine_dir": None,
                               "engine_inflight": 32, "engine_timeout_s": 300.0,
                               # the drafter's start before --init-std: PyTorch's default
                               "init_std": 0.0}  # fmt: skip
#: Options renamed since: old key -> new key (both spellings are read).
RENAMED = {"num_anchors": "anchors_per_doc"}

_Options = TypeVar("_Options", bound="Options")


def opt(
    default: Any = MISSING,
    help: str = "",
    *,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    path: dict[str, bool] | None = None,
    flag: str | None = None,
    show_default: bool = True,
    section: str = "",
) -> Any:
    """A dataclass field with what its command-line flag needs: ``help``; ``aliases`` (older
    spellings still accepted); ``choices``; ``path`` (``click.Path`` checks such as
    ``{"exists": True, "file_okay": False}``); ``flag`` when it is not ``--field-name``;
    ``section``: the group of flags it is listed under in ``--help``."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "path": path, "flag": flag,
            "show_default": show_default, "section": section}  # fmt: skip
    return field(default=default, metadata=meta)


class Options:
    """Typed, validated, JSON-ready options (the base of every options dataclass here)."""

    # Every subclass is a dataclass, so ``fields(cls)`` holds. Declared for the type checker
    # only: at run time the annotation would be one of the hints ``__post_init__`` checks.
    if TYPE_CHECKING:
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    def __post_init__(self) -> None:
        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            if not has_type(value, hint):
                raise ValueError(f"option {name} must be {type_name(hint)}, got {value!r}")

    @classmethod
    def pick(cls: type[_Options], kwargs: Mapping[str, Any]) -> _Options:
        """These options out of a command's keyword arguments (which may hold others)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls) if f.name in kwargs})

    @classmethod
    def from_record(cls: type[_Options], record: Mapping[str, Any], source: str) -> _Options:
        """These options out of a JSON record (a run's ``config.json``, which may hold
        others); ``source`` names the record in errors. Renamed keys are read under either
        name."""
        record = {RENAMED.get(k, k): v for k, v in record.items()}
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in record and k not in ADDED_LATER]
        if missing:
            raise ValueError(f"{source}: missing option(s) {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        values = {k: from_json(record[k], hints[k]) for k in names if k in record}
        try:
            return cls(**{**{k: ADDED_LATER[k] for k in names if k in ADDED_LATER}, **values})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict: paths as strings, tuples as lists."""
        return {f.name: to_json(getattr(self, f.name)) for f in fields(self)}


TARGET = "Target (tiny: a seeded random Qwen3)"
#: ``--target``'s value for the seeded random Qwen3 (``trainer.model.target``).
TINY = "tiny"
#: ``--target-engine``: the target in each rank, or served by vLLM (``trainer.engine``).
ENGINES = ("none", "vllm")
#: ``--states-transport``: how the states travel (``trainer.engine.seam.TRANSPORTS``); auto:
#: shm when the server is on this machine, else mooncake with a master, else files.
TRANSPORTS = ("auto", "shm", "files", "mooncake")
#: ``--states-dtype``: the states as the engine computed them, or cast for the wire
#: (``trainer.engine.supply.WIRE_NAMES``).
STATES_DTYPES = ("engine", "bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class TargetOptions(Options):
    """``--target`` (``tiny``: a seeded random Qwen3 shaped by the ``--tiny-*`` options, or a
    local Hugging Face model directory)."""

    target: str = opt(
        "tiny", "'tiny' (seeded random Qwen3) or a local Hugging Face model directory.",
        section=TARGET,
    )  # fmt: skip
    tiny_vocab: int = opt(512, "Vocabulary of the tiny target.", section=TARGET)
    tiny_layers: int = opt(4, "Decoder layers of the tiny target.", section=TARGET)
    tiny_hidden: int = opt(128, "Hidden size of the tiny target.", section=TARGET)
    tiny_seed: int = opt(0, "Seed of the tiny target's weights.", section=TARGET)
    tiny_heads: int = opt(4, "Attention heads of the tiny target.", section=TARGET)
    tiny_kv_heads: int = opt(2, "KV heads of the tiny target.", section=TARGET)
    tiny_intermediate: int | None = opt(None, "MLP width of the tiny target [3 x hidden].",
                                        section=TARGET)  # fmt: skip

    @property
    def tiny(self) -> bool:
        """``--target tiny``: the seeded random Qwen3, not a model folder."""
        return self.target == TINY


SPEC = "Loader spec (unset: the daemon's)"


def spec_help(name: str) -> str:
    """A loader spec field's help, with where its default comes from."""
    return f"{field_help(name)} [default: the daemon's]"


def spec_choices(name: str) -> tuple[str, ...]:
    return tuple(SPEC_FIELDS[name].metadata["choices"])


DRAFTER = "Drafter and objective"
OPTIM = "Optimizer and length"
EVAL = "Evaluation, checkpoints, output"


TOKENIZE = "Tokenization"


@dataclass(frozen=True, kw_only=True)
class TokenizeOptions(Options):
    """How conversations become a corpus (``tokenize``; ``regen --server`` embeds them)."""

    max_length: int | None = opt(
        None, "Longest sample in tokens (see --overflow).", section=TOKENIZE
    )
    overflow: str = opt(
        "truncate", "What --max-length does to a longer conversation.",
        choices=("truncate", "drop"), section=TOKENIZE,
    )  # fmt: skip
    workers: int = opt(1, "Tokenizer processes.", section=TOKENIZE)
    shard_rows: int = opt(100_000, "Rows per output shard.", section=TOKENIZE)
    strict: bool = opt(
        False, "Stop at the first malformed row (default: count and skip it).", section=TOKENIZE
    )
    holdout: int = opt(
        0, "The last N conversations stay out; their prompts go to OUT/heldout.jsonl.",
        section=TOKENIZE,
    )  # fmt: skip
    limit: int | None = opt(None, "Read only the first N rows.", section=TOKENIZE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overflow not in ("truncate", "drop"):
            raise ValueError(f"overflow must be 'truncate' or 'drop', got {self.overflow!r}")
        for name, low in (("max_length", 1), ("workers", 1), ("shard_rows", 1), ("holdout", 0),
                          ("limit", 1)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")


IN_PROCESS = "In process (no --server; SRC is ONE tokenized Arrow corpus, the target runs here)"


@dataclass(frozen=True, kw_only=True)
class RegenOptions(Options):
    """In-process ``regen``: the target rewrites a tokenized corpus's responses."""

    batch_size: int = opt(64, "Samples generated together.", section=IN_PROCESS)
    chunk_samples: int = 4096  # samples read (and sorted by response length) at a time
    holdout: int = opt(
        0, "Samples (--server: conversations) kept out; their prompts go to the verifier."
    )
    limit: int | None = opt(
        None, "Regenerate only the first N samples (after the holdout).", section=IN_PROCESS
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1 or self.chunk_samples < 1 or self.holdout < 0:
            raise ValueError(
                f"need batch_size, chunk_samples >= 1 and holdout >= 0, got "
                f"{self.batch_size}, {self.chunk_samples}, {self.holdout}"
            )
        if self.limit is not None and self.limit < 1:  # an empty corpus helps no one
            raise ValueError(f"limit must be >= 1, got {self.limit}")


#: DFlash2's drafter fields (``DrafterConfig``, the options of the same names) and the
#: reference's defaults (z-lab's DFlash2, vLLM's and speculators' configs).
DFLASH2_DEFAULTS: dict[str, Any] = {
    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
    "output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0,
}  # fmt: skip
