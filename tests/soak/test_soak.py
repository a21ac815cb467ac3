"""Soak: the fuzzing, load and fault-injection scenarios run long (``make soak`` or
``pytest -m slow tests/soak``; minutes each)."""

from __future__ import annotations

import pytest
import torch
from chaos import chaos
from elastic_nodes import elastic_cycles
from fuzz_load import fuzz, load

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fuzzing_ten_thousand_messages(daemons):
    fuzz(daemons, examples=11_000)


def test_load_two_jobs_of_eight_ranks_minutes(daemons):
    load(daemons, seconds=180)


def test_chaos_long(daemons, corpus, tmp_path):
    chaos(daemons, corpus, tmp_path, epochs=3, client_kills=24, daemon_kills=6, pause_ms=100,
          seed=2)  # fmt: skip


def test_elastic_nodes_lost_and_back_three_times(tmp_path):
    """Three cycles of a node lost (kill -9) and back, across an epoch boundary."""
    steps = 72  # 144 two-rank micro-batches: past the 102 of epoch 0
    run = elastic_cycles(tmp_path, cycles=3, steps=steps)
    assert run.logs.count("-> 1 x 1 at epoch") == 3 and run.logs.count("-> 2 x 1 at epoch") == 3
    assert sorted(run.records) == list(range(max(run.records) + 1))
    assert max(r.get("epoch", 0) for r in run.records.values()) == 1
    model = torch.load(run.last / "model.pt", weights_only=True)
    assert model["world_size"] == 2 and 2 * steps <= model["clock"]["micro"] <= 2 * steps + 1
    for lost, back in run.timings:
        print(f"node lost -> first step alone: {lost:.1f} s; back -> on two: {back:.1f} s")
