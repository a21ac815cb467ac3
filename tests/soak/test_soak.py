"""Soak: the fuzzing, load and fault-injection scenarios run long (``make soak`` or
``pytest -m slow tests/soak``; minutes each)."""

from __future__ import annotations

import pytest
from chaos import chaos
from fuzz_load import fuzz, load

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fuzzing_ten_thousand_messages(daemons):
    fuzz(daemons, examples=11_000)


def test_load_two_jobs_of_eight_ranks_minutes(daemons):
    load(daemons, seconds=180)


def test_chaos_long(daemons, corpus, tmp_path):
    chaos(daemons, corpus, tmp_path, epochs=3, client_kills=24, daemon_kills=6, pause_ms=100,
          seed=2)  # fmt: skip
