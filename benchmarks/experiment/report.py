"""Tables and plots of the batching experiment, from its results dict alone
(``benchmarks.experiment.analysis.analyse``): ``results.md`` and four PNGs (matplotlib, Agg).

* ``experiment-loss.png``: training loss of every spec (first seed), raw (thin) and as a
  21-step rolling mean (thick), and the rolling std of the loss around that mean (how
  spiky the curve is at each point of the run).
* ``experiment-heldout.png``: held-out loss per length band, and its difference to
  ``shuffled`` (bars: mean over seeds; whiskers: min..max).
* ``experiment-jumps.png``: histogram of the step-to-step loss changes.
* ``experiment-mix.png``: each step's share of long (hard) samples against its loss
  residual: why a step spikes.
* ``experiment-tau.png`` (``--corpus text``): the verifier's tau over training (mean over
  seeds, whiskers min..max).
* ``experiment-forgetting.png`` (``--corpus text``): the shortest band's held-out loss at
  every checkpoint (first seed), over the share of long-only steps between checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.experiment.arms import color, label
from benchmarks.experiment.measures import rolling_mean

#: The paired table's columns: (measure in ``results["paired"][spec]``, header, digits).
PAIRED = (
    ("vllm_tau_heldout", "vLLM tau, all held-out", 3),
    ("tau_final", "tau final (verifier)", 3),
    ("humaneval_tau", "HumanEval tau", 3),
    ("heldout_all", "held-out loss", 3),
    ("heldout_all_at_equal_tokens", "held-out loss, equal real tokens", 3),
    ("train_loss_at_equal_tokens", "train loss, equal real tokens", 3),
    ("diff_std", "std of step change", 4),
)


def _paired_table(results: dict[str, Any], rows: dict[str, dict], title: str) -> list[str]:
    """One table of paired differences: a row per name, a column per measure any row has."""
    names = band_names(results)
    cols = [c for c in PAIRED if any(c[0] in p for p in rows.values())]
    at = next((i + 1 for i, c in enumerate(cols) if c[0] == "heldout_all"), len(cols))
    cols[at:at] = [(f"heldout_band{b}", f"held-out loss {n}", 3) for b, n in enumerate(names)]
    lines = ["", title, "", "| spec | " + " | ".join(h for _, h, _ in cols) + " |",
             "|---|" + "---|" * len(cols)]  # fmt: skip
    for name, p in rows.items():
        cells = [_interval(p[k], d) if k in p else "-" for k, _, d in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def fmt(stat: dict[str, Any], digits: int = 3) -> str:
    """``mean`` for one seed, ``mean (min..max)`` for several, ``-`` for none."""
    if stat["n"] == 0:
        return "-"
    text = f"{stat['mean']:.{digits}f}"
    if stat["n"] > 1:
        text += f" ({stat['min']:.{digits}f}..{stat['max']:.{digits}f})"
    return text


def band_names(results: dict[str, Any]) -> list[str]:
    return [f"{b['min_len']}-{b['max_len']}" for b in results["corpus"]["bands"]]


def markdown(results: dict[str, Any]) -> str:
    """The two result tables (training spikiness; held-out loss per band)."""
    cfg, summary = results["config"], results["summary"]
    seeds = ", ".join(str(s) for s in cfg["seeds"])
    lines = [
        f"Seeds {seeds}; {cfg['steps']} steps of {cfg['grad_accum']} micro-batches of "
        f"<= {cfg['token_budget']} tokens; spikiness after the first {cfg['burn_in']:.0%} of "
        "steps. Several seeds: mean (min..max).",
        "",
        "| spec | step mix dist | comp. repeat | padding eff. | std of step change | "
        "largest jump | jumps > 2σ pooled | resid. std | steps with no short sample | "
        "corr(resid, long share) | final train loss | real tokens trained |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, s in summary.items():
        cells = [
            fmt(s["step_mix_distance"]),
            fmt(s["composition_repeat"]),
            fmt(s["padding_efficiency"]),
            fmt(s["diff_std"], 4),
            fmt(s["max_jump"]),
            fmt(s["spike_frac"]),
            fmt(s["resid_std"], 4),
            fmt(s["all_hard_frac"]),
            fmt(s["corr_resid_hard"], 2),
            fmt(s["final_loss"]),
            fmt(s["real_tokens"], 0),
        ]
        lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    names = band_names(results)
    lines += [
        "",
        "Held-out weighted block CE per length band (quartiles of held-out lengths; share of "
        f"long samples, >= {results['corpus']['split_len']:.0f} tokens, in brackets):",
        "",
        "| spec | "
        + " | ".join(
            f"{n} ({b['hard_frac']:.0%})"
            for n, b in zip(names, results["corpus"]["bands"], strict=True)
        )
        + " | all |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    if results.get("untrained"):
        u = results["untrained"]
        lines.append(
            "| untrained drafter | "
            + " | ".join(f"{x:.3f}" for x in u["loss"])
            + f" | {u['loss_all']:.3f} |"
        )
    for spec, s in summary.items():
        cells = [fmt(b) for b in s["heldout_band"]] + [fmt(s["heldout_all"])]
        lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    if "tau_final" in next(iter(summary.values())):
        lines += _tau_lines(results)
        lines += _mechanism_lines(summary)
    lines += paired_lines(results)
    return "\n".join(lines) + "\n"


def _mechanism_lines(summary: dict[str, Any]) -> list[str]:
    """Where a spec's acceptance moves (vLLM's conditional acceptance at each draft
    position, all held-out prompts) and how far and in how many directions its optimizer
    moved the drafter's matrices (first checkpoint to last; medians over the matrices)."""
    if not all("weights_relative_median" in s for s in summary.values()):
        return []
    served = all("vllm_by_position" in s for s in summary.values())
    n = min(len(s["vllm_by_position"]) for s in summary.values()) if served else 0
    lines = [
        "",
        "Where acceptance moves and how the weights move: vLLM's acceptance at each draft "
        "position, of the drafts that reached it (all held-out prompts); the drafter's "
        "matrices from the first checkpoint to the last, ||dW|| / ||W|| and the stable rank "
        "||dW||_F^2 / ||dW||_2^2 of the change (medians over the matrices):",
        "",
        "| spec | "
        + "".join(f"pos {k + 1} | " for k in range(n))
        + "relative change | stable rank of the change |",
        "|---|" + "---|" * (n + 2),
    ]
    for spec, s in summary.items():
        cells = [fmt(s["vllm_by_position"][k]) for k in range(n)]
        cells += [fmt(s["weights_relative_median"]), fmt(s["weights_stable_rank_median"], 1)]
        lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    return lines


def _interval(d: dict[str, Any], digits: int) -> str:
    mark = " *" if d["separates"] else ""
    return f"{d['mean']:+.{digits}f} [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]{mark}"


def paired_lines(results: dict[str, Any]) -> list[str]:
    """Each spec minus the reference (the padded default before packed rows) per seed: the
    mean and its bootstrap 95% interval (``benchmarks.experiment.stats``), * where it
    excludes 0; then the contrasts (``arms.CONTRASTS``) alike."""
    ref, paired = results["reference"], results["paired"]
    if not paired:
        return []
    seeds = len(results["config"]["seeds"])
    lines = _paired_table(
        results, {label(s): p for s, p in paired.items()},
        f"Paired by seed ({seeds}), minus {label(ref)}: mean [bootstrap 95% "
        "interval]; * where the interval excludes 0 (vLLM tau: prompts resampled too). "
        "Lower is better for losses, higher for tau.",
    )  # fmt: skip
    contrasts = results.get("contrasts") or {}
    if contrasts:
        lines += _paired_table(
            results, contrasts, f"Contrasts, paired by seed ({seeds}) alike: spec - spec."
        )
    grams = results["corpus"].get("heldout_replies_distinct_4grams")
    if grams and grams["mean"] is not None:
        lines += [
            "",
            looping_line(
                grams,
                results["corpus"].get("heldout_references_distinct_4grams"),
                results["corpus"].get("heldout_looping_by_kind"),
            ),
        ]
    return lines


def looping_line(
    target: dict[str, Any],
    reference: dict[str, Any] | None,
    by_kind: dict[str, dict[str, Any]] | None = None,
) -> str:
    """How much the target's held-out replies loop, beside the text's own, and per kind of
    prompt (``benchmarks.experiment.looping``)."""

    def said(g: dict[str, Any]) -> str:
        if g["mean"] is None:
            return "no reply of 4 tokens"
        kept = g.get("not_looping")
        share = "" if kept is None else f", {kept:.0%} with at least 80% distinct"
        return f"{g['mean']:.3f} of their 4-grams distinct, mean over {g['replies']} replies{share}"

    def limit(g: dict[str, Any]) -> str:
        if g.get("at_limit") is None:
            return ""
        return f", {g['at_limit']:.0%} of {g['samples']} at the token limit"

    line = f"The target's held-out replies: {said(target)}{limit(target)} (1.0: nothing repeats)."
    if reference is not None:
        line += f" The text's own replies to the same prompts: {said(reference)}."
    for kind, g in (by_kind or {}).items():
        line += f" {kind.capitalize()} prompts: the target {said(g['target'])}{limit(g['target'])}"
        line += f"; the text {said(g['reference'])}."
    return line


def _tau_lines(results: dict[str, Any]) -> list[str]:
    summary = results["summary"]
    lines = [
        "",
        "Acceptance length and forgetting (tau: the trainer's verifier on the held-out "
        "prompts, tokens per target step, z-lab's per-prompt mean; served: pooled over the "
        "steps a server runs, and vLLM's 1 + accepted / drafts on the same prompts; vLLM, "
        "all held-out: vLLM on every held-out prompt, 64 tokens each; HumanEval: z-lab's tau "
        "on HumanEval problems by dflash-train eval; Δ short: "
        "change of the shortest band's held-out loss between checkpoints, over intervals "
        "with at least half of the steps long-only, and over the others):",
        "",
        "| spec | tau untrained | tau final | served, verifier | served, vLLM "
        "| vLLM, all held-out | HumanEval | held-out acc. | intervals long-only "
        "| Δ short, long-only | Δ short, mixed | corr(Δ short, long-only share) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, s in summary.items():
        cells = [
            fmt(s["tau_start"]),
            fmt(s["tau_final"]),
            fmt(s["tau_served_final"]),
            fmt(s["vllm_tau"]) if "vllm_tau" in s else "not run",
            fmt(s["vllm_tau_heldout"]) if "vllm_tau_heldout" in s else "not run",
            fmt(s["humaneval_tau"]) if "humaneval_tau" in s else "not run",
            fmt(s["heldout_acc_all"]),
            fmt(s["long_intervals"], 1),
            fmt(s["delta_long"], 4),
            fmt(s["delta_mixed"], 4),
            fmt(s["forgetting_corr"], 2),
        ]
        lines.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    lines += _served_lines(results)
    return lines


def _served_lines(results: dict[str, Any]) -> list[str]:
    """Whether vLLM's acceptance equals the verifier's ``tau_served``, run by run."""
    # An engine-fed run has no verifier's tau (its decoder is in the engine).
    runs = {k: r for k, r in results["runs"].items() if "vllm" in r and r["tau"]["tau_served"]}
    if not runs:
        return []
    differ = {
        k: (r["vllm"]["tau"], r["tau"]["tau_served"][-1])
        for k, r in runs.items()
        if abs(r["vllm"]["tau"] - r["tau"]["tau_served"][-1]) > 1e-9
    }
    drafts = sum(r["vllm"]["drafts"] for r in runs.values())
    text = (
        f"vLLM served {len(runs)} drafters ({drafts} drafts): its acceptance length equals "
        f"the verifier's served tau in {len(runs) - len(differ)} of {len(runs)}"
    )
    if differ:
        text += "; differ (vLLM, verifier): " + ", ".join(
            f"{k} {a:.4f}/{b:.4f}" for k, (a, b) in sorted(differ.items())
        )
    return ["", text + "."]


def write_report(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``results.md`` and the PNGs in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    md = out_dir / "results.md"
    md.write_text(markdown(results))
    return [md, *plot_all(results, out_dir)]


def _first_seed_runs(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    seed = results["config"]["seeds"][0]
    return {r["spec"]: r for r in results["runs"].values() if r["seed"] == seed}


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """The PNGs of ``results`` in ``out_dir`` (the module docstring's); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    runs = _first_seed_runs(results)
    seed = results["config"]["seeds"][0]
    save(_plot_loss(plt, runs, seed), "experiment-loss.png")
    save(_plot_heldout(plt, results), "experiment-heldout.png")
    save(_plot_jumps(plt, runs, seed), "experiment-jumps.png")
    save(_plot_mix(plt, runs, seed), "experiment-mix.png")
    if all("tau" in r for r in results["runs"].values()):
        save(_plot_tau(plt, results), "experiment-tau.png")
        save(_plot_forgetting(plt, runs, seed), "experiment-forgetting.png")
    return written


def _plot_loss(plt: Any, runs: dict[str, dict[str, Any]], seed: int) -> Any:
    """Training loss of every spec, raw and rolling mean, over its rolling std."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for spec, r in runs.items():
        step, loss = np.array(r["series"]["step"]), np.array(r["series"]["loss"])
        smooth = rolling_mean(loss)
        c = color(spec)
        ax1.plot(step, loss, color=c, lw=0.6, alpha=0.35)
        ax1.plot(step, smooth, color=c, lw=1.8, label=label(spec))
        ax2.plot(step, np.sqrt(rolling_mean((loss - smooth) ** 2)), color=c, lw=1.8)
    ax1.set(ylabel="training loss (weighted block CE)", title=f"training loss, seed {seed}")
    ax1.legend()
    ax2.set(xlabel="optimizer step", ylabel="rolling std of loss around its trend")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return fig


def _plot_jumps(plt: Any, runs: dict[str, dict[str, Any]], seed: int) -> Any:
    """Histogram of every spec's step-to-step loss changes."""
    fig, ax = plt.subplots(figsize=(7, 4))
    diffs = {s: np.diff(r["series"]["loss"]) for s, r in runs.items()}
    lim = max(float(np.abs(d).max()) for d in diffs.values())
    bins = np.linspace(-lim, lim, 41)
    for spec, d in diffs.items():
        ax.hist(d, bins=bins, histtype="step", lw=1.6, color=color(spec), label=spec)
    ax.set(
        xlabel="loss(t) - loss(t-1)", ylabel="steps", title=f"step-to-step loss change, seed {seed}"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _plot_mix(plt: Any, runs: dict[str, dict[str, Any]], seed: int) -> Any:
    """Each step's share of long samples against its loss residual, every spec."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec, r in runs.items():
        loss = np.array(r["series"]["loss"])
        ax.scatter(
            r["series"]["hard_frac"],
            loss - rolling_mean(loss),
            s=8,
            alpha=0.6,
            color=color(spec),
            label=label(spec),
        )
    ax.set(
        xlabel="share of the step's samples that are long (hard)",
        ylabel="loss - rolling mean",
        title=f"why steps spike: length mix vs loss residual, seed {seed}",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _plot_tau(plt: Any, results: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in results["summary"]:
        mine = [r["tau"] for r in results["runs"].values() if r["spec"] == spec]
        if not mine or not mine[0]["step"]:  # engine-fed: no tau while training
            continue
        step = np.array(mine[0]["step"])
        tau = np.array([m["tau"] for m in mine if m["step"] == mine[0]["step"]])
        mean = tau.mean(0)
        err = np.vstack([mean - tau.min(0), tau.max(0) - mean])
        ax.errorbar(step, mean, yerr=err, capsize=3, marker="o", ms=3, lw=1.6,
                    color=color(spec), label=label(spec))  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="tau (tokens per target step)",
           title="acceptance length on held-out prompts (mean, min..max over seeds)")  # fmt: skip
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _plot_forgetting(plt: Any, runs: dict[str, dict[str, Any]], seed: int) -> Any:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for spec, r in runs.items():
        f = r["forgetting"]
        c, steps = color(spec), np.array(f["steps"])
        ax1.plot(steps, f["short_loss"], marker="o", ms=3, color=c, label=label(spec))
        mid = (steps[:-1] + steps[1:]) / 2
        ax2.plot(mid, f["long_only"], marker="o", ms=3, color=c)
    ax1.set(ylabel="held-out loss, shortest band", title=f"forgetting probe, seed {seed}")
    ax1.legend(fontsize=8)
    ax2.set(xlabel="optimizer step", ylabel="share of long-only steps\nsince last checkpoint")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return fig


def paired_delta(results: dict[str, Any], spec: str, ref: str) -> np.ndarray:
    """Per seed, held-out loss (bands, then all) of ``spec`` minus ``ref``'s: [seeds, B+1]."""
    out = []
    for seed in results["config"]["seeds"]:
        by_spec = {r["spec"]: r["heldout"] for r in results["runs"].values() if r["seed"] == seed}
        a, b = by_spec[spec], by_spec[ref]
        out.append(np.array([*a["loss"], a["loss_all"]]) - np.array([*b["loss"], b["loss_all"]]))
    return np.array(out)


def _plot_heldout(plt: Any, results: dict[str, Any]) -> Any:
    summary = results["summary"]
    names = [*band_names(results), "all"]
    x = np.arange(len(names))
    width = 0.8 / max(len(summary), 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))

    def values(spec: str, key: str) -> np.ndarray:
        s = summary[spec]
        return np.array([b[key] for b in s["heldout_band"]] + [s["heldout_all"][key]])

    ref = results["reference"]
    for k, spec in enumerate(summary):
        mean = values(spec, "mean")
        err = np.vstack([mean - values(spec, "min"), values(spec, "max") - mean])
        kw = {"color": color(spec), "label": label(spec), "width": width}
        pos = x + (k - (len(summary) - 1) / 2) * width
        ax1.bar(pos, mean, yerr=err, capsize=2, **kw)
        delta = paired_delta(results, spec, ref)  # [seeds, bands + 1]
        d_err = np.vstack([delta.mean(0) - delta.min(0), delta.max(0) - delta.mean(0)])
        ax2.bar(pos, delta.mean(0), yerr=d_err, capsize=2, **kw)
    ax1.set(xticks=x, xticklabels=names, xlabel="held-out length band (tokens)")
    ax1.set(ylabel="held-out weighted block CE", title="held-out loss per length band")
    ax2.set(xticks=x, xticklabels=names, xlabel="held-out length band (tokens)")
    ax2.set(ylabel=f"difference to {ref}", title=f"held-out loss minus {ref} (lower is better)")
    ax2.axhline(0, color="black", lw=0.8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    return fig
