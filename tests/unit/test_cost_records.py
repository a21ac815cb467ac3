"""The micro-batch timing records: what calibration accepts of a run a crash interrupted."""

from __future__ import annotations

import json

import pytest

from trainer.ops.calibrate import load_samples
from trainer.train.cost_records import make_record, rank_file


def write_records(run_dir, n: int, tail: str = "") -> None:
    path = rank_file(run_dir, 0)
    path.parent.mkdir(parents=True)
    lines = [
        make_record(rank=0, position=(0, s, 0), layout="padded", doc_lengths=[40 + 7 * s, 30],
                    rule=[8, 4, 64], anchors=8, synced=False, time_s=0.01 + 0.001 * s)
        for s in range(n)
    ]  # fmt: skip
    path.write_text("".join(lines) + tail)


def test_a_torn_last_line_is_skipped(tmp_path):
    write_records(tmp_path, 12, tail='{"rank": 0, "epoch": 0, "st')
    samples = load_samples(tmp_path)
    assert samples.x.shape == (12, 5) and samples.rule == (8, 4, 1, 64)  # a 3-value rule: old


def test_a_malformed_line_before_the_end_is_an_error_naming_it(tmp_path):
    write_records(tmp_path, 12, tail='{"rank": 0}\n')
    with pytest.raises(ValueError, match=r"rank0\.jsonl:13: not a micro-batch timing record"):
        load_samples(tmp_path)


def test_the_packed_rows_kernel_goes_from_the_records_into_the_features_and_profile(tmp_path):
    from trainer.ops.calibrate import calibrate_run

    path = rank_file(tmp_path, 0)
    path.parent.mkdir(parents=True)
    lines = [
        make_record(rank=0, position=(0, s, 0), layout="packed", doc_lengths=[40 + 7 * s, 30],
                    rule=[8, 4, 1, 0], anchors=8, synced=False, time_s=0.01 + 0.001 * s,
                    attention="row")
        for s in range(12)
    ]  # fmt: skip
    path.write_text("".join(lines))
    samples = load_samples(tmp_path)
    assert samples.packed_attention == "row"
    assert samples.x[0, 2] == (40 + 30) ** 2  # the row's length squared, not 40^2 + 30^2
    report = calibrate_run(tmp_path, plot=False)
    assert json.loads(report.profile.read_text())["packed_attention"] == "row"
    other = make_record(rank=1, position=(0, 0, 0), layout="packed", doc_lengths=[50],
                        rule=[8, 4, 1, 0], anchors=8, synced=False, time_s=0.02)  # fmt: skip
    rank_file(tmp_path, 1).write_text(other)  # another rank under the other kernel
    with pytest.raises(
        ValueError, match=r"mix packed-row attention kernels row .*rank0.*documents"
    ):
        load_samples(tmp_path)
