"""One source for every option: the commands' flags are made from the options dataclasses,
renamed options keep their old spelling, and outputs are written atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from trainer.cli import main
from trainer.cli.data import tokenize
from trainer.files import atomic_output
from trainer.model.blocks import LossConfig
from trainer.options import TokenizeOptions
from trainer.sections import RunOptions
from trainer.train.checkpoint import CheckpointRecord


def _params(command) -> dict[str, object]:
    return {p.name: p for p in command.params}


def test_every_run_option_is_a_train_flag_with_the_dataclass_default(tmp_path):
    params = _params(main.commands["train"])
    names = {f.name for f in dataclasses.fields(RunOptions)}
    assert names <= set(params)
    defaults = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    for name in names - {"endpoint", "run_dir"}:
        assert params[name].default == defaults[name], name
    assert params["endpoint"].required and params["run_dir"].required


def test_the_anchor_knob_has_the_spec_s_name_and_keeps_its_old_one(tmp_path):
    for flag in ("--anchors-per-doc", "--num-anchors"):
        ctx = main.commands["train"].make_context(
            "train", ["--endpoint", "ipc:///x", "--run-dir", str(tmp_path), flag, "7"]
        )
        assert RunOptions(**ctx.params).anchors_per_doc == 7
    # a config.json written before the rename
    record = RunOptions(endpoint="ipc:///x", run_dir=tmp_path).to_record()
    record["num_anchors"] = record.pop("anchors_per_doc") + 1
    record.update(requested_loader_spec={}, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert RunOptions.read(tmp_path).anchors_per_doc == 513


def test_a_checkpoint_record_written_before_the_rename_reads_under_the_new_name(tmp_path):
    old = {"step": 3, "epoch": 0, "drafter": {"w": torch.zeros(1)}, "drafter_config": {},
           "loss_config": {"block_size": 16, "num_anchors": 512, "max_anchors": 2048,
                           "gamma": 7.0}}  # fmt: skip
    record = CheckpointRecord.from_shared(old, tmp_path / "model.pt")
    # ... and fields newer than it mean what it trained: the old objective and its cap.
    legacy = LossConfig(tokens_per_anchor=1, max_anchors=2048, normalization="micro-batch",
                        anchor_draw="micro-batch", weighting="decay")  # fmt: skip
    assert record.loss_config == dataclasses.asdict(legacy)
    no_step = {k: v for k, v in old.items() if k != "step"}
    with pytest.raises(ValueError, match=r"model\.pt: not a drafter checkpoint \(no step\)"):
        CheckpointRecord.from_shared(no_step, tmp_path / "model.pt")


def test_tokenize_flags_are_the_tokenize_options():
    params = _params(tokenize)
    for f in dataclasses.fields(TokenizeOptions):
        assert f.name in params, f.name
    assert params["workers"].default is None  # tokenize: the CPUs available
    with pytest.raises(ValueError, match="--overflow must be one of truncate, drop, got 'wrap'"):
        TokenizeOptions(overflow="wrap")
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        TokenizeOptions(workers=0)


def test_regen_help_reads_by_mode(tmp_path):
    from click.testing import CliRunner

    text = CliRunner().invoke(main, ["regen", "--help"]).output
    sections = [line for line in text.splitlines() if line and not line.startswith(" ")]
    server = next(i for i, s in enumerate(sections) if s.startswith("Through a server"))
    process = next(i for i, s in enumerate(sections) if s.startswith("In process"))
    target = next(i for i, s in enumerate(sections) if s.startswith("Target"))
    assert server < process < target  # the --tiny-* flags come last, under the target
    assert text.index("--server") < text.index("--batch-size") < text.index("--tiny-vocab")


def test_regen_refuses_the_other_mode_s_flags(tmp_path):
    from click.testing import CliRunner

    src = tmp_path / "c.jsonl"
    src.write_text("{}\n")
    server = ["--server", "http://127.0.0.1:9", "--tokenizer", str(tmp_path)]
    res = CliRunner().invoke(
        main, ["regen", str(src), str(tmp_path / "o"), "--tiny-vocab", "9", *server]
    )
    assert res.exit_code == 1 and "--tiny-vocab: in-process regen only" in res.output
    res = CliRunner().invoke(main, ["regen", str(src), str(tmp_path / "o"), "--workers", "2"])
    assert res.exit_code == 1 and "--workers: need --server URL" in res.output


@pytest.mark.parametrize("folder", [True, False])
def test_atomic_output_leaves_the_old_output_or_the_new_one(tmp_path, folder):
    out = tmp_path / "out"
    with atomic_output(out, folder=folder, force=False) as tmp:
        (tmp / "a" if folder else tmp).write_text("first")
    read = (lambda: (out / "a").read_text()) if folder else out.read_text
    assert read() == "first"
    with (
        pytest.raises(ValueError, match="already exists and is not empty"),
        atomic_output(out, folder=folder, force=False),
    ):
        pass
    with (
        pytest.raises(RuntimeError, match="boom"),
        atomic_output(out, folder=folder, force=True) as tmp,
    ):
        (tmp / "a" if folder else tmp).write_text("second")
        raise RuntimeError("boom")
    assert read() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_output(out, folder=folder, force=True) as tmp:
        (tmp / "a" if folder else tmp).write_text("second")
    assert read() == "second" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("folder", [True, False])
def test_force_replaces_an_output_of_the_other_kind(tmp_path, folder):
    out = tmp_path / "out"
    if folder:
        out.write_text("a file where the folder goes")
    else:
        (out / "sub").mkdir(parents=True)
    with atomic_output(out, folder=folder, force=True) as tmp:
        (tmp / "a" if folder else tmp).write_text("new")
    assert (out / "a" if folder else out).read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    link = tmp_path / "link"  # a symlink is replaced itself, its target left alone
    link.symlink_to(out)
    with atomic_output(link, folder=True, force=True) as tmp:
        (tmp / "b").write_text("via link")
    assert not link.is_symlink() and (link / "b").read_text() == "via link"
    assert (out / "a" if folder else out).read_text() == "new"


def test_paths_in_options_round_trip(tmp_path):
    opts = RunOptions(endpoint="e", run_dir=tmp_path, cost_profile=tmp_path / "p.json")
    assert RunOptions.from_record(opts.to_record(), "x") == opts
    assert isinstance(RunOptions.from_record(opts.to_record(), "x").cost_profile, Path)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_atomic_output_gives_what_the_umask_gives(tmp_path, mask):
    """Writers that create private files (safetensors: 0600, mkstemp) do not decide who can
    read an output: the folder and its files get the modes plain open/mkdir would."""
    old = os.umask(mask)
    try:
        with atomic_output(tmp_path / "out", folder=True, force=False) as tmp:
            fd, _ = tempfile.mkstemp(dir=tmp, prefix="private")  # 0600 whatever the umask
            os.close(fd)
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "tool.sh").write_text("#!/bin/sh\n")
            os.chmod(tmp / "sub" / "tool.sh", 0o700)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
    private = next(k for k in modes if k.startswith("private"))
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert modes == {private: 0o666 & ~mask, "sub": 0o777 & ~mask, "sub/tool.sh": 0o777 & ~mask}


def test_cuda_without_an_index_is_the_local_ranks_gpu():
    import torch

    from trainer.train.distributed import pick_device

    # torch.cuda.set_device refuses a cuda device with no index: `--device cuda` must name one
    assert pick_device("cuda", 3, cuda=True) == torch.device("cuda", 3)
    assert pick_device("cuda:1", 3, cuda=True) == torch.device("cuda", 1)
    assert pick_device(None, 2, cuda=True) == torch.device("cuda", 2)
    assert pick_device(None, 2, cuda=False) == torch.device("cpu")
    assert pick_device("cpu", 2, cuda=True) == torch.device("cpu")


def test_regen_limit_zero_is_refused_not_an_empty_corpus(tmp_path):
    from click.testing import CliRunner

    from loader_server.data.synth import SynthSpec, write_corpus

    src = tmp_path / "c.arrow"
    write_corpus(src, SynthSpec(num_samples=4, median_len=20, max_len=40, vocab_size=500))
    res = CliRunner().invoke(main, ["regen", str(src), str(tmp_path / "o.arrow"), "--limit", "0"])
    assert res.exit_code == 1 and "limit must be >= 1, got 0" in res.output, res.output
    assert not (tmp_path / "o.arrow").exists()


def test_a_weighting_s_unused_option_is_named(caplog, tmp_path):
    """D-PACE is the default: --gamma alone says it has no effect and how to use it;
    --dpace-alpha under the decay likewise, and --init-std with --init-drafter; the
    defaults say nothing."""
    from trainer.run import check_run

    def said(**kw) -> str:
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainer.run"):
            check_run(RunOptions(endpoint="x", run_dir=tmp_path, block_size=16, steps=1, **kw))
        return caplog.text

    assert RunOptions.loss_weighting == LossConfig().weighting == "dpace"
    assert "no effect" not in said()
    assert "--gamma 3 has no effect" in said(gamma=3.0)
    assert "--loss-weighting decay uses it" in said(gamma=3.0)
    assert "no effect" not in said(gamma=3.0, loss_weighting="decay")
    assert "--dpace-alpha 0.3 has no effect" in said(dpace_alpha=0.3, loss_weighting="decay")
    assert "--init-std 0 has no effect with --init-drafter" in said(
        init_std=0.0, init_drafter=tmp_path
    )
    assert "no effect" not in said(init_std=0.0)
