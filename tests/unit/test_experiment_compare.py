"""``benchmarks.experiment.compare``: one spec of one experiment against one of another,
paired by the seeds both ran, refused where the two measured other prompts or targets."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks.experiment.compare import NotPaired, compare, lines, main, side
from benchmarks.experiment.stats import paired_tau

PROMPTS = '{"prompt": "def f():"}\n{"prompt": "x ="}\n{"prompt": "import"}\n'


def experiment(
    out: Path, spec: str, seeds: dict[int, tuple[list[float], list[list[int]], float]],
    prompts: str = PROMPTS, target: str = "/t",
) -> Path:  # fmt: skip
    """A finished experiment's files: per seed (step times, per-prompt counts, held-out
    loss) one run of ``spec``, its metrics and config, the held-out prompts."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "prompts-heldout.jsonl").write_text(prompts)
    runs = {}
    for seed, (times, counts, loss) in seeds.items():
        run_dir = out / "runs" / f"{spec}-s{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps({"target": target}))
        records = [{"step": 0, "tau": 1.0}]
        records += [{"step": i + 1, "loss": 1.0, "step_time_s": t} for i, t in enumerate(times)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        c = np.array(counts)
        runs[f"{spec}-s{seed}"] = {
            "spec": spec, "seed": seed, "config": {"target": target},
            "heldout": {"loss_all": loss, "loss": [loss]},
            "vllm": {"tau": float(1 + c[:, 1].sum() / c[:, 0].sum()),
                     "heldout": {"per_prompt": counts}},
        }  # fmt: skip
    (out / "results.json").write_text(json.dumps({"runs": runs}))
    return out


DEEP = {0: ([2.0, 2.0], [[10, 30], [10, 20], [5, 5]], 1.0),
        1: ([2.0, 3.0], [[10, 25], [10, 25], [5, 6]], 1.1),
        2: ([2.0, 2.0], [[10, 1], [10, 1], [5, 1]], 9.0)}  # fmt: skip
SHALLOW = {0: ([1.0, 1.0, 1.0], [[10, 20], [10, 10], [5, 4]], 0.9),
           1: ([1.0, 1.0, 2.0], [[10, 20], [10, 20], [5, 5]], 1.0),
           3: ([1.0, 1.0, 1.0], [[10, 0], [10, 0], [5, 0]], 5.0)}  # fmt: skip


def test_the_seeds_both_ran_are_paired_and_each_side_s_seconds_summed(tmp_path, capsys):
    a = experiment(tmp_path / "a", "deep", DEEP)
    b = experiment(tmp_path / "b", "shallow", SHALLOW)
    got = compare(side(a, "deep"), side(b, "shallow"))
    assert got["seeds"] == [0, 1]  # seed 2 ran in A only, seed 3 in B only
    assert got["cost"] == {"A": {"train_s": 4.5, "steps": 2}, "B": {"train_s": 3.5, "steps": 3}}
    counts = {w: [np.array(x[s][1]) for s in (0, 1)] for w, x in (("a", DEEP), ("b", SHALLOW))}
    assert got["paired"]["vllm_tau_heldout"] == paired_tau(counts["a"], counts["b"])
    assert got["paired"]["heldout_all"]["mean"] == pytest.approx(0.1)  # (0.1 + 0.1) / 2
    text = "\n".join(lines(got))
    assert "A / B 1.29" in text and "vllm_tau_heldout" in text
    assert main([str(a), "deep", str(b), "shallow", "--json", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["seeds"] == [0, 1]
    assert "seeds paired: [0, 1]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, says",
    [({"prompts": PROMPTS + '{"prompt": "y"}\n'}, "prompts-heldout.jsonl"),
     ({"target": "/other"}, "other targets"),
     ({"spec": "nothing"}, "no run of spec 'nothing' (it ran: ['shallow'])")],
)  # fmt: skip
def test_runs_that_are_not_pairs_are_refused_naming_why(tmp_path, change, says, capsys):
    a = experiment(tmp_path / "a", "deep", DEEP)
    kw = {k: v for k, v in change.items() if k != "spec"}
    b = experiment(tmp_path / "b", "shallow", SHALLOW, **kw)
    with pytest.raises(NotPaired, match=re.escape(says)):
        compare(side(a, "deep"), side(b, change.get("spec", "shallow")))
    assert main([str(a), "deep", str(b), change.get("spec", "shallow")]) == 2
    assert says in capsys.readouterr().err


def test_no_seed_in_both_is_refused(tmp_path):
    a = experiment(tmp_path / "a", "deep", {2: DEEP[2]})
    b = experiment(tmp_path / "b", "shallow", {3: SHALLOW[3]})
    with pytest.raises(NotPaired, match=r"no seed in both: \[2\] and \[3\]"):
        compare(side(a, "deep"), side(b, "shallow"))
