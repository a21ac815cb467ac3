"""Protocol fuzzing (2,500 hypothesis messages) and a 6 s load test of 2 jobs x 8 ranks
against a live daemon (``fuzz_load`` says what each checks; ``tests/soak`` runs them long)."""

from __future__ import annotations

import pytest
from fuzz_load import fuzz, load

pytestmark = [pytest.mark.integration, pytest.mark.heavy(29)]


def test_fuzzing_short(daemons):
    fuzz(daemons, examples=2500)


def test_load_two_jobs_of_eight_ranks_short(daemons):
    load(daemons, seconds=6)
