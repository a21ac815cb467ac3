"""What ``dflash-train eval`` writes: ``eval.json`` (every figure), ``eval.md`` (the table shaped
like the published ones: rows drafters, columns sets, the settings stated above it, then every
protocol side by side) and ``positions.png`` (acceptance by draft slot)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.eval.runner import EvalSettings, Measurement


def write_report(
    out: Path, measurements: Sequence[Measurement], settings: EvalSettings,
    sets: dict[str, str],
) -> dict[str, Path]:  # fmt: skip
    """The three files under ``out`` (the caller makes it appear whole: ``atomic_output``);
    ``sets``: each set's one-line description."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "settings": settings.to_json(),
        "sets": sets,
        "measurements": [m.to_json() for m in measurements],
    }
    paths = {"json": out / "eval.json", "markdown": out / "eval.md"}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["markdown"].write_text(markdown(measurements, settings, sets))
    png = plot_positions(out / "positions.png", measurements)
    if png is not None:
        paths["png"] = png
    return paths


def _tau(m: Measurement) -> float | None:
    if m.stats is not None:
        return m.stats.tau
    return m.engine_tau


def markdown(
    measurements: Sequence[Measurement], settings: EvalSettings, sets: dict[str, str]
) -> str:
    """The published table's shape (rows: drafter and engine; columns: sets; a mean), per
    thinking mode, then every protocol per measurement."""
    s = settings.sampling
    blocks = sorted({m.block_size for m in measurements})
    head = (
        f"Acceptance length (tau), temperature {s.temperature:g}"
        + (f", top-p {s.top_p:g}" if s.top_p < 1 else "")
        + (f", top-k {s.top_k}" if s.top_k > 0 else "")
        + f", block size {'/'.join(map(str, blocks))}, max new tokens {settings.max_new_tokens}"
        + (f", seed {s.seed}" if not s.greedy else "")
    )
    lines = [f"# {head}", ""]
    lines += [f"- {desc}" for desc in sets.values()]
    names = list(sets)
    for thinking in sorted({m.thinking for m in measurements}):
        lines += ["", f"## Thinking {'on' if thinking else 'off'}", ""]
        lines += _main_table([m for m in measurements if m.thinking == thinking], names)
    lines += ["", "## Every protocol", "", *_protocol_table(measurements)]
    lines += ["", _LEGEND]
    return "\n".join(lines) + "\n"


_LEGEND = (
    "tau: z-lab's (mean over responses of each response's mean acceptance length, bonus "
    "token counted); pooled: acceptance lengths over all steps (SpecForge, DeepSpec); "
    "served: 1 + accepted / drafts over the steps an engine runs (vLLM's /metrics); "
    "[lo, hi]: 95% bootstrap interval over responses; p1..: how often draft slot k is "
    "accepted. The vLLM rows are read off its /metrics: served tau and slot rates only. "
    "docs/EVAL.md sets the protocols side by side."
)


def _main_table(ms: Sequence[Measurement], names: list[str]) -> list[str]:
    rows: dict[tuple[str, str], dict[str, Measurement]] = {}
    for m in ms:
        rows.setdefault((m.drafter, m.engine), {})[m.set] = m
    out = ["| Drafter | " + " | ".join(names) + " | Mean |", "|---" * (len(names) + 2) + "|"]
    for (drafter, engine), by_set in rows.items():
        cells, vals = [], []
        for n in names:
            cell = by_set.get(n)
            tau = None if cell is None else _tau(cell)
            cells.append("-" if tau is None else f"{tau:.2f}")
            if tau is not None:
                vals.append(tau)
        mean = f"{sum(vals) / len(vals):.2f}" if vals else "-"
        label = f"{drafter} ({'vLLM, served' if engine == 'vllm' else 'ours'})"
        out.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")
    return out


def _protocol_table(ms: Sequence[Measurement]) -> list[str]:
    out = [
        "| Drafter | Set | Thinking | Engine | Prompts | tau [95%] | pooled | served [95%] "
        "| p1 | p2 | p3 | s |",
        "|---" * 12 + "|",
    ]
    for m in ms:
        rates: Sequence[float]
        if m.stats is not None:
            st = m.stats
            tau = f"{st.tau:.3f} [{st.tau_ci[0]:.3f}, {st.tau_ci[1]:.3f}]"
            pooled = f"{st.tau_pooled:.3f}"
            served = f"{st.tau_served:.3f} [{st.tau_served_ci[0]:.3f}, {st.tau_served_ci[1]:.3f}]"
            rates = st.position_rates
        else:
            tau, pooled = "-", "-"
            served = "-" if m.engine_tau is None else f"{m.engine_tau:.3f}"
            rates = m.engine_position_rates
        p = [f"{r:.2f}" for r in list(rates)[:3]] + ["-"] * (3 - min(3, len(rates)))
        out.append(
            f"| {m.drafter} | {m.set} | {'on' if m.thinking else 'off'} | {m.engine} "
            f"| {m.prompts} | {tau} | {pooled} | {served} | {' | '.join(p)} | {m.seconds:.0f} |"
        )
    return out


def plot_positions(path: Path, measurements: Sequence[Measurement]) -> Path | None:
    """Acceptance by draft slot, one line per measurement (None: nothing to draw)."""
    lines: list[tuple[str, Sequence[float]]] = []
    for m in measurements:
        rates = m.stats.position_rates if m.stats is not None else m.engine_position_rates
        if rates:
            mode = "think" if m.thinking else "no think"
            lines.append((f"{m.drafter} {m.set} ({mode}, {m.engine})", rates))
    if not lines:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, slot_rates in lines:
        ax.plot(range(1, len(slot_rates) + 1), list(slot_rates), marker="o", label=label)
    ax.set(xlabel="draft slot k", ylabel="share of steps accepting slot k", ylim=(0, 1.02),
           title="Acceptance by draft position")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_report(path: Path) -> dict[str, Any]:
    """``eval.json`` back (for tools comparing runs)."""
    return dict(json.loads(Path(path).read_text()))
