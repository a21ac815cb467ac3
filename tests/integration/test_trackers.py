"""``--report-to``: a 3-step in-process run on the tiny target logs to TensorBoard, W&B
(offline) and MLflow (file store), each read back with that library's own reader; a tracker
that fails is one warning and the run completes; an unknown name is refused."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from drafters import in_process

from trainer.cli import main
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.train import trackers
from trainer.train.batches import ListSource
from trainer.train.distributed import local_env
from trainer.train.loop import Trainer
from trainer.train.metrics import metrics_path, read_metrics

pytestmark = pytest.mark.integration

STEPS = 3
#: No network, no stdout capture, no system-metrics process, nothing outside the test.
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_X_DISABLE_STATS": "true",
             "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}  # fmt: skip


def samples() -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 511, (48,), generator=g).tolist(), [0] * 8 + [1] * 40)
            for _ in range(12)]  # fmt: skip


def train(target, run_dir: Path, report_to: tuple[str, ...]) -> list[dict]:
    """3 steps (tau at steps 0 and 3 on 2 prompts), no daemon; the metrics records."""
    cfg = in_process(
        run_dir, LossConfig(block_size=8, anchors_per_doc=6), steps=STEPS, lr=3e-3, warmup=1,
        eval_new_tokens=8, cost_samples=0, report_to=report_to,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=8, mask_token_id=511
    ))  # fmt: skip
    data = samples()
    prompts = [torch.tensor(s[0][:8]) for s in data[:2]]
    Trainer(cfg, target=target, drafter=drafter, source=ListSource(data, rows=4),
            env=local_env(), eval_prompts=prompts).run()  # fmt: skip
    return read_metrics(metrics_path(run_dir))


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    """One run that reports to all three; (run folder, its metrics records)."""
    run_dir = tmp_path_factory.mktemp("dash") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**WANDB_ENV, "WANDB_DIR": str(run_dir)}.items():
            mp.setenv(k, v)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker sets it: undone after
        records = train(target, run_dir, ("tensorboard,wandb", "mlflow"))
    return run_dir, records


def by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def test_tensorboard_scalars_are_the_metrics_records(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records = run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert scalars["train/loss"] == pytest.approx(by_step(records, "loss"))
    assert list(scalars["train/loss"]) == [1, 2, 3]
    assert scalars["eval/tau"] == pytest.approx(by_step(records, "tau"))  # steps 0 and 3
    assert set(scalars["eval/tau"]) == {0, STEPS}
    assert scalars["train/acc_k/7"][3] == pytest.approx(records[-1]["acc_k"][6])
    for tag in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/data_wait_s",
                "memory/rss_peak_gb", "memory/gpu_mem_peak_gb"):  # fmt: skip
        assert set(scalars[tag]) == {1, 2, 3}, tag
    assert "options/text_summary" in acc.Tags()["tensors"]  # the options, as a table


def wandb_records(path: Path):
    """The records of a W&B ``.wandb`` file (a LevelDB-style log of ``wandb_internal``
    protobuf records: 7-byte header, 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""
        elif kind == 0:
            break


def test_wandb_offline_run_holds_every_step_and_the_options(run):
    run_dir, records = run
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    config: dict = {}
    exits = []
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            history[record.history.step.num] = items
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "exit":
            exits.append(record.exit.exit_code)
    assert sorted(history) == [0, 1, 2, 3]
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == (
        pytest.approx(by_step(records, "loss"))
    )
    assert history[0]["eval/tau"] == pytest.approx(records[0]["tau"])
    assert config["lr"] == 3e-3 and config["block_size"] == 8
    assert exits == [0]  # finished: the run's exit record
    assert not wandb_processes(), "a wandb service outlived the run"


def wandb_processes() -> list[str]:
    """This test process's children still running a wandb service."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and "wandb" in cmd:
            out.append(cmd)
    return out


def test_mlflow_file_store_holds_every_step_and_the_options(run):
    from mlflow.tracking import MlflowClient

    run_dir, records = run
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(by_step(records, "loss"))
    tau = client.get_metric_history(found.info.run_id, "eval/tau")
    assert {m.step for m in tau} == {0, STEPS}
    got = client.get_run(found.info.run_id)
    assert got.data.params["lr"] == "0.003" and got.info.status == "FINISHED"
    assert got.info.run_name == "run"


def test_failing_trackers_are_one_warning_each_and_the_run_completes(
    target, tmp_path, monkeypatch, caplog
):
    """tensorboard: its folder is a file; wandb: not installed; mlflow: fails to log."""
    (tmp_path / "tensorboard").write_text("not a folder")
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a URI of the user's: theirs to allow
    calls = []

    def full(self, points):
        calls.append(points)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trackers.MlflowTracker, "log", full)
    with caplog.at_level(logging.WARNING, logger="trainer.train.trackers"):
        records = train(target, tmp_path, ("tensorboard,wandb,mlflow",))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if r.name == "trainer.train.trackers"]
    assert len(warned) == 3, warned
    tb, wb, ml = sorted(warned, key=lambda m: [n in m for n in ("mlflow", "wandb")])
    assert "--report-to tensorboard could not start" in tb
    assert "--report-to wandb could not start" in wb and "dflash-loader[dashboards]" in wb
    assert "--report-to mlflow failed to log" in ml and "No space left" in ml
    assert len(calls) == 1  # dropped at its first failure
    assert all(r.exc_info is None for r in caplog.records)  # no traceback


def test_unknown_tracker_is_refused_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="'tensorbord' is not a tracker: choose from "
                       "tensorboard, wandb, mlflow"):  # fmt: skip
        trackers.parse_names(("wandb,tensorbord",))
    args = ["train", "--endpoint", "ipc:///nowhere", "--run-dir", str(tmp_path / "r"),
            "--steps", "1", "--report-to", "neptune"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "'neptune' is not a tracker" in res.output, res.output
    assert trackers.parse_names(["mlflow", " WandB,mlflow"]) == ("mlflow", "wandb")


def test_a_run_without_report_to_imports_no_tracker_library():
    code = ("import sys; from trainer.train.loop import Trainer; "
            "from trainer.train.trackers import Trackers; Trackers((), '.').close(); "
            "print([m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules])"
            )  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
