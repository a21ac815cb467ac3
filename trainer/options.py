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
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from loader_server.wire.spec import SPEC_FIELDS, field_help
from trainer.option_values import (
    from_json,
    has_type,
    option_problem,
    to_json,
    type_name,
)

if TYPE_CHECKING:
    from dataclasses import Field

CONFIG_FILE = "config.json"
#: What ``config.json`` records about the run besides its options.
RUN_FACTS = ("requested_loader_spec", "world_size")
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
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    before: Any = MISSING,
    was: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """An option: a dataclass field with everything about it, beside it.

    Its flag: ``help``; ``aliases`` (older spellings still accepted); ``choices``; ``path``
    (``click.Path`` checks such as ``{"exists": True, "file_okay": False}``); ``flag`` when
    it is not ``--field-name`` (the config-file key is the flag's name); ``section``: the
    group of flags (and the config-file table) it is listed under; ``parse``: how the
    flag's one string becomes the field's value (a comma-separated list as a tuple;
    ValueError says what is wrong). Its bounds, checked
    wherever a value comes from (flags, config files, ``config.json``): ``at_least``,
    ``above`` (strictly), ``at_most``. How an older run's ``config.json`` reads it:
    ``before``, the value runs written before the option existed had; ``was``, the keys it
    was written under before a rename."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "path": path, "flag": flag,
            "show_default": show_default, "section": section, "at_least": at_least,
            "above": above, "at_most": at_most, "before": before, "was": was,
            "parse": parse}  # fmt: skip
    return field(default=default, metadata=meta)


def flag_of(f: Field[Any]) -> str:
    """The option's flag (``--field-name`` unless it names another)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def renamed(cls: type) -> dict[str, str]:
    """Old key -> option name, for the options of ``cls`` renamed since (both are read)."""
    return {old: f.name for f in fields(cls) for old in f.metadata.get("was", ())}


def added_later(cls: type) -> dict[str, Any]:
    """Option name -> the value runs written before it existed had, for ``cls``'s options."""
    return {
        f.name: f.metadata["before"]
        for f in fields(cls)
        if f.metadata.get("before", MISSING) is not MISSING
    }


class Options:
    """Typed, validated, JSON-ready options (the base of every options dataclass here)."""

    # Every subclass is a dataclass, so ``fields(cls)`` holds. Declared for the type checker
    # only: at run time the annotation would be one of the hints ``__post_init__`` checks.
    if TYPE_CHECKING:
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    def __post_init__(self) -> None:
        """Every option's type, then its bounds (errors name the flag)."""
        for name, hint in typing.get_type_hints(type(self)).items():
            value = getattr(self, name)
            if not has_type(value, hint):
                raise ValueError(f"option {name} must be {type_name(hint)}, got {value!r}")
        for f in fields(self):
            why = option_problem(f.metadata, getattr(self, f.name))
            if why:
                raise ValueError(f"{flag_of(f)} {why}")

    @classmethod
    def pick(cls: type[_Options], kwargs: Mapping[str, Any]) -> _Options:
        """These options out of a command's keyword arguments (which may hold others)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls) if f.name in kwargs})

    @classmethod
    def from_record(cls: type[_Options], record: Mapping[str, Any], source: str) -> _Options:
        """These options out of a JSON record (a run's ``config.json``, which may hold
        others); ``source`` names the record in errors. Renamed keys are read under either
        name."""
        old = renamed(cls)
        record = {old.get(k, k): v for k, v in record.items()}
        names, before = [f.name for f in fields(cls)], added_later(cls)
        missing = [k for k in names if k not in record and k not in before]
        if missing:
            raise ValueError(f"{source}: missing option(s) {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        values = {k: from_json(record[k], hints[k]) for k in names if k in record}
        try:
            return cls(**{**before, **values})
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict: paths as strings, tuples as lists."""
        return {f.name: to_json(getattr(self, f.name)) for f in fields(self)}


TARGET = "Target (tiny: a seeded random Qwen3)"
#: ``--target``'s value for the seeded random Qwen3 (``trainer.model.target``).
TINY = "tiny"


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
    tiny_heads: int = opt(4, "Attention heads of the tiny target.", section=TARGET, before=4)
    tiny_kv_heads: int = opt(2, "KV heads of the tiny target.", section=TARGET, before=2)
    tiny_intermediate: int | None = opt(None, "MLP width of the tiny target [3 x hidden].",
                                        section=TARGET,
        before=None,
    )  # fmt: skip

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
        None, "Longest sample in tokens (see --overflow).", section=TOKENIZE, at_least=1
    )
    overflow: str = opt(
        "truncate", "What --max-length does to a longer conversation.",
        choices=("truncate", "drop"), section=TOKENIZE,
    )  # fmt: skip
    workers: int = opt(1, "Tokenizer processes.", section=TOKENIZE, at_least=1)
    shard_rows: int = opt(100_000, "Rows per output shard.", section=TOKENIZE, at_least=1)
    strict: bool = opt(
        False, "Stop at the first malformed row (default: count and skip it).", section=TOKENIZE
    )
    holdout: int = opt(
        0, "The last N conversations stay out; their prompts go to OUT/heldout.jsonl.",
        section=TOKENIZE, at_least=0,
    )  # fmt: skip
    limit: int | None = opt(None, "Read only the first N rows.", section=TOKENIZE, at_least=1)


IN_PROCESS = "In process (no --server; SRC is ONE tokenized Arrow corpus, the target runs here)"


@dataclass(frozen=True, kw_only=True)
class RegenOptions(Options):
    """In-process ``regen``: the target rewrites a tokenized corpus's responses."""

    batch_size: int = opt(64, "Samples generated together.", section=IN_PROCESS, at_least=1)
    chunk_samples: int = 4096  # samples read (and sorted by response length) at a time
    holdout: int = opt(
        0, "Samples (--server: conversations) kept out; their prompts go to the verifier.",
        at_least=0,
    )  # fmt: skip
    limit: int | None = opt(  # at least 1: an empty corpus helps no one
        None, "Regenerate only the first N samples (after the holdout).", section=IN_PROCESS,
        at_least=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_samples < 1:
            raise ValueError(f"chunk_samples must be >= 1, got {self.chunk_samples}")


#: DFlash2's drafter fields (``DrafterConfig``, the options of the same names) and the
#: reference's defaults (z-lab's DFlash2, vLLM's and speculators' configs).
DFLASH2_DEFAULTS: dict[str, Any] = {
    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
    "output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0,
}  # fmt: skip
