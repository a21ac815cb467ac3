"""Fault points named once (``loader_server.faults``): a malformed or unknown
``DFLASH_FAULT`` is refused as the daemon and the trainer start, naming the variable and
the known points, so a fault-matrix reproduction cannot pass without its fault."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from loader_server import faults
from loader_server.cli.main import main as loader_cli
from trainer.cli import main as train_cli


@pytest.mark.parametrize(
    "spec", ["step=3", "plan=0@1", "checkpoint.write=2@0,checkpoint.publish=2", "step", " step=1 "]
)
def test_well_formed_items_pass(spec):
    faults.check({faults.ENV: spec})
    faults.check({})  # unset


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("stpe=3", "'stpe=3' names no fault point"),
        ("step=three", "needs an integer N after '='"),
        ("plan=1@one", "needs a rank"),
        ("checkpoint=2", "names no fault point"),
        ("step=1,,", "'' names no fault point"),
        ("step=1@-1", "needs a rank"),
    ],
)
def test_malformed_or_unknown_items_are_refused_naming_the_points(spec, why):
    with pytest.raises(ValueError, match="DFLASH_FAULT=") as e:
        faults.check({faults.ENV: spec})
    assert why in str(e.value)
    assert "plan=EPOCH, step=N, checkpoint.write=N, checkpoint.publish=N" in str(e.value)


@pytest.mark.parametrize("command", ["train", "serve"])
def test_both_processes_refuse_it_as_they_start(command, monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "stpe=3")
    if command == "train":
        result = CliRunner().invoke(train_cli, ["train", "--endpoint", "ipc:///x", "--steps",
                                                "1", "--run-dir", str(tmp_path)])  # fmt: skip
    else:
        result = CliRunner().invoke(loader_cli, ["serve", "--dataset", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "DFLASH_FAULT='stpe=3'" in result.output and "names no fault point" in result.output
