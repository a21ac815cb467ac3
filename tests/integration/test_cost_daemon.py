"""The daemon serves cost-balanced plans (a calibrated profile via --cost-profile) micro-batch
for micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loader_server.planning.planner import plan_epoch
from loader_server.wire.spec import BatchSpec

# Of the order of an 8B target on one H100 (seconds): per token, per L^2, per block slot.
MODEL = {"cost_c0": 0.02, "cost_tok": 2.3e-5, "cost_attn": 4e-10, "cost_slot": 3.6e-6}
RULE = {"block_size": 16, "anchors_per_doc": 512, "tokens_per_anchor": 1, "max_anchors": 2048}


def write_profile(path: Path, coefficients=None, rule=None, **extra) -> Path:
    doc = {"version": 1, "coefficients": coefficients or MODEL, "anchor_rule": rule or RULE}
    path.write_text(json.dumps({**doc, **extra}))
    return path


@pytest.mark.integration
def test_daemon_serves_cost_balanced_plans(daemons, corpus, tmp_path):
    """``serve --cost-profile``: every client gets the cost-balanced plan, micro-batch for
    micro-batch; a client's own cost fields (what ``train --cost-profile`` sends) too."""
    from conftest import TEST_SPEC

    from client import LoaderClient

    coefficients = {"cost_c0": 0.05, "cost_tok": 1e-5, "cost_attn": 2e-9, "cost_slot": 1e-4}
    rule = {"block_size": 8, "anchors_per_doc": 4, "tokens_per_anchor": 1, "max_anchors": 64}
    profile = write_profile(tmp_path / "profile.json", coefficients, rule)
    d = daemons("--cost-profile", str(profile))
    want_spec = BatchSpec(**TEST_SPEC, **coefficients, **rule, world_size=2)
    got = {}
    for rank in range(2):
        c = LoaderClient(d.endpoint, job="cost", rank=rank, world_size=2, epochs=1)
        got[rank] = [(b.position, b.sample_ids.tolist()) for b in c]
        assert c.effective_spec["cost_slot"] == coefficients["cost_slot"]
        c.close()
    plan = plan_epoch(corpus.lengths, want_spec, epoch=0)
    assert plan.stats["cost_budget"] > 0 and want_spec.cost_model_on
    for rank in range(2):
        assert got[rank] == [((0, s, 0), plan.micro(s, rank, 0).tolist())
                             for s in range(plan.num_steps)]  # fmt: skip
    own = {**coefficients, "cost_c0": 0.5, **rule}
    c = LoaderClient(d.endpoint, job="own", rank=0, world_size=1, epochs=1, spec=own)
    first = next(iter(c))
    mine = plan_epoch(corpus.lengths, BatchSpec(**TEST_SPEC, **own), epoch=0)
    assert first.sample_ids.tolist() == mine.micro(0, 0, 0).tolist()
    c.close()
