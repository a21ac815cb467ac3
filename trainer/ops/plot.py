"""``dflash-train plot RUN_DIR``: PNG curves from ``metrics.jsonl`` (matplotlib, Agg); the
tau plot has the held-out prompts' ``tau`` and ``tau_pooled`` and each evaluation set's
``tau/NAME``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.files import atomic_output, check_output
from trainer.train.metrics import iter_series, metrics_path, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write loss, tau, throughput/data-wait and per-offset accuracy plots; return paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(metrics_path(run_dir))
    if not records:
        raise ValueError(f"no metrics in {metrics_path(run_dir)}")
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    check_output(out_dir, inputs=[metrics_path(run_dir)])
    written = []
    for name, draw in _FIGURES.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, records, run_dir.name)
        path = out_dir / name
        fig.tight_layout()
        with atomic_output(path, folder=False, force=True) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        written.append(path)
    return written


def _loss(ax: Axes, records: list[dict[str, Any]], run: str) -> None:
    losses = list(iter_series(records, "loss"))
    if losses:
        ax.plot(*zip(*losses, strict=True), lw=1)
    ax.set(xlabel="optimizer step", ylabel="weighted block CE", title=f"loss: {run}")
    ax.grid(alpha=0.3)


def _tau(ax: Axes, records: list[dict[str, Any]], run: str) -> None:
    lines = [("tau", "tau (per-prompt mean, as published)"), ("tau_pooled", "pooled")]
    sets = dict.fromkeys(k for r in records for k in r if k.startswith("tau/"))
    lines += [(key, f"tau: {key.removeprefix('tau/')}") for key in sets]  # --eval-sets
    for key, label in lines:
        taus = list(iter_series(records, key))
        if taus:
            ax.plot(*zip(*taus, strict=True), marker="o", label=label)
    if ax.lines:
        ax.legend()
    ax.set(xlabel="optimizer step", ylabel="tau (tokens / step)", title="acceptance length")
    ax.grid(alpha=0.3)


def _throughput(ax1: Axes, records: list[dict[str, Any]], run: str) -> None:
    tps = list(iter_series(records, "tokens_per_s"))
    if tps:
        ax1.plot(*zip(*tps, strict=True), lw=1, color="tab:blue")
    ax1.set(xlabel="optimizer step", ylabel="tokens/s (all ranks)")
    ax2 = ax1.twinx()
    wait = [(s, 100 * w) for s, w in iter_series(records, "data_wait_frac")]
    if wait:
        ax2.plot(*zip(*wait, strict=True), lw=1, color="tab:red")
    ax2.set_ylabel("data wait (% of step)", color="tab:red")
    ax1.set_title("throughput and data wait")


def _accuracy(ax: Axes, records: list[dict[str, Any]], run: str) -> None:
    last = next((r for r in reversed(records) if "acc_k" in r), None)
    if last is not None:
        ks = range(1, len(last["acc_k"]) + 1)
        ax.bar(ks, last["acc_k"])
        ax.set_title(f"accuracy by block offset (step {last['step']})")
    ax.set(xlabel="block offset k", ylabel="argmax accuracy")


#: File name -> what draws it on one axes.
_FIGURES: dict[str, Callable[[Axes, list[dict[str, Any]], str], None]] = {
    "loss.png": _loss,
    "tau.png": _tau,
    "throughput.png": _throughput,
    "acc_by_offset.png": _accuracy,
}
