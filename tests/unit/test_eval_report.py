"""The eval report's pure parts: the protocols by hand (z-lab's mean of means against the
pooled and served counts, slot rates, a seeded interval) and the table with vLLM's rows and
the agreement it states."""

from __future__ import annotations

import torch

from trainer.eval.report import agreement, markdown
from trainer.eval.runner import EvalSettings, Measurement
from trainer.eval.tau_counting import position_rates, summarize
from trainer.model.speculate import Sampling
from trainer.model.verifier import SpecResult


def result(lengths: list[int], served: int | None = None) -> SpecResult:
    served = len(lengths) if served is None else served
    return SpecResult(torch.zeros(sum(lengths), dtype=torch.long), lengths, served_steps=served,
                      committed=sum(lengths[:served]))  # fmt: skip


def test_protocols_by_hand():
    rs = [result([4, 4]), result([1, 1, 1, 1, 2, 2], served=5)]
    p = summarize(rs, block_size=4, seed=0)
    assert p.tau == (4.0 + 8 / 6) / 2  # the mean of each response's mean
    assert p.tau_pooled == 16 / 8  # all lengths over all steps
    assert p.tau_served == (8 + 6) / (2 + 5)  # the served steps only
    assert p.tau_ci[0] <= p.tau <= p.tau_ci[1]
    assert p == summarize(rs, block_size=4, seed=0)  # the interval is seeded
    # slot k accepted when the length is > k: lengths 4,4,1,1,1,1,2 over the served steps
    assert position_rates(rs, 4) == (3 / 7, 2 / 7, 2 / 7)


def cell(engine: str, tau_served: float | None, **kw) -> Measurement:
    m = Measurement("d", "gsm8k", False, engine, 2, 0, 4, 1.0, **kw)
    if engine == "ours":
        m.stats = summarize([result([3, 3]), result([2, 3])], 4)
    else:
        m.engine_tau = tau_served
    return m


def test_the_table_puts_vllm_beside_our_served_tau_and_states_the_agreement():
    ours = cell("ours", None)
    same = cell("vllm", ours.stats.tau_served)
    md = markdown([ours, same], EvalSettings(), {"gsm8k": "gsm8k: 2 prompts"})
    assert "| d (ours) | 2.75 |" in md and "| d (vLLM, served) | 2.75 |" in md
    assert "| d (ours, served) | 2.75 |" in md
    assert "temperature 0, block size 4, max new tokens 2048" in md
    assert agreement([ours, same], greedy=True)[0].endswith(": equal")
    off = cell("vllm", 2.0)
    assert "NOT equal" in agreement([ours, off], greedy=True)[0]
    assert "OUTSIDE" in agreement([ours, off], greedy=False)[0]
    hot = markdown([ours], EvalSettings(sampling=Sampling(temperature=1.0, top_p=0.9, seed=3)),
                   {"gsm8k": "x"})  # fmt: skip
    assert "temperature 1, top-p 0.9, block size 4" in hot and "seed 3" in hot
    assert "vLLM against" not in hot  # no engine row: no agreement section
