"""The batching experiment's statistics: paired bootstrap intervals, vLLM's pooled tau
resampled by seed and prompt, the distinct-4-gram measure of looping replies, the
equal-real-tokens point of a run, and the mechanism measures (acceptance by draft
position, how far and in how many directions the weights moved)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.experiment.analysis import at_tokens, reference_of
from benchmarks.experiment.looping import summarize
from benchmarks.experiment.measures import acceptance_by_position, weight_change
from benchmarks.experiment.report import looping_line
from benchmarks.experiment.stats import (
    distinct_ngram_share,
    paired_mean,
    paired_tau,
    pooled_tau,
)


def test_a_constant_difference_has_a_zero_width_interval():
    d = paired_mean([0.2] * 5, draws=500)
    assert d["mean"] == pytest.approx(0.2) and d["lo"] == pytest.approx(0.2)
    assert d["hi"] == pytest.approx(0.2) and d["separates"] and d["n"] == 5


def test_one_seed_separates_nothing():
    assert not paired_mean([0.5], draws=200)["separates"]


def test_the_interval_covers_the_mean_and_noise_does_not_separate():
    rng = np.random.default_rng(1)
    noise = rng.normal(0.0, 1.0, 5)
    d = paired_mean(noise - noise.mean() + 0.01, draws=4000)  # a tiny effect in big noise
    assert d["lo"] < d["mean"] < d["hi"] and not d["separates"]
    shifted = paired_mean(rng.normal(3.0, 0.1, 5), draws=4000)
    assert shifted["separates"] and 2.8 < shifted["lo"] < 3.0 < shifted["hi"] < 3.2


@pytest.mark.parametrize("bad", [[], [float("nan"), 1.0], [[1.0, 2.0]]])
def test_paired_mean_refuses_what_is_not_differences(bad):
    with pytest.raises(ValueError):
        paired_mean(bad)


def test_pooled_tau_is_vllms_ratio():
    counts = np.array([[10, 5], [30, 3]])
    assert pooled_tau(counts) == pytest.approx(1 + 8 / 40)


def test_paired_tau_resamples_prompts_and_seeds():
    rng = np.random.default_rng(2)
    seeds = []
    for _ in range(3):
        drafts = rng.integers(5, 20, 40)
        seeds.append(np.stack([drafts, rng.binomial(drafts, 0.3)], axis=1))
    same = paired_tau(seeds, seeds, draws=500)
    assert same["mean"] == 0.0 and same["lo"] == 0.0 == same["hi"] and not same["separates"]
    better = [np.stack([s[:, 0], np.minimum(s[:, 1] + 2, s[:, 0])], axis=1) for s in seeds]
    up = paired_tau(better, seeds, draws=500)
    want = np.mean([pooled_tau(b) - pooled_tau(s) for b, s in zip(better, seeds, strict=True)])
    assert up["mean"] == pytest.approx(want) and up["separates"] and up["lo"] > 0
    with pytest.raises(ValueError, match="alike"):
        paired_tau([seeds[0]], [seeds[0][:-1]])


def test_looping_replies_have_few_distinct_4grams():
    assert distinct_ngram_share(np.arange(50)) == 1.0
    loop = np.tile([7, 8, 9], 30)  # self.tk.tk.tk...
    assert distinct_ngram_share(loop) == pytest.approx(3 / (loop.size - 3))
    assert distinct_ngram_share(np.array([1, 2, 3])) is None


def test_looping_is_told_per_kind_of_prompt():
    # target: two function replies (one loops, one does not), one continuation under 4
    # tokens (no 4-gram) and one that loops; the text's own: every reply fine but one
    got = summarize(
        target=[0.3, 0.95, None, 0.5],
        target_kinds=["function", "function", "continuation", "continuation"],
        at_limit=[True, False, False, True],
        reference=[0.9, 1.0, 0.6, 0.85],
        reference_kinds=["function", "function", "continuation", "continuation"],
    )
    t = got["target"]
    assert t["replies"] == 3 and t["samples"] == 4 and t["at_limit"] == 0.5
    assert t["mean"] == pytest.approx((0.3 + 0.95 + 0.5) / 3)
    assert t["not_looping"] == pytest.approx(1 / 3)
    assert got["reference"]["replies"] == 4 and got["reference"]["not_looping"] == 0.75
    fn, cont = got["by_kind"]["function"], got["by_kind"]["continuation"]
    assert fn["target"]["not_looping"] == 0.5 and fn["target"]["at_limit"] == 0.5
    assert cont["target"]["replies"] == 1 and cont["target"]["samples"] == 2
    assert cont["target"]["not_looping"] == 0.0 and cont["reference"]["not_looping"] == 0.5
    line = looping_line(got["target"], got["reference"], got["by_kind"])
    assert "50% of 4 at the token limit" in line
    assert "Function prompts: the target 0.625 of their 4-grams distinct" in line
    with pytest.raises(ValueError, match="differ in length"):
        summarize([0.5], ["function"], [], [], [])


def test_equal_tokens_is_the_last_step_within_them():
    series = {"step": [1, 2, 3, 4], "loss": [4.0, 3.0, 2.0, 1.0], "real_tokens": [10, 20, 30, 40]}
    at = at_tokens(series, 25)
    assert at["step"] == 2 and at["tokens"] == 25
    assert at["train_loss"] == pytest.approx(2.5)  # the centered rolling mean at step 2
    assert at_tokens(series, 40)["step"] == 4


def test_the_reference_is_todays_default():
    assert reference_of(("sorted", "stratified", "packed")) == "stratified"
    assert reference_of(("sorted", "six")) == "sorted"


def test_acceptance_by_position_is_conditional_on_reaching_the_position():
    # 100 drafts: 80 accept token 0, 40 of those token 1, none token 2 (vLLM leaves it out)
    rates = acceptance_by_position(100, {"0": 80, "1": 40}, 4)
    assert rates == [0.8, 0.5, 0.0, None]  # position 3: no draft reached it
    tau = 1 + (80 + 40) / 100
    assert tau == pytest.approx(1 + 0.8 + 0.8 * 0.5)  # the product of the rates
    with pytest.raises(ValueError, match="do not fall"):
        acceptance_by_position(100, {0: 50, 1: 60}, 2)


def test_weight_change_tells_one_direction_from_many():
    rng = np.random.default_rng(0)
    w0 = {"a": rng.normal(size=(32, 16)), "b": rng.normal(size=(16, 16)), "norm": np.ones(16)}
    u, v = rng.normal(size=(32, 1)), rng.normal(size=(1, 16))
    last = {"a": w0["a"] + 0.1 * u @ v, "b": w0["b"] + 0.5 * np.eye(16), "norm": np.ones(16)}
    out = weight_change(w0, last)
    assert set(out["matrices"]) == {"a", "b"}  # vectors are not matrices
    assert out["matrices"]["a"]["stable_rank"] == pytest.approx(1.0)  # one direction
    assert out["matrices"]["b"]["stable_rank"] == pytest.approx(16.0)  # all 16 equally
    rel = np.linalg.norm(0.5 * np.eye(16)) / np.linalg.norm(w0["b"])
    assert out["matrices"]["b"]["relative"] == pytest.approx(rel)
    assert out["stable_rank_median"] == pytest.approx(8.5)


def test_the_mechanism_table_has_a_column_per_position_every_spec_reached():
    from benchmarks.experiment.report import _mechanism_lines

    def spec(rates, rel, rank):
        one = lambda x: {"mean": x, "min": x, "max": x, "n": 1}  # noqa: E731
        return {"vllm_by_position": [one(r) for r in rates], "weights_relative_median": one(rel),
                "weights_stable_rank_median": one(rank)}  # fmt: skip

    lines = _mechanism_lines({"packed-dpace": spec([0.5, 0.6, 0.7], 0.45, 4.1),
                              "packed-dpace-muon": spec([0.8, 0.7], 0.45, 50.1)})  # fmt: skip
    head, rows = lines[3], lines[5:]
    assert head.count("pos ") == 2  # the positions both reached
    assert rows[1].split(" | ")[1:] == ["0.800", "0.700", "0.450", "50.1 |"]
    assert _mechanism_lines({"packed": {"vllm_tau": 1}}) == []  # no weights measured
