"""The race's summary over its pairs (``benchmarks/bench_vs_speculators.py``): per
measure ours, theirs and the ratio ours / theirs; the vLLM-served tau of each of our runs
(``ours``, ``ours-online``, ``ours-longer``) against theirs, with the paired interval; and
the table it prints."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return {"mean": statistics.mean(r), "min": min(r), "max": max(r)}


def summarize(runs: list[dict[str, Any]], data: dict[str, Any]) -> dict[str, Any]:
    """Per measure: ours and theirs over pairs, and the ratio ours / theirs."""

    def col(who: str, f: Any) -> list[float]:
        return [float(f(p[who])) for p in runs]

    measures = {
        "tokens_per_s": lambda r: r["tokens"] / r["step_s"],
        "wall_s": lambda r: r["wall_s"],
        "rss_peak_gb": lambda r: r["rss_peak_gb"],
        "tokens": lambda r: r["tokens"],
        "steps": lambda r: r["steps"],
    }
    out: dict[str, Any] = {}
    for name, f in measures.items():
        ours, theirs = col("ours", f), col("theirs", f)
        out[name] = {"ours": ours, "theirs": theirs, "ratio": ratio(ours, theirs)}
    gen = data["generation_s"]  # made once; every run of theirs needs it
    ours_e2e = col("ours", lambda r: r["wall_s"])
    theirs_e2e = [w + gen for w in col("theirs", lambda r: r["wall_s"])]
    out["wall_with_generation_s"] = {"ours": ours_e2e, "theirs": theirs_e2e,
                                     "ratio": ratio(ours_e2e, theirs_e2e)}  # fmt: skip
    # Ours with the target's forward taken out (measured apart over the same rows), against
    # theirs, which reads the target's states from files: the drafters' training alone.
    target_s = data["target_epoch_s"] * runs[0]["ours"]["epochs"]
    alone = col("ours", lambda r: r["tokens"] / max(r["step_s"] - target_s, 1e-9))
    theirs_tps = out["tokens_per_s"]["theirs"]
    out["tokens_per_s_without_target"] = {"ours": alone, "theirs": theirs_tps,
                                          "ratio": ratio(alone, theirs_tps)}  # fmt: skip
    out["tau"] = tau(runs, "ours")
    if all("ours-online" in p for p in runs):  # --online: ours fed by vLLM, against the same
        for name in ("tokens_per_s", "rss_peak_gb"):
            online = col("ours-online", measures[name])
            theirs = out[name]["theirs"]
            out[f"online {name}"] = {"ours": online, "theirs": theirs,
                                     "ratio": ratio(online, theirs)}  # fmt: skip
        online = col("ours-online", lambda r: r["wall_s"])
        out["online wall_with_generation_s"] = {"ours": online, "theirs": theirs_e2e,
                                                "ratio": ratio(online, theirs_e2e)}  # fmt: skip
        out["online tau"] = tau(runs, "ours-online")
    if all("ours-longer" in p for p in runs):  # --longer: ours trained for more epochs
        for name in ("wall_s", "tokens"):
            longer, theirs = col("ours-longer", measures[name]), out[name]["theirs"]
            out[f"longer {name}"] = {"ours": longer, "theirs": theirs,
                                     "ratio": ratio(longer, theirs)}  # fmt: skip
        out["longer tau"] = tau(runs, "ours-longer")
    return {k: v for k, v in out.items() if v is not None}


def tau(runs: list[dict[str, Any]], ours: str) -> dict[str, Any] | None:
    """Served tau of ``ours`` (a run of each pair) and theirs, the ratio, and the paired
    difference with its interval (None where the pairs measured none)."""
    if not all("served" in p[ours] for p in runs):
        return None
    from benchmarks.experiment.stats import paired_tau

    ours_t = [float(p[ours]["tau"]) for p in runs]
    theirs_t = [float(p["theirs"]["tau"]) for p in runs]
    counts = {w: [np.array(p[w]["served"]) for p in runs] for w in (ours, "theirs")}
    return {"ours": ours_t, "theirs": theirs_t, "ratio": ratio(ours_t, theirs_t),
            "difference": paired_tau(counts[ours], counts["theirs"])}  # fmt: skip


def report(summary: dict[str, Any], pairs: int) -> None:
    print(f"\n== ours / theirs over {pairs} interleaved pairs (per pair: mean [min, max])")
    print(f"{'measure':<24} {'ours':>22} {'theirs':>22} {'ours/theirs':>26}")
    for name, m in summary.items():
        if name.endswith("tau") or not isinstance(m, dict):
            continue
        row = [f"{statistics.mean(m[w]):.4g} [{min(m[w]):.4g}, {max(m[w]):.4g}]"
               for w in ("ours", "theirs")]  # fmt: skip
        r = m["ratio"]
        print(f"{name:<24} {row[0]:>22} {row[1]:>22} "
             f"{r['mean']:>8.3f} [{r['min']:.3f}, {r['max']:.3f}]")  # fmt: skip
    for key, label in (("tau", "vLLM-served tau"), ("online tau", "online: vLLM-served tau"),
                       ("longer tau", "longer: vLLM-served tau")):  # fmt: skip
        if key not in summary:
            continue
        t = summary[key]
        d = t["difference"]
        print(f"{label:<24} {statistics.mean(t['ours']):>22.3f} "
             f"{statistics.mean(t['theirs']):>22.3f} {t['ratio']['mean']:>8.3f} "
             f"[{t['ratio']['min']:.3f}, {t['ratio']['max']:.3f}]")  # fmt: skip
        verdict = "separates" if d["separates"] else "does not separate"
        print(f"{key} ours - theirs: {d['mean']:+.3f}, 95% interval [{d['lo']:+.3f}, "
             f"{d['hi']:+.3f}] ({verdict})")  # fmt: skip
