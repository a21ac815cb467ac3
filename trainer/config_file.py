"""``dflash-train train --config FILE``: a run's options in a TOML file (or a previous run's
``config.json``), flags on the command line winning over it; ``--print-config`` writes the
resolved options back as TOML.

Made from the one options source (``trainer.options.RunOptions``): a key is an option's
flag without its dashes, ``-`` written ``_`` or kept (``token_budget``, ``token-budget``),
in the table of its ``--help`` section (``TABLES``; the run's own options, such as
``endpoint`` and ``run_dir``, at the top). A new option is a new key with nothing else to
keep. ``--spec KEY=VALUE`` is ``spec`` in ``[loader]``: a table of JSON values, or the list
of ``KEY=VALUE`` strings. Refused, naming ``FILE:LINE``: an unknown table, an unknown key
(with the nearest valid name, and its table when it is elsewhere), a value of the wrong
type. A ``config.json`` (flat, as a run writes it) is read by the same rules, its run facts
(``world_size``...) skipped.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from dataclasses import Field, fields
from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from loader_server.wire.files import file_error
from trainer.option_values import field_value, option_problem
from trainer.options import DRAFTER, EVAL, OPTIM, RUN_FACTS, SPEC, TARGET, flag_of
from trainer.sections import RunOptions

#: ``--help`` section -> TOML table ("" and None: the top, the run's own options).
TABLES: dict[str, str | None] = {
    "": None, TARGET: "target", DRAFTER: "drafter", OPTIM: "optimizer", SPEC: "loader",
    EVAL: "evaluation",
}  # fmt: skip


def _key(f: Field[Any]) -> str:
    """The field's key: its flag without dashes (``--spec`` -> ``spec``)."""
    return flag_of(f).lstrip("-").replace("-", "_")


@cache
def _fields() -> dict[str, Field[Any]]:
    """Key -> field, for every option with a flag (aliases and renamed keys included)."""
    out: dict[str, Field[Any]] = {}
    for f in fields(RunOptions):
        if not f.metadata:
            continue
        out[_key(f)] = out[f.name] = f
        for alias in f.metadata.get("aliases", ()):
            out[alias.lstrip("-").replace("-", "_")] = f
        for old in f.metadata.get("was", ()):
            out.setdefault(old, f)
    return out


def _table(f: Field[Any]) -> str | None:
    section = f.metadata.get("section", "")
    if section not in TABLES:
        raise KeyError(f"option {f.name}: section {section!r} has no table in TABLES")
    return TABLES[section]


Item = tuple[str | None, str, Any]  # (table, key as written, value)


def read_config(path: Path) -> dict[str, Any]:
    """Option name -> value from ``path`` (TOML, or JSON for a ``config.json``); a value
    left null in JSON is not set. ValueError names ``FILE:LINE`` and the key."""
    text = path.read_text()
    if path.suffix == ".json":
        return _values(path, text, _json_items(path, text), flat=True)
    return _values(path, text, _toml_items(path, text), flat=False)


def _json_items(path: Path, text: str) -> list[Item]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise file_error(path, "a JSON object of options", e) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of options")
    return [(None, k, v) for k, v in data.items() if k not in RUN_FACTS and v is not None]


def _toml_items(path: Path, text: str) -> list[Item]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise file_error(path, "TOML", e) from None
    items: list[Item] = []
    tables = {t for t in TABLES.values() if t}
    for key, value in data.items():
        if isinstance(value, dict) and key in tables:
            items += [(key, k, v) for k, v in value.items()]
        elif isinstance(value, dict) and key not in _fields():
            near = difflib.get_close_matches(key, sorted(tables), 1)
            hint = f"; did you mean [{near[0]}]?" if near else ""
            raise ValueError(
                f"{path}:{_line(text, None, key, header=True)}: unknown table [{key}] "
                f"(tables: {', '.join(f'[{t}]' for t in sorted(tables))}){hint}"
            )
        else:
            items.append((None, key, value))
    return items


def _values(path: Path, text: str, items: list[Item], flat: bool) -> dict[str, Any]:
    known, out = _fields(), {}
    first: dict[str, str] = {}
    for table, raw_key, value in items:
        key = raw_key.replace("-", "_")
        where = f"{path}:{_line(text, table, raw_key, json_file=flat)}"
        f = known.get(key)
        if f is None:
            raise ValueError(f"{where}: unknown key {raw_key!r}{_nearest(key, known)}")
        if f.name in first:  # two spellings of one option (token_budget, token-budget)
            raise ValueError(f"{where}: {raw_key} sets {f.name} again (first as {first[f.name]})")
        first[f.name] = f"{raw_key!r} at line {where.rsplit(':', 1)[1]}"
        home = _table(f)
        if not flat and home != table:
            there = f"[{home}]" if home else "the top of the file (before any table)"
            raise ValueError(f"{where}: {raw_key} belongs in {there}")
        if f.name == "spec_pairs" and isinstance(value, dict):
            value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
        try:
            out[f.name] = field_value(RunOptions, f.name, value)
        except ValueError as e:
            raise ValueError(f"{where}: {raw_key}: {e}") from None
        why = option_problem(f.metadata, out[f.name])
        if why:  # what the flag's own checks would say, said here at the file's line
            raise ValueError(f"{where}: {raw_key} {why}")
    return out


#: Keys other trainers' configs (SpecForge's YAML, speculators' flags) use for our options.
OTHER_NAMES = {
    "learning_rate": "lr", "num_epochs": "epochs", "max_steps": "steps",
    "total_steps": "steps", "warmup_ratio": "warmup", "warmup_steps": "warmup",
    "scheduler_warmup_ratio": "warmup", "scheduler_warmup_steps": "warmup",
    "max_grad_norm": "grad_clip", "gradient_accumulation_steps": "grad_accum",
    "accumulation_steps": "grad_accum", "max_length": "max_seq_len",
    "max_seq_length": "max_seq_len", "total_seq_len": "token_budget",
    "output_dir": "run_dir", "save_path": "run_dir", "target_model_path": "target",
    "verifier_name_or_path": "target", "target_layer_ids": "layers",
    "num_layers": "drafter_layers", "loss_decay_gamma": "gamma",
    "dflash_decay_gamma": "gamma", "per_position_loss_weight": "loss_weighting",
    "save_interval": "ckpt_every", "checkpoint_freq": "ckpt_every",
    "eval_interval": "eval_every", "from_pretrained": "init_drafter", "logger": "report_to",
}  # fmt: skip


def _nearest(key: str, known: dict[str, Field[Any]]) -> str:
    ours = OTHER_NAMES.get(key)
    if ours is not None:
        table = _table(known[ours])
        where = f" (in [{table}])" if table else ""
        return f"; other trainers call it that: here it is {ours!r}{where}"
    near = difflib.get_close_matches(key, sorted(known), 1, cutoff=0.6)
    if not near:
        return ""
    table = _table(known[near[0]])
    return f"; did you mean {near[0]!r}" + (f" (in [{table}])?" if table else "?")


def _line(
    text: str, table: str | None, key: str, *, header: bool = False, json_file: bool = False
) -> int:
    """The 1-based line of ``key`` in ``[table]`` (``header``: of the table ``[key]``; in a
    JSON file: of ``"key":``), or 1 when it is not found."""
    current: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if json_file:
            if re.match(rf'"{re.escape(key)}"\s*:', stripped):
                return n
            continue
        m = re.match(r"\[\s*([^\]]+?)\s*\]", stripped)
        if m:
            current = m.group(1).strip("\"'")
            if header and current == key:
                return n
            continue
        m = re.match(r"""(["']?)([\w-]+)\1\s*=""", stripped)
        if m and m.group(2) == key and current == table and not header:
            return n
    return 1


def to_toml(opts: RunOptions) -> str:
    """The options as a TOML file ``--config`` reads back to the same options; options left
    unset (None) are comments saying so, and what stands in for them where the help says
    (its ``[default: ...]``)."""
    by_table: dict[str | None, list[str]] = {t: [] for t in TABLES.values()}
    for f in fields(opts):
        if not f.metadata:
            continue
        value = getattr(opts, f.name)
        key = _key(f)
        line = f"# {key} = {_unset(f)}" if value is None else f"{key} = {_toml_value(value)}"
        by_table[_table(f)].append(line)
    parts = ["# dflash-train train --config FILE (flags given on the command line win)"]
    parts += by_table.pop(None)
    for table, lines in by_table.items():
        parts += ["", f"[{table}]", *lines]
    return "\n".join(parts) + "\n"


def _unset(f: Field[Any]) -> str:
    """``(unset)``, with the help's ``[default: ...]`` when it has one."""
    m = re.search(r"\[default: (.*)\]", f.metadata.get("help", ""))
    return f"(unset: {m.group(1)})" if m else "(unset)"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def settable() -> dict[str, tuple[str | None, Any]]:
    """Key -> (table, field type) of every option a file may set (for tests and docs)."""
    hints = typing.get_type_hints(RunOptions)
    return {_key(f): (_table(f), hints[f.name]) for f in fields(RunOptions) if f.metadata}
