"""An option in one place (``trainer.options.opt``): its default, help, flag and config-file
key, choices, bounds, and how an older run's ``config.json`` reads it all sit beside its
field, and every way a value arrives (flags, a config file, ``config.json``) follows them."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from trainer.cli.flags import options_from
from trainer.config_file import read_config
from trainer.options import OPTIM, opt
from trainer.sections import RunOptions

#: The options every run's ``config.json`` has recorded since they all had one. An option
#: added since declares ``before=`` (what those runs had), so ``--resume``, export and the
#: experiment's analysis still read them: adding an option here instead is a decision that
#: older runs can no longer be read.
ALWAYS_RECORDED = {
    "endpoint", "job", "run_dir", "resume", "device", "timeout_s", "collective_timeout_s",
    "target", "tiny_vocab", "tiny_layers", "tiny_hidden", "tiny_seed", "layers",
    "drafter_layers", "block_size", "layer_types", "sliding_window", "sliding_bidirectional",
    "drafter", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
    "output_multiplier", "final_logit_softcapping", "input_embedding_scale", "init_drafter",
    "mask_token_id", "learned_mask", "attention", "anchors_per_doc", "max_anchors", "gamma",
    "selector_alpha", "loss_chunk", "lr", "warmup", "weight_decay", "grad_clip", "steps",
    "epochs", "seed", "grad_accum", "token_budget", "max_batch_size", "max_seq_len", "layout",
    "spec_pairs", "cost_profile", "eval_every", "eval_prompts", "num_eval_prompts",
    "eval_new_tokens", "ckpt_every", "keep_checkpoints", "no_progress", "cost_samples",
    "profile_step", "peak_tflops",
}  # fmt: skip


def test_an_option_added_since_says_what_older_runs_had():
    later = {f.name for f in fields(RunOptions) if f.metadata["before"] is not MISSING}
    assert {f.name for f in fields(RunOptions)} - later == ALWAYS_RECORDED
    for f in fields(RunOptions):  # the value older runs had is one the option takes
        if f.name in later:
            RunOptions(endpoint="ipc:///x", run_dir=Path("r"), **{f.name: f.metadata["before"]})


@dataclass(frozen=True, kw_only=True)
class WithKnob(RunOptions):
    """A newcomer's option: one field, nothing else anywhere."""

    knob_rate: float = opt(
        0.25, "A rate of the newcomer's.", section=OPTIM, above=0, at_most=1, before=0.5,
        was=("old_knob",),
    )  # fmt: skip


def _command(cls: type) -> click.Command:
    @click.command()
    @options_from(cls)
    def train(**kw: object) -> None:
        click.echo(json.dumps({"knob_rate": cls.pick(kw).knob_rate}))

    return train


def test_a_new_option_is_one_field():
    """Its flag, help, default and bounds on the command line; its bounds when built from
    any source; older runs' ``config.json`` read with ``before``, its old key with ``was``."""
    run = CliRunner().invoke
    base = ["--endpoint", "ipc:///x", "--run-dir", "r"]
    cmd = _command(WithKnob)
    res = run(cmd, [*base, "--knob-rate", "0.75"])
    assert res.exit_code == 0 and json.loads(res.output) == {"knob_rate": 0.75}, res.output
    assert json.loads(run(cmd, base).output) == {"knob_rate": 0.25}
    res = run(cmd, [*base, "--knob-rate", "0"])
    assert res.exit_code != 0 and "--knob-rate must be > 0, got 0" in str(res.exception)
    helped = run(cmd, ["--help"]).output
    assert "--knob-rate" in helped and "A rate of the newcomer's." in helped
    with pytest.raises(ValueError, match=r"--knob-rate must be <= 1, got 2.0"):
        WithKnob(endpoint="ipc:///x", run_dir=Path("r"), knob_rate=2.0)
    record = RunOptions(endpoint="ipc:///x", run_dir=Path("r")).to_record()
    assert WithKnob.from_record(record, "old run").knob_rate == 0.5  # before it existed
    renamed = WithKnob.from_record({**record, "old_knob": 0.125}, "renamed")
    assert renamed.knob_rate == 0.125


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("lr = 0", r"run.toml:\d+: lr must be > 0, got 0"),
        ("dpace_alpha = 1.5", r"run.toml:\d+: dpace_alpha must be in \[0, 1\], got 1.5"),
        ("anchors_per_doc = 0", r"run.toml:\d+: anchors_per_doc must be >= 1, got 0"),
    ],
)
def test_a_config_file_is_held_to_the_field_s_bounds(tmp_path, line, message):
    table = {"lr": "optimizer", "dpace_alpha": "drafter", "anchors_per_doc": "drafter"}
    key = line.split(" ")[0]
    path = tmp_path / "run.toml"
    path.write_text(f'endpoint = "ipc:///x"\nrun_dir = "r"\n[{table[key]}]\n{line}\n')
    with pytest.raises(ValueError, match=message):
        read_config(path)


def test_a_renamed_key_is_read_from_config_files_and_config_json(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('endpoint = "ipc:///x"\nrun_dir = "r"\n[drafter]\nnum_anchors = 7\n')
    assert read_config(path)["anchors_per_doc"] == 7
    record = RunOptions(endpoint="ipc:///x", run_dir=tmp_path).to_record()
    record["num_anchors"] = record.pop("anchors_per_doc")
    record.update(requested_loader_spec=None, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert RunOptions.read(tmp_path).anchors_per_doc == record["num_anchors"]


def test_the_states_buffer_is_read_under_its_old_name(tmp_path):
    """``--states-buffer-mb`` was ``states_shm_mb`` for a while: runs of then still read."""
    record = RunOptions(endpoint="ipc:///x", run_dir=tmp_path).to_record()
    record["states_shm_mb"] = record.pop("states_buffer_mb") // 2
    record.update(requested_loader_spec=None, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert RunOptions.read(tmp_path).states_buffer_mb == record["states_shm_mb"]
