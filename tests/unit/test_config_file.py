"""``train --config FILE``: every option settable from a file made from the one options
source, flags winning, errors naming FILE:LINE and the nearest valid key, ``--print-config``
and a run's ``config.json`` read back to the same options, the examples valid."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainer.cli import main
from trainer.config_file import TABLES, read_config, settable, to_toml
from trainer.sections import RATES, RunOptions

ROOT = Path(__file__).resolve().parents[2]
BASE = 'endpoint = "ipc:///tmp/x.sock"\nrun_dir = "/tmp/run"\n'


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def resolved(*args: str) -> str:
    res = CliRunner().invoke(main, ["train", *args, "--print-config"])
    assert res.exit_code == 0, res.output
    return res.output


def sample(name: str, hint: object, default: object) -> object:
    """A valid value of option ``name`` unlike its default."""
    union = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kind = next(k for k in union if k is not type(None))
    field = {f.name: f for f in dataclasses.fields(RunOptions)}[name]
    if field.metadata.get("choices"):
        return next(c for c in field.metadata["choices"] if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return int(field.metadata.get("at_least") or 0) + 3
    if kind is float:
        return 0.5 if default != 0.5 else 0.25
    if typing.get_origin(kind) is tuple:
        return ["seed=3"]
    return "/tmp/some/path" if kind is Path else "0,1"


def test_every_option_is_settable_in_its_table(tmp_path):
    """Each option, set alone to a value unlike its default in its table, is read back."""
    keys, hints = settable(), typing.get_type_hints(RunOptions)
    assert {"endpoint", "lr", "token_budget", "spec", "log_every_s"} <= set(keys)
    flagged = [f for f in dataclasses.fields(RunOptions) if f.metadata]
    assert len(keys) == len(flagged)  # one key per option
    for f in flagged:
        key = (f.metadata.get("flag") or "--" + f.name).lstrip("-").replace("-", "_")
        table, hint = keys[key]
        value = sample(f.name, hint, f.default)
        text = (f"[{table}]\n" if table else "") + f"{key} = {json.dumps(value)}\n"
        got = read_config(write(tmp_path, text))[f.name]
        want = tuple(value) if isinstance(value, list) else value
        want = Path(want) if Path in (*typing.get_args(hints[f.name]), hints[f.name]) else want
        assert got == want, (key, got, want)
    assert set(TABLES) >= {f.metadata.get("section", "") for f in flagged}


def test_flags_win_over_the_file_and_the_output_reads_back(tmp_path):
    loader = "[loader]\ntoken_budget = 8192\nspec = {seed = 3, buckets = [770, 1216]}\n"
    path = write(tmp_path, BASE + "[optimizer]\nlr = 1e-3\nsteps = 100\n" + loader)
    out = resolved("--config", str(path), "--lr", "5e-4")
    assert "lr = 0.0005\n" in out and "steps = 100\n" in out and "token_budget = 8192\n" in out
    assert 'spec = ["seed=3", "buckets=[770, 1216]"]' in out
    again = write(tmp_path, out, "again.toml")
    assert resolved("--config", str(again)) == out  # --print-config is a file --config reads


def test_an_option_left_unset_says_what_stands_in_for_it(tmp_path):
    """An unset option is a comment naming its help's ``[default: ...]``, and the file, read
    back, still leaves it unset (the optimizer's own rate follows --optimizer)."""
    out = resolved("--config", str(write(tmp_path, BASE)))
    rates = ", ".join(f"{k} {v:g}" for k, v in RATES.items())
    assert f"# lr = (unset: the optimizer's: {rates})\n" in out
    assert "# token_budget = (unset: the daemon's)\n" in out
    assert "# steps = (unset)\n" in out  # no [default: ...] in its help
    assert read_config(write(tmp_path, out, "again.toml")).get("lr") is None


def test_a_run_s_config_json_repeats_the_run(tmp_path):
    run = tmp_path / "run"
    opts = RunOptions(endpoint="ipc:///tmp/x.sock", run_dir=run, steps=7, lr=1e-3,
                      spec_pairs=("seed=3",), grad_accum=2, layout="packed")  # fmt: skip
    config = opts.write({"grad_accum": 2}, world_size=8)
    assert resolved("--config", str(config)) == to_toml(RunOptions.read(run)) == to_toml(opts)


@pytest.mark.parametrize(
    "text, says",
    [
        (BASE + "[optimizer]\nlrr = 1\n", r"run.toml:4: unknown key 'lrr'; did you mean 'lr'"),
        (BASE + "[optimizer]\n\nsteps = 'many'\n", r"run.toml:5: steps: must be int"),
        (BASE + "[loader]\nlr = 1.0\n", r"run.toml:4: lr belongs in \[optimizer\]"),
        (BASE + "token_budget = 3\n", r"run.toml:3: token_budget belongs in \[loader\]"),
        (BASE + "[optimiser]\nlr = 1\n", r"run.toml:3: unknown table \[optimiser\].*\[optimizer\]"),
        (BASE + "[drafter]\nblock_sise = 8\n", r"run.toml:4: .*'block_size'"),
        ("lr = [", r"run.toml: not TOML \(Invalid value"),
        ("a = 1\nb = = 2\n", r"run.toml: not TOML \(.*line 2, column 5"),
        # a value outside a choice or a range: at its line, as the flag would be refused
        (BASE + "[target]\ntarget_shard = 'zero'\n", r"run.toml:4: target_shard must be one of"),
        (BASE + "[optimizer]\nsteps = 0\n", r"run.toml:4: steps must be >= 1, got 0"),
        (BASE + "[drafter]\n\ndpace_alpha = 2.0\n", r"run.toml:5: dpace_alpha must be in \[0, 1\]"),
        (BASE + "[drafter]\nloss_weighting = 'dpac'\n", r"run.toml:4: .*one of decay, dpace"),
        # one option under two spellings, or a flag and its alias
        (
            BASE + "[loader]\ntoken_budget = 4096\ntoken-budget = 8192\n",
            r"run.toml:5: token-budget sets token_budget again \(first as 'token_budget' at "
            r"line 4\)",
        ),
        (
            BASE + "[drafter]\nanchors_per_doc = 4\nnum_anchors = 8\n",
            r"run.toml:5: num_anchors sets anchors_per_doc again",
        ),
        # the names SpecForge's and speculators' configs use
        (
            BASE + "[optimizer]\nlearning_rate = 1e-4\n",
            r"run.toml:4: unknown key 'learning_rate'; other trainers call it that: here it "
            r"is 'lr'",
        ),
        (BASE + "output_dir = '/tmp/o'\n", r"run.toml:3: .*here it is 'run_dir'"),
        (
            BASE + "[optimizer]\nmax_grad_norm = 1.0\n",
            r"here it is 'grad_clip' \(in \[optimizer\]\)",
        ),
    ],
)
def test_a_bad_file_is_one_line_naming_file_line_and_key(tmp_path, text, says):
    path = write(tmp_path, text)
    res = CliRunner().invoke(main, ["train", "--config", str(path), "--print-config"])
    assert res.exit_code == 2
    (line,) = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert re.search(says, line), line


def test_a_bad_config_json_names_its_line(tmp_path):
    path = write(tmp_path, '{"run_dir": "/tmp/r",\n "lr": "x",\n "world_size": 2}', "config.json")
    with pytest.raises(ValueError, match=r"config.json:2: lr: must be float"):
        read_config(path)
    cut = write(tmp_path, '{"run_dir": "/tmp/r",\n "lr": 0.1', "cut.json")
    with pytest.raises(ValueError, match=r"cut.json: not a JSON object of options \(Expecting "
                       r"',' delimiter at line 2 column 11\)"):  # fmt: skip
        read_config(cut)


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name
)
def test_the_examples_are_valid(example, tmp_path):
    opts = RunOptions(**read_config(example))
    assert str(opts.run_dir) and opts.endpoint.startswith("ipc://")
    assert RunOptions(**read_config(write(tmp_path, to_toml(opts)))) == opts
