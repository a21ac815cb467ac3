"""`dflash-loader buckets` and `plan` on a small corpus; the shared spec flags."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from loader_server.cli.main import main
from loader_server.cli.spec_flags import spec_from_options, spec_options
from loader_server.data.synth import SynthSpec, synth_lengths, write_corpus
from loader_server.planning.planner import plan_epoch
from loader_server.wire.spec import BatchSpec

SYNTH = SynthSpec(num_samples=3000, seed=2, median_len=300, max_len=3000)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "corpus.arrow"
    write_corpus(path, SYNTH)
    return path


def cli(*args: str, ok: bool = True):
    result = CliRunner().invoke(main, list(args))
    assert (result.exit_code == 0) == ok, result.output
    return result


def test_buckets_json_curve(corpus):
    info = json.loads(cli("buckets", str(corpus), "--max-buckets", "6", "--json").output)
    assert info["samples"] == 3000 and len(info["curve"]) == 6
    eff = [row["efficiency"] for row in info["curve"]]
    assert eff == sorted(eff) and 0 < eff[0] < eff[-1] <= 1
    assert all(len(row["bounds"]) <= row["k"] for row in info["curve"])
    assert 0 < info["reference_6_buckets"] < 1
    assert info["auto"]["efficiency"] >= 0.97


def test_buckets_text_and_plot(corpus, tmp_path):
    pytest.importorskip("matplotlib")
    out = cli("buckets", str(corpus), "--max-buckets", "4", "--plot", str(tmp_path / "b.png"))
    assert "reference 6 buckets" in out.output and "auto (target 0.97)" in out.output
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_json_matches_the_library(corpus):
    args = ["--world-size", "4", "--grad-accum", "2", "--buckets", "auto:6", "--seed", "3"]
    info = json.loads(cli("plan", str(corpus), "--epoch", "2", "--json", *args).output)
    spec = BatchSpec(world_size=4, grad_accum=2, buckets="auto:6", seed=3)
    want = plan_epoch(synth_lengths(SYNTH), spec, epoch=2)
    assert info["spec"] == spec.to_dict() and info["spec_key"] == spec.key()
    assert info["num_steps"] == want.num_steps and info["stats"]["served"] == want.stats["served"]
    assert info["padding_efficiency"] == pytest.approx(want.stats["padding_efficiency"])
    assert 0 <= info["composition_repeat"] <= 1 and info["rank_imbalance"] >= 1


def test_plan_dump_is_the_whole_plan(corpus, tmp_path):
    dump = tmp_path / "plan.arrow"
    cli("plan", str(corpus), "--world-size", "2", "--grad-accum", "3", "--epoch", "1",
        "--dump", str(dump))  # fmt: skip
    table = pa.ipc.open_file(pa.memory_map(str(dump))).read_all()
    assert table.column_names[:5] == ["epoch", "step", "rank", "micro", "sample_id"]
    want = plan_epoch(synth_lengths(SYNTH), BatchSpec(world_size=2, grad_accum=3), epoch=1)
    col = {name: table.column(name).to_numpy() for name in table.column_names}
    np.testing.assert_array_equal(col["sample_id"], want.sample_ids)
    assert (col["epoch"] == 1).all()
    step, rank, micro = col["step"][-1], col["rank"][-1], col["micro"][-1]
    assert (step, rank, micro) == (want.num_steps - 1, 1, 2)
    last = (col["step"] == step) & (col["rank"] == rank) & (col["micro"] == micro)
    np.testing.assert_array_equal(col["sample_id"][last], want.micro(step, rank, micro))


def test_plan_compare_table_and_plot(corpus, tmp_path):
    pytest.importorskip("matplotlib")
    out = cli("plan", str(corpus), "--world-size", "8", "--compare", "--plot",
              str(tmp_path / "p.png")).output  # fmt: skip
    for name in ("this spec", "sorted (original)", "random", "reference 6 buckets"):
        assert name in out
    assert "padding efficiency" in out and (tmp_path / "p.png").exists()


def test_packed_plan(corpus):
    info = json.loads(cli("plan", str(corpus), "--layout", "packed", "--json").output)
    assert info["padding_efficiency"] > 0.95 and info["stats"]["num_buckets"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--token-budget", "1000"], "token_budget 1000"),
        (["--buckets", "9000,100"], "strictly increasing"),
        (["--buckets", "auto:99"], "auto:99"),
        (["--layout", "packed", "--composition", "sorted"], "sorted"),
    ],
)
def test_bad_specs_are_one_line_errors(corpus, args, message):
    out = cli("plan", str(corpus), *args, ok=False).output
    assert message in out and "Traceback" not in out


def test_spec_options_are_reusable():
    seen = {}

    @click.command()
    @spec_options
    @click.option("--other", default=1)
    def cmd(**kwargs):
        seen["spec"] = spec_from_options(**kwargs)

    result = CliRunner().invoke(cmd, ["--world-size", "8", "--buckets", "770,1216", "--other", "2"])
    assert result.exit_code == 0, result.output
    assert seen["spec"] == BatchSpec(world_size=8, buckets=(770, 1216))
    CliRunner().invoke(cmd, [])
    assert seen["spec"] == BatchSpec()


def test_console_script_lists_the_commands():
    out = subprocess.run(
        [sys.executable, "-m", "loader_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "buckets" in out and "plan" in out
