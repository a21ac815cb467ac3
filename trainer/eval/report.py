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
    agree = agreement(measurements, s.greedy)
    if agree:
        lines += ["", "## vLLM against our served tau", "", *agree]
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
    """Rows: each drafter by our ``tau`` (z-lab's protocol); where vLLM measured it too, our
    served tau and vLLM's (the protocol an engine reports) beside it."""
    engine = any(m.engine == "vllm" for m in ms)
    rows: dict[str, dict[str, float | None]] = {}
    for m in ms:
        if m.engine == "vllm":
            rows.setdefault(f"{m.drafter} (vLLM, served)", {})[m.set] = m.engine_tau
            continue
        s = m.stats  # None: no prompt of this cell was measured (a dash)
        rows.setdefault(f"{m.drafter} (ours)", {})[m.set] = None if s is None else s.tau
        if engine:
            served = None if s is None else s.tau_served
            rows.setdefault(f"{m.drafter} (ours, served)", {})[m.set] = served
    out = ["| Drafter | " + " | ".join(names) + " | Mean |", "|---" * (len(names) + 2) + "|"]
    for label, by_set in rows.items():
        vals = [by_set.get(n) for n in names]
        cells = ["-" if v is None else f"{v:.2f}" for v in vals]
        got = [v for v in vals if v is not None]
        mean = f"{sum(got) / len(got):.2f}" if got else "-"
        out.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")
    return out


def agreement(ms: Sequence[Measurement], greedy: bool) -> list[str]:
    """vLLM against our served tau, per set: equal at temperature 0 (to 1e-9), else inside
    our 95% interval."""
    ours = {(m.drafter, m.set, m.thinking): m.stats for m in ms if m.stats is not None}
    out = []
    for m in ms:
        st = ours.get((m.drafter, m.set, m.thinking))
        if m.engine != "vllm" or m.engine_tau is None or st is None:
            continue
        if greedy:
            ok = abs(m.engine_tau - st.tau_served) <= 1e-9
            how = "equal" if ok else "NOT equal"
            out.append(f"- {m.drafter} on {m.set}: vLLM {m.engine_tau:.4f}, ours "
                       f"{st.tau_served:.4f}: {how}")  # fmt: skip
        else:
            lo, hi = st.tau_served_ci
            ok = lo <= m.engine_tau <= hi
            how = "inside" if ok else "OUTSIDE"
            out.append(f"- {m.drafter} on {m.set}: vLLM {m.engine_tau:.4f} {how} our "
                       f"[{lo:.4f}, {hi:.4f}]")  # fmt: skip
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
