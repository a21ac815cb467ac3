"""``dflash-train calibrate RUN_DIR...``: fit the planner's cost model to measured micro-batches.

Input: the timings training runs recorded (``trainer.train.costlog``); several runs are
fitted together (jobs of one setting; runs of both layouts only where their attention
kernels cost alike per pair of positions: on CPU a packed row's dense mask costs 2-4x the
causal kernel's per pair, so a fit of both is a compromise, which the per-layout hold-out
error shows). Each micro-batch becomes a row of the planner's own
features (``loader_server.planning.cost.features``: 1, tokens as laid out, attention pairs
under the kernel its packed rows ran under, block slots under the trainer's anchor rule,
documents) and its measured time ``y``. The fit minimises *relative* squared error,
``sum(((X c - y) / y)**2)``, over ``c >= 0`` (non-negative least squares: a negative
coefficient would let the planner think some micro-batch shape is cheaper the bigger it
gets). With five features the exact NNLS optimum is found by solving the weighted least
squares on every one of the 31 non-empty feature subsets and keeping the best whose
solution is non-negative: the NNLS optimum is the unconstrained optimum on its own
support, and every candidate is feasible. Of those, a fit without the constant term is
preferred where it is within ``SCALING_SLACK`` of the best (``fit_nnls``): full packed
rows cannot tell a fixed cost from one that scales with the row, and the planner prices
the shorter rows its cost cut makes.

A random ``holdout`` share of the micro-batches (seeded) is left out of the fit and
reported: median and 90th-percentile relative error of the predicted time, over all and
per layout. Micro-batches whose backward all-reduced gradients (``synced``: they include
waiting for other ranks) are left out when at least ``MIN_SAMPLES`` others exist.

Output: a cost profile (``loader_server.wire.spec.profile_text``; seconds; with the anchor
rule and the packed-row kernel it was measured under), a predicted-vs-measured plot, and a
report.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loader_server.planning import cost
from loader_server.wire import layouts
from loader_server.wire.spec import COEFFICIENTS, AnchorRule, profile_text
from trainer.files import atomic_output
from trainer.train.cost_records import cost_dir, parse_record

log = logging.getLogger(__name__)

#: Fewest micro-batches a fit (training part) needs: 5 coefficients, with room to spare.
MIN_SAMPLES = 8


@dataclass(frozen=True)
class Samples:
    """Measured micro-batches: features ``[n, 5]``, seconds ``[n]``, each one's layout
    ``[n]``, and where they came from."""

    x: np.ndarray
    y: np.ndarray
    layout: np.ndarray
    rule: AnchorRule
    synced_dropped: int
    packed_attention: str = "documents"  # the kernel the packed rows ran under

    @property
    def layouts(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.layout.tolist())))


@dataclass(frozen=True)
class Report:
    coefficients: dict[str, float]
    rule: AnchorRule
    n_fit: int
    n_holdout: int
    median_rel_err: float
    p90_rel_err: float
    fit_median_rel_err: float
    synced_dropped: int
    profile: Path
    plot: Path | None
    #: layout -> (hold-out micro-batches, median, p90 relative error) of that layout's
    by_layout: dict[str, tuple[int, float, float]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_fit": self.n_fit,
            "n_holdout": self.n_holdout,
            "holdout_median_rel_err": self.median_rel_err,
            "holdout_p90_rel_err": self.p90_rel_err,
            "fit_median_rel_err": self.fit_median_rel_err,
            "synced_dropped": self.synced_dropped,
            "holdout_by_layout": {
                k: {"n": n, "median_rel_err": med, "p90_rel_err": p90}
                for k, (n, med, p90) in self.by_layout.items()
            },
        }

    def summary(self) -> str:
        c = self.coefficients
        terms = zip(COEFFICIENTS, cost.FEATURES, strict=True)
        left_out = self.synced_dropped
        lines = [
            f"fitted on {self.n_fit} micro-batches, {self.n_holdout} held out"
            + (f" ({left_out} all-reduce micro-batches left out)" if left_out else ""),
            "cost (s) = " + " + ".join(f"{c[n]:.4g}*{f}" for n, f in terms),
            f"hold-out relative error: median {100 * self.median_rel_err:.1f}%, "
            f"p90 {100 * self.p90_rel_err:.1f}% (fit: median {100 * self.fit_median_rel_err:.1f}%)",
        ]
        if len(self.by_layout) > 1:
            lines += [
                f"  {k}: median {100 * med:.1f}%, p90 {100 * p90:.1f}% ({n} held out)"
                for k, (n, med, p90) in self.by_layout.items()
            ]
        lines.append(f"profile: {self.profile}")
        if self.plot is not None:
            lines.append(f"plot: {self.plot}")
        return "\n".join(lines)


def load_samples(run_dirs: Path | Sequence[Path]) -> Samples:
    """The recorded micro-batches of one run or several, as features and times.

    ValueError naming the file and line for a malformed record, for records made under
    different anchor rules, and for runs with too few records."""
    dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else [Path(d) for d in run_dirs]
    latest: dict[tuple[int, ...], dict[str, Any]] = {}
    rules: dict[AnchorRule, str] = {}
    kernels: dict[str, str] = {}  # of packed rows (a padded row's attention is its own)
    for i, run_dir in enumerate(dirs):
        for rec, where in _records(run_dir):
            rules.setdefault(rec["rule"], where)
            if layouts.layout(rec["layout"]).packs:
                kernels.setdefault(rec["attention"], where)
            latest[(i, *rec["key"])] = rec
    for what, seen in (("anchor rules", rules), ("packed-row attention kernels", kernels)):
        if len(seen) > 1:
            (a, wa), (b, wb) = list(seen.items())[:2]
            raise ValueError(
                f"the timings mix {what} {a} ({wa}) and {b} ({wb}): calibrate one setting at a time"
            )
    records = list(latest.values())
    unsynced = [r for r in records if not r.get("synced")]
    dropped = 0
    if len(unsynced) >= MIN_SAMPLES and len(unsynced) < len(records):
        dropped = len(records) - len(unsynced)
        records = unsynced
    if len(records) < MIN_SAMPLES:
        named = ", ".join(str(d) for d in dirs)
        raise ValueError(
            f"{named}: {len(records)} timed micro-batches; calibration needs at least "
            f"{MIN_SAMPLES} (train more steps, or raise --cost-samples)"
        )
    rule = next(iter(rules))
    x = np.concatenate([_features(r, rule) for r in records])
    y = np.array([r["time_s"] for r in records], np.float64)
    layout = np.array([r["layout"] for r in records])
    return Samples(x, y, layout, rule, dropped, next(iter(kernels), "documents"))


def _records(run_dir: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """Each timing record of ``run_dir`` and where it was read; a torn last line skipped."""
    files = sorted(cost_dir(run_dir).glob("rank*.jsonl"))
    if not files:
        raise ValueError(
            f"{run_dir} has no {cost_dir(run_dir).name}/rank*.jsonl: train with --cost-samples N "
            "(the default records 2000 micro-batches per rank) first"
        )
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield parse_record(line, where), where
            except ValueError:
                if lineno == len(lines) and not text.endswith("\n"):
                    # the line a killed trainer was writing: the records before it stand
                    log.warning("%s: skipped a torn last line (the run was killed?)", where)
                    continue
                raise


def _features(rec: dict[str, Any], rule: AnchorRule) -> np.ndarray:
    lengths = np.asarray(rec["doc_lengths"], np.int64)
    return cost.features(
        lengths, np.zeros(1, np.int64), layout=rec["layout"], rule=rule,
        packed_attention=rec["attention"],
    )  # fmt: skip


#: How much more squared relative error a fit without the constant term may leave and
#: still be preferred (``fit_nnls``): 1.25x, about 12% more RMS error.
SCALING_SLACK = 1.25


def fit_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the relative squared error (module docstring),
    with one preference: where a fit without the constant term (column 0) explains the
    times within ``SCALING_SLACK`` of the best, it is taken. Micro-batches that all hold
    about the same tokens (full packed rows) cannot tell a fixed cost per micro-batch from
    one that scales with its tokens or attention pairs; the planner then cuts smaller
    micro-batches, and a constant would price them as dear as full ones (measured: the
    constant took the whole row's attention, and the cut emptied 24% of each row)."""
    a = x / y[:, None]  # row i divided by y_i: the residual becomes (x c - y) / y
    b = np.ones_like(y)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # columns of similar size: a well-conditioned solve
    best: dict[bool, tuple[float, np.ndarray]] = {}  # with the constant or not -> best fit
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (sol < 0).any():
                continue
            r = a[:, cols] @ sol - b
            err, key = float(r @ r), 0 in cols
            if err < best.get(key, (float(b @ b), None))[0]:
                coef = np.zeros(x.shape[1])
                coef[list(cols)] = sol
                best[key] = (err, coef)
    if not best:
        return np.zeros(x.shape[1])
    overall = min(e for e, _ in best.values())
    scaling = best.get(False)
    chosen = scaling if scaling and scaling[0] <= SCALING_SLACK * overall else best[True]
    return chosen[1] / scale


def relative_errors(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> np.ndarray:
    return np.abs(x @ coef - y) / y


def calibrate_run(
    run_dirs: Path | Sequence[Path],
    *,
    out: Path | None = None,
    holdout: float = 0.2,
    seed: int = 0,
    plot: bool = True,
) -> Report:
    """Fit, evaluate on the hold-out, write the profile (default: the first run's
    ``cost_profile.json``) and the plot (its ``cost_fit.png``); return the report."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else [Path(d) for d in run_dirs]
    samples = load_samples(dirs)
    n = samples.y.size
    n_hold = max(0, min(round(holdout * n), n - MIN_SAMPLES))
    perm = np.random.default_rng(seed).permutation(n)
    held, used = perm[:n_hold], perm[n_hold:]
    coef = fit_nnls(samples.x[used], samples.y[used])
    fit_err = relative_errors(samples.x[used], samples.y[used], coef)
    judged = held if n_hold else used
    hold_err = relative_errors(samples.x[judged], samples.y[judged], coef)
    coefficients = {name: float(v) for name, v in zip(COEFFICIENTS, coef, strict=True)}
    if not any(coefficients.values()):
        raise ValueError(f"{dirs[0]}: the fit left every coefficient at 0 (times too noisy?)")
    rule = samples.rule._asdict()
    out = out or dirs[0] / "cost_profile.json"
    by_layout = {}
    for layout in samples.layouts:
        err = hold_err[samples.layout[judged] == layout]
        if err.size:
            by_layout[layout] = (int(err.size), float(np.median(err)), float(np.quantile(err, 0.9)))
    report = Report(
        coefficients=coefficients,
        rule=samples.rule,
        n_fit=int(used.size),
        n_holdout=int(n_hold),
        median_rel_err=float(np.median(hold_err)),
        p90_rel_err=float(np.quantile(hold_err, 0.9)),
        fit_median_rel_err=float(np.median(fit_err)),
        synced_dropped=samples.synced_dropped,
        profile=out,
        plot=dirs[0] / "cost_fit.png" if plot else None,
        by_layout=by_layout,
    )
    source = str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs]
    text = profile_text(
        coefficients, rule, where=str(out), units="seconds", layouts=list(samples.layouts),
        packed_attention=samples.packed_attention, source=source, fit=report.as_dict(),
    )  # fmt: skip
    inputs = [cost_dir(d) for d in dirs]
    with atomic_output(out, folder=False, force=True, inputs=inputs) as tmp:
        tmp.write_text(text)
    if report.plot is not None:
        with atomic_output(report.plot, folder=False, force=True, inputs=inputs) as tmp:
            _plot(tmp, samples, coef, held)
    return report


def _plot(path: Path, samples: Samples, coef: np.ndarray, held: np.ndarray) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = samples.x @ coef
    is_held = np.zeros(samples.y.size, bool)
    is_held[held] = True
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(samples.y[~is_held] * 1e3, pred[~is_held] * 1e3, s=8, alpha=0.6, label="fit")
    ax.scatter(samples.y[is_held] * 1e3, pred[is_held] * 1e3, s=12, marker="x", label="held out")
    top = float(max(samples.y.max(), pred.max())) * 1e3 * 1.05
    ax.plot([0, top], [0, top], color="grey", lw=1)
    ax.set(xlabel="measured ms", ylabel="predicted ms", title="micro-batch compute time")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
