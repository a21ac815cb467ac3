"""Evaluation sets during training, the pure parts: ``--eval-sets`` read as (name, path)
pairs; the record keys ``tau/NAME`` on the dashboards and in the summary; ``export --best``
choosing the kept checkpoint with the highest ``tau/NAME`` (ties: the later step), and its
errors naming what was measured and what is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.eval.sets import parse_sets
from trainer.hf.export import best_step
from trainer.train.metrics import summarize
from trainer.train.trackers import scalars


def test_eval_sets_are_comma_separated_or_repeated_and_a_path_may_hold_a_comma():
    got = parse_sets(("gsm8k=a.jsonl, mt-bench=b,c.jsonl,humaneval", "mine=d.json"), "--eval-sets")
    assert got == [
        ("gsm8k", Path("a.jsonl")), ("mt-bench", Path("b,c.jsonl")), ("humaneval", None),
        ("mine", Path("d.json")),
    ]  # fmt: skip
    assert parse_sets((), "--eval-sets") == []


@pytest.mark.parametrize(
    "values, says",
    [
        (("gsm8k",), "--eval-sets 'gsm8k': give the set's file as NAME=PATH"),
        (("gsm8k=a.jsonl", "gsm8k=b.jsonl"), "--eval-sets: the set 'gsm8k' is named twice"),
        (("bad name=a.jsonl",), "--eval-sets 'bad name=a.jsonl': the name before '='"),
        (("gsm8k=",), "--eval-sets 'gsm8k=': no file after '='"),
    ],
)
def test_a_bad_eval_set_is_one_line_naming_the_option(values, says):
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(")):
        parse_sets(values, "--eval-sets")


def test_set_figures_are_eval_scalars_and_their_last_value_is_in_the_summary():
    rec = {"step": 4, "tau": 1.5, "tau/gsm8k": 2.25, "tau_pooled/gsm8k": 2.0, "eval_s": 1.0}
    assert scalars(rec) == {"eval/tau": 1.5, "eval/tau/gsm8k": 2.25,
                            "eval/tau_pooled/gsm8k": 2.0, "eval/eval_s": 1.0}  # fmt: skip
    first = {"step": 0, "tau": 1.0, "tau/gsm8k": 1.0, "tau/mt-bench": 1.1}
    summary = summarize([first, {"step": 2, "loss": 3.0, "step_time_s": 0.1,
                                 "data_wait_frac": 0.0, "data_wait_frac_max": 0.0,
                                 "tokens_per_s": 10.0}, rec])  # fmt: skip
    assert summary["last_tau/gsm8k"] == 2.25 and summary["last_tau/mt-bench"] == 1.1
    assert summary["first_tau"] == 1.0 and summary["last_tau"] == 1.5


def records(**taus: dict[int, float]) -> list[dict]:
    """Metrics records of steps 0..6 with ``tau/NAME`` at the steps given per set."""
    out = [{"step": s, "loss": 1.0} for s in range(7)]
    for name, by_step in taus.items():
        for step, value in by_step.items():
            out[step][f"tau/{name.replace('_', '-')}"] = value
    return out


def test_best_picks_the_kept_checkpoint_with_the_highest_tau_of_the_set():
    recs = records(gsm8k={0: 9.0, 2: 2.5, 4: 3.0, 6: 2.75}, mt_bench={2: 4.0, 4: 1.0})
    best = best_step(recs, [2, 4, 6], "gsm8k", "m.jsonl")  # step 0 (9.0) has no checkpoint
    assert (best.step, best.key, best.value) == (4, "tau/gsm8k", 3.0)
    assert best.reason() == "best tau/gsm8k = 3 at step 4"
    assert best_step(recs, [2, 4, 6], "mt-bench", "m.jsonl").step == 2
    assert best_step(recs, [2, 6], "gsm8k", "m.jsonl").step == 6  # step 4 not kept


def test_a_tie_goes_to_the_later_step():
    recs = records(gsm8k={2: 2.5, 4: 2.5, 6: 2.0})
    assert best_step(recs, [2, 4, 6], "gsm8k", "m.jsonl").step == 4


def test_a_set_never_measured_names_the_sets_that_were():
    recs = records(gsm8k={2: 2.0}, mt_bench={2: 1.5})
    with pytest.raises(ValueError) as err:
        best_step(recs, [2], "humaneval", "run/metrics.jsonl")
    assert str(err.value) == (
        "--best humaneval: run/metrics.jsonl holds no tau/humaneval; the sets measured: "
        "gsm8k, mt-bench"
    )
    with pytest.raises(ValueError, match=r"no evaluation set was measured .*--eval-sets"):
        best_step(records(), [2], "gsm8k", "run/metrics.jsonl")


def test_no_kept_checkpoint_measured_says_which_steps_were_measured_and_which_are_kept():
    recs = records(gsm8k={0: 1.0, 2: 2.0, 4: 3.0})
    with pytest.raises(ValueError) as err:
        best_step(recs, [3, 5], "gsm8k", "m.jsonl")
    assert str(err.value).startswith(
        "--best gsm8k: no kept checkpoint has a tau/gsm8k measurement (tau/gsm8k measured at "
        "steps 0, 2, 4; checkpoints kept at steps 3, 5)"
    )
    many = [{"step": s, "tau/gsm8k": 1.0} for s in range(0, 1000, 10)]
    with pytest.raises(ValueError) as err:
        best_step(many, [5], "gsm8k", "m.jsonl")
    listed = "steps 0, 10, 20, 30, ..., 960, 970, 980, 990 (100 steps); checkpoints kept"
    assert f"{listed} at steps 5)" in str(err.value)
