"""Dashboards (``--report-to tensorboard,wandb,mlflow``): each metrics record of rank 0, and
the run's options as hyperparameters, sent to TensorBoard, Weights & Biases and MLflow
through each project's own library (the ``dashboards`` extra).

Everything stays on the machine unless the user says otherwise: TensorBoard event files
under ``RUN_DIR/tensorboard``; W&B in offline mode under ``RUN_DIR/wandb`` (``wandb sync``
uploads it later; ``WANDB_MODE`` set by the user wins); MLflow to a file store at
``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set.

What is logged is what the record holds (``trainer.train.metrics``), never more: each
number under a group (``train/loss``, ``perf/tokens_per_s``, ``memory/rss_peak_gb``,
``eval/tau``, ...; an evaluation set's ``tau/NAME`` as ``eval/tau/NAME``), a list per block
offset as ``train/acc_k/1`` .. ``train/acc_k/B-1``, a nested mapping as ``group/key/NAME``.
The trackers start, log and close on a thread of their own: the step loop only queues a
record's numbers. A tracker that fails (library missing, a folder it cannot write, any
exception at start, log or close) is one warning naming it and why; it is dropped and the
run goes on without it.
The libraries are imported inside their classes, so a run without ``--report-to`` imports
none of them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

log = logging.getLogger(__name__)

#: ``--report-to`` names, in the order they start.
TRACKERS = ("tensorboard", "wandb", "mlflow")
#: Record keys that are not plotted (the x axis, a wall-clock stamp).
_NOT_PLOTTED = {"step", "time"}
#: The most seconds queued records wait before the thread sends them (MLflow: in one call).
SEND_EVERY_S = 1.0
#: One record's numbers: (step, {dashboard name: value}).
Point = tuple[int, dict[str, float]]
#: Record key -> its group; keys not named here: ``eval/`` for tau*, else ``train/``.
_GROUPS = {
    **dict.fromkeys(("step_time_s", "tokens_per_s", "anchors_per_s", "data_wait_s",
                     "data_wait_frac", "data_wait_frac_max", "mfu", "tflops_per_s"), "perf"),
    **dict.fromkeys(("rss_peak_gb", "gpu_mem_peak_gb"), "memory"),
    "eval_s": "eval",
}  # fmt: skip


def parse_names(values: Iterable[str]) -> tuple[str, ...]:
    """``--report-to`` values (repeated or comma-separated) as tracker names, in order,
    each once; an unknown name is refused, naming the valid ones."""
    names = [n.strip().lower() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"--report-to {unknown[0]!r} is not a tracker: choose from {', '.join(TRACKERS)}"
        )
    return tuple(dict.fromkeys(names))


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers under dashboard names (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_PLOTTED:
            continue
        group = _GROUPS.get(key) or ("eval" if key.startswith("tau") else "train")
        _flatten(f"{group}/{key}", value, out)
    return out


def _flatten(name: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{name}/{k}", v, out)
    elif isinstance(value, list | tuple):  # per block offset: k = 1 .. B-1
        for k, v in enumerate(value, start=1):
            _flatten(f"{name}/{k}", v, out)
    elif isinstance(value, int | float) and math.isfinite(value):  # None, NaN: no point
        out[name] = float(value)


def hyperparameters(run_dir: Path, fallback: Mapping[str, Any]) -> dict[str, str | float]:
    """The run's options as flat hyperparameters: ``RUN_DIR/config.json`` (the resolved
    ``dflash-train train`` options, ``RunOptions.to_record``), else ``fallback`` (the loop's
    config, for a Trainer driven in process); nested keys joined by dots."""
    try:
        record = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        record = dict(fallback)
    out: dict[str, str | float] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                add(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, bool) or value is None or isinstance(value, list | tuple):
            out[prefix] = json.dumps(value, default=str)
        elif isinstance(value, int | float):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    add("", record)
    return out


class TensorBoardTracker:
    """Event files under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, params: dict[str, str | float]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        for summary in hparams(params, {"train/loss": 0.0}):
            self.writer._get_file_writer().add_summary(summary)  # add_hparams: another folder
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("options", "| option | value |\n|---|---|\n" + table)

    def log(self, points: list[Point]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self.writer._get_file_writer()
        for step, values in points:  # one event per step (add_scalar: one per value)
            summary = Summary(
                value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
            )
            writer.add_summary(summary, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """An offline W&B run under ``RUN_DIR/wandb`` (``wandb sync RUN_DIR/wandb/offline-*``)."""

    name = "wandb"

    def __init__(self, run_dir: Path, params: dict[str, str | float]) -> None:
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(
            silent=True, console="off", disable_git=True, save_code=False,
            disable_job_creation=True,
        )  # fmt: skip
        self.run = wandb.init(
            mode=cast(Any, os.environ.get("WANDB_MODE") or "offline"), dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT") or "dflash", name=Path(run_dir).name,
            config=params, settings=settings, reinit="create_new",
        )  # fmt: skip

    def log(self, points: list[Point]) -> None:
        for step, values in points:
            self.run.log(values, step=step)

    def close(self) -> None:
        try:
            self.run.finish()
        finally:
            self.wandb.teardown()  # the wandb-core service ends with the run


class MlflowTracker:
    """An MLflow run: a file store at ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI``
    names another (``mlflow ui --backend-store-uri RUN_DIR/mlruns``)."""

    name = "mlflow"
    MAX_PARAMS, MAX_METRICS = 100, 1000  # per log_batch call (MLflow's limits)

    def __init__(self, run_dir: Path, params: dict[str, str | float]) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 refuses its file store unless asked for it
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dflash"
        found = client.get_experiment_by_name(name)
        exp = found.experiment_id if found is not None else client.create_experiment(name)
        self.run_id = client.create_run(exp, run_name=Path(run_dir).name).info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), self.MAX_PARAMS):
            client.log_batch(self.run_id, params=items[i : i + self.MAX_PARAMS])

    def log(self, points: list[Point]) -> None:
        ms = int(time.time() * 1000)
        metrics = [
            self.metric(k, v, ms, step) for step, values in points for k, v in values.items()
        ]
        for i in range(0, len(metrics), self.MAX_METRICS):  # the file store: ~3 ms a call
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self.MAX_METRICS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {c.name: c for c in (TensorBoardTracker, WandbTracker, MlflowTracker)}


class Trackers:
    """The enabled trackers of a run (none off rank 0): ``log`` each metrics record,
    ``close`` at the end. They start and log on a thread of their own, so the step loop
    only queues each record's numbers; a tracker that raises is dropped with one warning."""

    def __init__(
        self,
        names: Iterable[str],
        run_dir: Path,
        enabled: bool = True,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.names = parse_names(names) if enabled else ()
        self.active: list[Any] = []  # the trackers started and not dropped (the thread's)
        self._queue: queue.SimpleQueue[Point | None] | None = None
        if not self.names:
            return
        self._queue = queue.SimpleQueue()
        args = (Path(run_dir), dict(config or {}))
        self._thread = threading.Thread(target=self._work, args=args, name="trackers", daemon=True)
        self._thread.start()

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        if self._queue is not None:
            self._queue.put((step, scalars(record)))

    def close(self, timeout_s: float = 120.0) -> None:
        """Send what is queued, close every tracker; one that is still busy after
        ``timeout_s`` is left behind (warned)."""
        if self._queue is None:
            return
        self._queue.put(None)
        self._queue = None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("--report-to: still busy after %.0f s, left behind", timeout_s)

    def _work(self, run_dir: Path, config: dict[str, Any]) -> None:
        """The thread: start the trackers, send each queued record, close them."""
        queued = self._queue
        assert queued is not None
        params = hyperparameters(run_dir, config)
        for name in self.names:
            try:
                self.active.append(_CLASSES[name](run_dir, params))
            except Exception as e:  # any failure: the run goes on without it
                _warn(name, "could not start", e)
        done = False
        while not done:
            points, done = _gather(queued)
            for tracker in list(self.active) if points else []:
                try:
                    tracker.log(points)
                except Exception as e:
                    self.active.remove(tracker)
                    _warn(tracker.name, "failed to log", e)
                    _quiet_close(tracker)
        trackers, self.active = self.active, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as e:
                _warn(tracker.name, "failed to close", e)


def _gather(queued: queue.SimpleQueue[Point | None]) -> tuple[list[Point], bool]:
    """The records queued until ``SEND_EVERY_S`` after the first (blocking for that one),
    and whether the end (None) came."""
    first = queued.get()
    if first is None:
        return [], True
    points, deadline = [first], time.monotonic() + SEND_EVERY_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = queued.get(timeout=left)
        except queue.Empty:
            break
        if item is None:
            return points, True
        points.append(item)
    return points, False


def _warn(name: str, what: str, e: BaseException) -> None:
    why = f"{type(e).__name__}: {e}"
    if isinstance(e, ImportError):
        why += " (pip install 'dflash-loader[dashboards]')"
    log.warning("--report-to %s %s, dropped (the run goes on without it): %s", name, what, why)


def _quiet_close(tracker: Any) -> None:
    try:
        tracker.close()
    except Exception:
        log.debug("closing the dropped tracker %s failed too", tracker.name, exc_info=True)
