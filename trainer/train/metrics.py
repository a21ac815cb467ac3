"""Per-step metrics: one JSON object per optimizer step in ``RUN_DIR/metrics.jsonl``.

Fields: ``step``, ``epoch``, ``loss`` (weighted block cross-entropy, all ranks and micro-
batches), ``acc`` / ``acc_k`` (argmax accuracy overall / per block offset k = 1..B-1),
``lr``, ``grad_norm``, ``tokens`` (real tokens this step, all ranks), ``blocks``,
``step_time_s`` (mean over ranks), ``tokens_per_s`` (tokens / slowest rank's step time),
``data_wait_s`` / ``data_wait_frac`` (time blocked in ``next(loader)`` and its share of the
step time, mean over ranks) and ``data_wait_frac_max`` (worst rank), ``anchors_per_micro``,
``anchors_capped``, ``anchors_per_s``, ``rss_peak_gb`` / ``gpu_mem_peak_gb`` (largest over
ranks); ``tau`` (mean over prompts of each prompt's tokens per step, as published),
``tau_pooled`` (all prompts' tokens over all their steps), ``tau_served``, ``tau_committed``
and ``eval_s`` on steps where the verifier ran (step 0 is the untrained drafter), with
``tau/NAME`` and ``tau_pooled/NAME`` for each ``--eval-sets`` set. A step whose loss or
gradients were not finite on some rank was not applied: its record has
``skipped_nonfinite: 1`` (and ``loss`` / ``grad_norm`` null where they were NaN or inf);
a step in which no rank trained a supervised slot was not applied either (no objective:
AdamW would still move the weights), ``skipped_empty: 1`` and ``loss`` null; records of
normal steps lack both keys. Only rank 0 writes.

On resume the file is cut back to the checkpoint's step (atomically), so a run that was
killed after its last checkpoint does not list the replayed steps twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records (a torn last line from a kill is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsWriter:
    """Appends records; ``truncate_after(step)`` drops records of later steps."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._file: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 (kept open for the run)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline numbers of a run: first/last loss and tau, median step rate, data wait."""
    steps = [r for r in records if "loss" in r]
    taus = [r for r in records if "tau" in r]
    out: dict[str, Any] = {"steps": steps[-1]["step"] if steps else 0}
    if steps:
        times = sorted(r["step_time_s"] for r in steps)
        waits = sorted(r["data_wait_frac"] for r in steps)
        out.update(
            first_loss=steps[0]["loss"],
            last_loss=steps[-1]["loss"],
            median_step_time_s=times[len(times) // 2],
            median_steps_per_s=1.0 / max(times[len(times) // 2], 1e-9),
            median_tokens_per_s=sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2],
            mean_data_wait_frac=sum(waits) / len(waits),
            max_data_wait_frac=max(r["data_wait_frac_max"] for r in steps),
        )
    for key in ("skipped_nonfinite", "skipped_empty"):
        skipped = sum(int(r.get(key, 0)) for r in steps)
        if skipped:  # only then: the summary of a healthy run is unchanged
            out[key] = skipped
    if taus:
        out.update(first_tau=taus[0]["tau"], last_tau=taus[-1]["tau"])
        if "tau_pooled" in taus[-1]:
            out.update(last_tau_pooled=taus[-1]["tau_pooled"])
    for r in records:  # each evaluation set's last tau (--eval-sets), as last_tau/NAME
        out.update({f"last_{k}": v for k, v in r.items() if k.startswith("tau/")})
    return out


def iter_series(records: list[dict[str, Any]], key: str) -> Iterator[tuple[int, float]]:
    for r in records:
        if key in r and r[key] is not None:
            yield r["step"], r[key]
