"""Planning commands: ``buckets`` (optimal boundaries, efficiency curve) and ``plan``.

The batch-spec flags come from ``loader_server.cli.spec_flags`` (same names in every
command: plan, serve, bench).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from loader_server.cli.spec_flags import spec_from_options, spec_options
from loader_server.data.dataset import open_dataset
from loader_server.planning import buckets as bk
from loader_server.planning import metrics
from loader_server.planning.planner import EpochPlan, effective_lengths
from loader_server.wire.spec import (
    REFERENCE_BUCKETS,
    BatchSpec,
)

_DEFAULT = BatchSpec()


@click.command()
@click.argument("dataset", type=click.Path(exists=True, path_type=Path))
@click.option("--max-buckets", type=click.IntRange(1, 64), default=32, show_default=True)
@click.option("--max-seq-len", type=int, default=_DEFAULT.max_seq_len, show_default=True)
@click.option(
    "--target-efficiency", type=float, default=_DEFAULT.target_efficiency, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG.")
def buckets(
    dataset: Path,
    max_buckets: int,
    max_seq_len: int,
    target_efficiency: float,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Optimal length buckets of DATASET for K = 1..--max-buckets.

    Efficiency = real tokens / tokens padded to each bucket's upper bound (exact dynamic
    program; a conservative estimate of padding to each batch's longest sample).
    """
    ds = open_dataset(dataset)
    spec = BatchSpec(max_seq_len=max_seq_len, target_efficiency=target_efficiency)
    eff, ok = effective_lengths(ds.lengths, spec)
    lengths = eff[ok]
    table = bk.solve(lengths, max_buckets)
    curve = table.efficiency()
    reference = _reference_efficiency(lengths, max_seq_len)
    rows = [
        {"k": k, "efficiency": float(curve[k - 1]), "bounds": table.bounds(k).tolist()}
        for k in range(1, table.max_k + 1)
    ]
    auto = _auto_summary(lengths, spec)
    result = {
        "path": str(dataset),
        "samples": int(lengths.size),
        "tokens": table.tokens,
        "curve": rows,
        "reference_6_buckets": reference,
        "auto": auto,
    }
    if plot is not None:
        _plot_curve(curve, reference, plot, title=str(dataset))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{dataset}: {lengths.size:,} samples, {table.tokens:,} tokens")
    click.echo(f"{'K':>3}  {'efficiency':>10}  bounds")
    for row in rows:
        click.echo(f"{row['k']:>3}  {row['efficiency']:>10.4f}  {_short(row['bounds'])}")
    click.echo(f"reference 6 buckets {list(REFERENCE_BUCKETS)}: {reference:.4f}")
    click.echo(
        f"auto (target {target_efficiency}): K={auto['k']}, efficiency {auto['efficiency']:.4f}"
    )
    if plot is not None:
        click.echo(f"plot: {plot}")


@click.command()
@click.argument("dataset", type=click.Path(exists=True, path_type=Path))
@spec_options
@click.option("--epoch", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--dump",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the epoch plan (one row per sample) as an Arrow file.",
)
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG.")
@click.option(
    "--compare",
    is_flag=True,
    help="Also measure sorted, random and the reference 6 buckets on the same data.",
)
def plan(
    dataset: Path,
    epoch: int,
    as_json: bool,
    dump: Path | None,
    plot: Path | None,
    compare: bool,
    **kwargs: Any,
) -> None:
    """Plan one epoch of DATASET and report its quality (and the next epoch's overlap)."""
    spec = spec_from_options(**kwargs)
    lengths = open_dataset(dataset).lengths
    the_plan, following, cold, warm = metrics.timed_plans(lengths, spec, epoch=epoch)
    result = metrics.summarize(the_plan, following)
    result.update(
        plan_s=cold,
        plan_warm_s=warm,
        spec_key=spec.key(),
        stats=the_plan.stats,
        spec=spec.to_dict(),
        epoch=epoch,
        path=str(dataset),
    )
    rows = {}
    if compare:
        rows = {"this spec": result}
        for name, other in list(metrics.baselines(spec).items())[1:]:
            model = np.asarray(spec.coefficients) if spec.cost_model_on else None
            rows[name] = metrics.evaluate(lengths, other, epoch=epoch, model=model)
        result["compare"] = {name: _plain(r) for name, r in rows.items() if name != "this spec"}
    if dump is not None:
        write_dump(the_plan, dump)
    if plot is not None:
        _plot_plan(the_plan, plot, title=f"{dataset} epoch {epoch}")
    if as_json:
        click.echo(json.dumps(_plain(result), indent=2))
        return
    _echo_plan(result, the_plan)
    if compare:
        click.echo(metrics.format_table(rows))
    for what, path in (("dump", dump), ("plot", plot)):
        if path is not None:
            click.echo(f"{what}: {path}")


def write_dump(p: EpochPlan, out: Path) -> None:
    """One row per served sample: epoch, step, rank, micro, sample_id, length (Arrow IPC
    file format), in plan order."""
    import pyarrow as pa

    s = p.spec
    micro = metrics.micro_of_sample(p)
    table = pa.table(
        {
            "epoch": pa.array(np.full(micro.size, p.epoch, np.int32)),
            "step": pa.array((micro // s.micro_per_step).astype(np.int32)),
            "rank": pa.array((micro // s.grad_accum % s.world_size).astype(np.int32)),
            "micro": pa.array((micro % s.grad_accum).astype(np.int32)),
            "sample_id": pa.array(p.sample_ids),
            "length": pa.array(p.sample_lengths),
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    tmp.replace(out)


def _echo_plan(r: dict[str, Any], p: EpochPlan) -> None:
    st = r["stats"]
    click.echo(f"{r['path']} epoch {r['epoch']}, spec {r['spec_key']}: {p.spec.to_dict()}")
    click.echo(
        f"steps {p.num_steps:,} x {p.spec.world_size} ranks x {p.spec.grad_accum} micro; "
        f"micro-batches {p.num_micro:,}; buckets {st['num_buckets']} {_short(st['bucket_bounds'])}"
    )
    click.echo(
        f"served {st['served']:,}/{st['samples']:,} samples, {st['served_tokens']:,} tokens; "
        f"dropped: leftover {st['dropped_leftover']}, overlong {st['dropped_overlong']}, "
        f"empty {st['dropped_empty']}; truncated {st['truncated']}"
    )
    click.echo(
        f"padding efficiency {r['padding_efficiency']:.4f}  composition repeat "
        f"{r['composition_repeat']:.4f}  step mix distance {r['step_mix_distance']:.3f}  "
        f"rank imbalance {r['rank_imbalance']:.4f}  plan {r['plan_s']:.3f} s "
        f"(next epoch {r['plan_warm_s']:.3f} s)"
    )
    if p.spec.cost_model_on:
        click.echo(
            f"cost model: budget {st['cost_budget']:.6g} per micro-batch, "
            f"rank imbalance by modelled cost {r['rank_imbalance_modelled']:.4f}"
        )


def _auto_summary(lengths: np.ndarray, spec: BatchSpec) -> dict[str, Any]:
    if lengths.size == 0:
        return {"k": 0, "efficiency": 1.0, "bounds": []}
    table = bk.solve(lengths, 64, stop_at=spec.target_efficiency)
    k = table.smallest_k(spec.target_efficiency)
    return {
        "k": k,
        "efficiency": float(table.efficiency()[k - 1]),
        "bounds": table.bounds(k).tolist(),
    }


def _reference_efficiency(lengths: np.ndarray, max_seq_len: int) -> float:
    bounds = np.array([*(b for b in REFERENCE_BUCKETS if b < max_seq_len), max_seq_len])
    padded = int(bounds[bk.assign(lengths, bounds)].sum()) if lengths.size else 0
    return float(lengths.sum()) / padded if padded else 1.0


def _short(bounds: list[int], keep: int = 8) -> str:
    if len(bounds) <= keep:
        return str(bounds)
    head = ", ".join(map(str, bounds[: keep // 2]))
    tail = ", ".join(map(str, bounds[-keep // 2 :]))
    return f"[{head}, ..., {tail}]"


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe copy (numpy scalars to Python)."""
    return json.loads(json.dumps(r, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'dflash-loader[plot]'") from e
    return plt


def _plot_curve(curve: np.ndarray, reference: float, out: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    k = np.arange(1, curve.size + 1)
    ax.plot(k, curve, marker="o", ms=3, label="optimal K buckets")
    ax.axhline(reference, color="gray", ls="--", label="reference 6 buckets")
    ax.set_xlabel("buckets K")
    ax.set_ylabel("padding efficiency (to bucket bound)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_plan(p: EpochPlan, out: Path, title: str) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6))
    shares = metrics.step_band_tokens(p)
    shares = shares / np.maximum(shares.sum(axis=1, keepdims=True), 1)
    steps = np.arange(min(200, p.num_steps))
    top.stackplot(steps, shares[steps].T, labels=[f"band {b}" for b in range(shares.shape[1])])
    top.set_ylabel("token share")
    top.set_title(f"{title}: length bands per step (first {steps.size} steps)")
    top.legend(loc="upper right", fontsize=7)
    costs = metrics.rank_costs(p)
    ratio = costs.max(axis=1) / np.maximum(costs.mean(axis=1), 1e-9)
    bottom.hist(ratio, bins=50, color="#4472c4")
    bottom.set_xlabel("max / mean rank cost per step")
    bottom.set_ylabel("steps")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


COMMANDS = [buckets, plan]
