"""`dflash-train regen` on a tiny corpus written with pyarrow."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import torch
from click.testing import CliRunner

from trainer.cli import main
from trainer.data.regen import load_prompts, split_prompt
from trainer.model.target import load_target
from trainer.model.verifier import greedy_generate


def write_corpus(path, samples) -> None:
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
    table = pa.table(
        {
            "input_ids": pa.array([s[0] for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([s[1] for s in samples], pa.list_(pa.uint8())),
        },
        schema=schema,
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        w.write_table(table)


def read_corpus(path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_file(src).read_all()


def test_regen_rewrites_responses_with_greedy_output(tmp_path):
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(9):
        n, p = int(rng.integers(10, 30)), int(rng.integers(2, 8))
        samples.append((rng.integers(0, 512, n).tolist(), [0] * p + [1] * (n - p)))
    samples[3] = (samples[3][0], [0] * len(samples[3][0]))  # no response: kept as is
    samples[4] = (samples[4][0], [1] * len(samples[4][0]))  # all response: 1-token prompt
    src, out = tmp_path / "in.arrow", tmp_path / "out.arrow"
    write_corpus(src, samples)

    res = CliRunner().invoke(
        main, ["regen", str(src), str(out), "--holdout", "2", "--batch-size", "3", "--no-progress"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["samples"] == 7 and report["holdout"] == 2

    table = read_corpus(out)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.uint8())
    assert table.num_rows == 7
    target = load_target("tiny")
    for i in range(7):
        ids, mask = table["input_ids"][i].as_py(), table["loss_mask"][i].as_py()
        old_ids, old_mask = samples[i]
        assert mask == old_mask and len(ids) == len(old_ids)
        s = split_prompt(np.array(old_mask))
        assert ids[:s] == old_ids[:s]
        if s < len(ids):
            expected = greedy_generate(target, torch.tensor(old_ids[:s]), len(ids) - s)
            assert ids[s:] == expected.tolist(), i
    assert table["input_ids"][3].as_py() == samples[3][0]

    prompts = load_prompts(out.with_suffix(".heldout.jsonl"))
    assert [p.tolist() for p in prompts] == [
        samples[k][0][: split_prompt(np.array(samples[k][1]))] for k in (7, 8)
    ]

    # The loader opens the result as it is.
    from loader_server.data.dataset import open_dataset

    ds = open_dataset(out)
    assert len(ds) == 7 and ds.has_loss_mask

    none = tmp_path / "none.arrow"
    res = CliRunner().invoke(
        main, ["regen", str(src), str(none), "--holdout", "9", "--no-progress"]
    )
    assert res.exit_code == 1 and not none.exists()
    assert (
        f"{src}: --holdout 9 leaves no sample to regenerate: the corpus has 9. Pass --holdout 8 "
        "or less" in res.output
    ), res.output


def test_a_corpus_the_target_cannot_read_leaves_nothing_and_a_rerun_is_not_refused(tmp_path):
    torch.set_num_threads(1)
    samples = [([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1])] * 3 + [([1, 2, 300, 4], [0, 0, 1, 1])]
    src, out = tmp_path / "in.arrow", tmp_path / "out.arrow"
    write_corpus(src, samples)
    args = ["regen", str(src), str(out), "--holdout", "1", "--no-progress"]
    res = CliRunner().invoke(main, [*args, "--tiny-vocab", "256"])  # id 300 is outside it
    assert res.exit_code == 1, res.output
    error = res.output.strip().splitlines()[-1]
    assert error.startswith("Error: ") and str(src) in error and "300" in error, error
    assert not out.exists() and not out.with_suffix(".heldout.jsonl").exists()
    res = CliRunner().invoke(main, args)  # the default tiny target reads id 300
    assert res.exit_code == 0, res.output
    assert out.exists() and len(load_prompts(out.with_suffix(".heldout.jsonl"))) == 1
