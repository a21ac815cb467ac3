"""The trainer's typed contracts: the one ``Batch`` type, the ``BatchSource`` protocol,
``RunOptions`` through ``config.json``, and the named step sums through the all-reduce
tensor."""

from __future__ import annotations

import json
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from client import Batch as ClientBatch
from client import LoaderClient
from client.batch import TENSOR_FIELDS
from trainer.cli import main
from trainer.model.loss import LossOutput
from trainer.options import RUN_FACTS, TargetOptions
from trainer.sections import RunOptions
from trainer.train.batches import Batch, BatchSource, ListSource, pack_batch, pad_batch
from trainer.train.step import StepPeaks, StepSums

SAMPLES = [([1, 2, 3, 4], [0, 1, 1, 1]), ([5, 6], [1, 1]), ([7, 8, 9], [0, 0, 1])]


def declared_tensor_fields() -> set[str]:
    """``Batch`` fields whose annotation is a tensor (optional or not)."""
    hints = typing.get_type_hints(Batch)
    return {
        f.name
        for f in fields(Batch)
        if hints[f.name] is torch.Tensor or torch.Tensor in typing.get_args(hints[f.name])
    }


# ---- Batch -------------------------------------------------------------------------------


def test_the_trainer_and_the_client_share_one_batch_type():
    assert Batch is ClientBatch


def test_a_packed_batch_holds_every_tensor_field():
    batch = pack_batch(SAMPLES)
    present = {f.name for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}
    assert present == declared_tensor_fields() == set(TENSOR_FIELDS)


@pytest.mark.parametrize("make", [pad_batch, pack_batch])
def test_to_moves_every_tensor_field_and_keeps_the_rest(make):
    batch = make(SAMPLES, epoch=2, step=3, micro=1, bucket=4, steps_per_epoch=9)
    moved = batch.to("meta", non_blocking=True)
    for f in fields(Batch):
        before, after = getattr(batch, f.name), getattr(moved, f.name)
        if isinstance(before, torch.Tensor):
            assert after.device.type == "meta", f.name
            assert (after.shape, after.dtype) == (before.shape, before.dtype), f.name
        else:
            assert after == before, f.name
    assert batch.input_ids.device.type == "cpu"  # the batch itself is unchanged


def test_hand_built_batches_count_their_tokens():
    padded, packed = pad_batch(SAMPLES), pack_batch(SAMPLES)
    for batch in (padded, packed):
        assert batch.num_tokens == 9 and batch.max_seqlen == 4
        assert batch.num_tokens == int(batch.lengths.sum())
    assert (padded.layout, packed.layout) == ("padded", "packed")
    assert packed.cu_seqlens.tolist() == [0, 4, 6, 9]


# ---- BatchSource -------------------------------------------------------------------------


def test_both_sources_satisfy_the_protocol():
    source = ListSource(SAMPLES, rows=1, grad_accum=1)
    client = LoaderClient("ipc:///nonexistent/loader.sock", job="j", rank=0, world_size=1)
    try:
        assert isinstance(source, BatchSource) and isinstance(client, BatchSource)
    finally:
        client.close()
    assert not isinstance(iter([pad_batch(SAMPLES)]), BatchSource)  # no state, no close


def test_list_source_serves_batches_that_know_their_plan():
    source = ListSource(SAMPLES, rows=1, grad_accum=3, epochs=2)
    batches = list(source)
    assert [b.position for b in batches[:4]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0)]
    assert {b.steps_per_epoch for b in batches} == {source.steps_per_epoch} == {1}


# ---- RunOptions and config.json ----------------------------------------------------------


def test_the_command_line_defaults_are_the_dataclass_defaults(tmp_path):
    ctx = main.commands["train"].make_context(
        "train", ["--endpoint", "ipc:///x", "--run-dir", str(tmp_path)]
    )
    assert RunOptions(**ctx.params) == RunOptions(endpoint="ipc:///x", run_dir=tmp_path)


def test_run_options_round_trip_through_config_json(tmp_path):
    opts = RunOptions(
        endpoint="ipc:///x",
        run_dir=tmp_path / "run",
        init_drafter=tmp_path / "drafter",
        spec_pairs=("seed=3", "buckets=[100]"),
        lr=1e-3,
        steps=5,
        layers="0,1",
    )
    path = opts.write(requested_loader_spec={"seed": 3}, world_size=2)
    record = json.loads(path.read_text())
    assert record["init_drafter"] == str(tmp_path / "drafter")
    assert record["spec_pairs"] == ["seed=3", "buckets=[100]"]
    assert (record["requested_loader_spec"], record["world_size"]) == ({"seed": 3}, 2)
    assert RunOptions.read(opts.run_dir) == opts


def test_a_config_json_as_the_command_line_wrote_it_still_loads(tmp_path):
    """The keys are the click parameter names, the values as json.dumps wrote click's."""
    ctx = main.commands["train"].make_context(
        "train", ["--endpoint", "ipc:///x", "--run-dir", "run", "--spec", "seed=3"]
    )
    record = {k: str(v) if isinstance(v, Path) else v for k, v in ctx.params.items()}
    record.update(requested_loader_spec={"seed": 3}, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps(record, indent=2, default=str))
    assert RunOptions.read(tmp_path) == RunOptions(**ctx.params)


_DROP = object()  # a key left out of the file


def write_record(tmp_path: Path, **change) -> None:
    record = RunOptions(endpoint="ipc:///x", run_dir=tmp_path).to_record()
    record.update(dict.fromkeys(RUN_FACTS))
    record.update(change)
    for key in [k for k, v in change.items() if v is _DROP]:
        del record[key]
    (tmp_path / "config.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1, "also_bogus": 2}, r"unknown option\(s\) also_bogus, bogus"),
        ({"endpoint": _DROP, "lr": _DROP}, r"missing option\(s\) endpoint, lr"),
        ({"steps": "5"}, r"option steps must be int or null, got '5'"),
        ({"resume": 1}, r"option resume must be bool, got 1"),
        ({"lr": True}, r"option lr must be float or null, got True"),
    ],
)
def test_a_bad_config_json_is_named_clearly(tmp_path, change, message):
    write_record(tmp_path, **change)
    with pytest.raises(ValueError, match=message) as err:
        RunOptions.read(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_a_run_from_before_init_std_reads_as_pytorchs_start(tmp_path):
    """A ``config.json`` written before ``--init-std`` existed is read (for ``--resume``,
    export, the experiment's analysis) as the start those runs had: PyTorch's default."""
    write_record(tmp_path, init_std=_DROP)
    assert RunOptions.read(tmp_path).init_std == 0.0
    write_record(tmp_path)
    assert RunOptions.read(tmp_path).init_std is None  # the default, N(0, INIT_STD)


def test_a_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        RunOptions.read(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(
        ValueError,
        match=r"config\.json: not a run's config\.json \(JSON\) \("
        r"Expecting property name enclosed in double quotes at line 1 column 2\)",
    ):
        RunOptions.read(tmp_path)


def test_target_options_ignore_the_rest_and_default_what_came_later(tmp_path):
    record = RunOptions(endpoint="ipc:///x", run_dir=tmp_path, tiny_hidden=64).to_record()
    for later in ("tiny_heads", "tiny_kv_heads", "tiny_intermediate"):
        del record[later]
    target = TargetOptions.from_record(record, "cfg")
    assert target == TargetOptions(tiny_hidden=64)
    del record["tiny_vocab"]
    with pytest.raises(ValueError, match=r"cfg: missing option\(s\) tiny_vocab"):
        TargetOptions.from_record(record, "cfg")


def test_target_options_picked_from_a_command_s_arguments():
    kwargs = {f.name: getattr(TargetOptions(), f.name) for f in fields(TargetOptions)}
    assert TargetOptions.pick({**kwargs, "tiny_seed": 7, "batch_size": 64}).tiny_seed == 7


# ---- step sums ---------------------------------------------------------------------------


def loss_output(offsets: int, seed: int) -> LossOutput:
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(2 + 2 * offsets, generator=g, dtype=torch.float64)
    return LossOutput(
        loss=r[0] / r[1],
        weighted=r[0],
        weighted_ce_sum=r[0],
        divisor=r[1],
        correct=r[2 : 2 + offsets].clone(),
        count=r[2 + offsets :].clone(),
        num_blocks=seed + 3,
        num_tokens=100 * seed,
        capped_blocks=seed,
    )


def test_step_sums_round_trip_through_the_tensor():
    offsets = 7
    sums = StepSums.zeros(offsets, "cpu")
    outs = [loss_output(offsets, s) for s in (1, 2)]
    for out in outs:
        sums.add(out)
    sums.step_time += 0.5
    sums.wait += 0.125
    t = sums.to_tensor()
    assert t.dtype == torch.float64 and t.shape == (10 + 2 * offsets,)
    back = StepSums.from_tensor(t.clone(), offsets)
    for f in fields(StepSums):
        assert torch.equal(getattr(back, f.name), getattr(sums, f.name)), f.name
    assert float(back.tokens) == 300 and float(back.micro) == 2 and float(back.capped) == 3
    assert torch.equal(back.correct, outs[0].correct + outs[1].correct)
    assert float(back.ce) == float(outs[0].weighted_ce_sum + outs[1].weighted_ce_sum)
    means = [float(o.weighted_ce_sum / o.divisor) for o in outs]
    assert float(back.micro_means) == pytest.approx(sum(means), rel=1e-15)


def test_step_sums_add_like_the_all_reduce_adds():
    """Summing two ranks' tensors is summing their fields."""
    a, b = StepSums.zeros(3, "cpu"), StepSums.zeros(3, "cpu")
    a.add(loss_output(3, 1))
    b.add(loss_output(3, 2))
    total = StepSums.from_tensor(a.to_tensor() + b.to_tensor(), 3)
    for f in fields(StepSums):
        want = getattr(a, f.name) + getattr(b, f.name)
        assert torch.equal(getattr(total, f.name), want), f.name


def test_step_sums_refuse_a_tensor_of_the_wrong_size():
    with pytest.raises(ValueError, match="need 16 values"):
        StepSums.from_tensor(torch.zeros(17, dtype=torch.float64), 3)


def test_step_peaks_round_trip():
    peaks = StepPeaks(step_time=0.5, wait_frac=0.25, rss_gb=1.5, gpu_mem_gb=0.0)
    assert StepPeaks.from_tensor(peaks.to_tensor(torch.device("cpu"))) == peaks
