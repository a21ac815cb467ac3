"""``python -m benchmarks.experiment.compare OUT_A SPEC_A OUT_B SPEC_B``: one spec of one
experiment against one spec of another, paired by seed (docs/EXPERIMENT.md, Part 8).

An experiment pairs the specs of its own ``OUT`` only, all at one ``--steps``. A
comparison at equal wall time needs the cheaper spec given more steps, so a second ``OUT``:
this pairs the two. Both must have measured the same held-out prompts on the same target
(else their per-prompt counts are not pairs, and it refuses); the seeds both ran are paired.
It prints each side's training seconds (its steps' own times, summed: what "equal wall
time" means here) and every paired measure ``A - B`` with its interval, as the
experiment's own contrasts are computed (``benchmarks.experiment.measures.paired``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.experiment.analysis import read_run
from benchmarks.experiment.measures import paired

#: The held-out prompts the per-prompt counts follow, in ``OUT/data``.
HELDOUT = "prompts-heldout.jsonl"


class NotPaired(ValueError):
    """The two experiments' runs cannot be paired: what differs, and where."""


def side(out: Path, spec: str) -> dict[str, Any]:
    """``spec``'s runs in experiment ``out`` by seed, with each run's training seconds, and
    what the pairing must match (the target, the held-out prompts' digest)."""
    results = json.loads((out / "results.json").read_text())
    runs = {r["seed"]: r for r in results["runs"].values() if r["spec"] == spec}
    if not runs:
        ran = sorted({r["spec"] for r in results["runs"].values()})
        raise NotPaired(f"{out / 'results.json'}: no run of spec {spec!r} (it ran: {ran})")
    train_s, steps = {}, {}
    for seed in runs:
        _, records = read_run(out / "runs" / f"{spec}-s{seed}")
        train_s[seed], steps[seed] = sum(r["step_time_s"] for r in records), len(records)
    prompts = out / "data" / HELDOUT
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest() if prompts.is_file() else None
    targets = {r["config"]["target"] for r in runs.values()}
    return {"out": str(out), "spec": spec, "runs": runs, "train_s": train_s, "steps": steps,
            "heldout": digest, "target": targets}  # fmt: skip


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Every measure both sides have, ``a - b`` paired by the seeds both ran, each side's
    mean training seconds and steps; NotPaired when the two cannot be paired."""
    if a["target"] != b["target"] or len(a["target"]) != 1:
        raise NotPaired(f"other targets: {sorted(a['target'])} against {sorted(b['target'])}")
    if a["heldout"] is None or a["heldout"] != b["heldout"]:
        raise NotPaired(f"{a['out']}/data/{HELDOUT} and {b['out']}/data/{HELDOUT} differ "
                        "(or one is missing): the per-prompt counts are not pairs")  # fmt: skip
    seeds = sorted(a["runs"].keys() & b["runs"].keys())
    if not seeds:
        raise NotPaired(f"no seed in both: {sorted(a['runs'])} and {sorted(b['runs'])}")
    runs = {f"{name}-s{s}": {**x["runs"][s], "spec": name}
            for name, x in (("A", a), ("B", b)) for s in seeds}  # fmt: skip

    def mean(x: dict[str, Any], key: str) -> float:
        return statistics.mean(x[key][s] for s in seeds)

    cost = {name: {"train_s": mean(x, "train_s"), "steps": mean(x, "steps")}
            for name, x in (("A", a), ("B", b))}  # fmt: skip
    return {"A": f"{a['out']}:{a['spec']}", "B": f"{b['out']}:{b['spec']}", "seeds": seeds,
            "cost": cost, "paired": paired(runs, "A", "B", seeds)}  # fmt: skip


def lines(result: dict[str, Any]) -> list[str]:
    """The comparison as text: the two sides, their cost, then each measure's ``A - B``."""
    cost = result["cost"]
    out = [f"A = {result['A']}", f"B = {result['B']}",
           f"seeds paired: {result['seeds']}",
           f"steps, A {cost['A']['steps']:.0f}, B {cost['B']['steps']:.0f}; training seconds "
           f"(the steps' own times), A {cost['A']['train_s']:.1f}, B {cost['B']['train_s']:.1f}: "
           f"A / B {cost['A']['train_s'] / cost['B']['train_s']:.2f}",
           f"{'measure, A - B':<32} {'mean':>9} {'95% interval':>22}"]  # fmt: skip
    for name, p in result["paired"].items():
        mark = "  separates" if p["separates"] else ""
        out.append(f"{name:<32} {p['mean']:>+9.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]{mark}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_a", type=Path)
    ap.add_argument("spec_a")
    ap.add_argument("out_b", type=Path)
    ap.add_argument("spec_b")
    ap.add_argument("--json", type=Path, help="Also write the comparison here.")
    args = ap.parse_args(argv)
    try:
        result = compare(side(args.out_a, args.spec_a), side(args.out_b, args.spec_b))
    except (NotPaired, FileNotFoundError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
