"""Fault injection, short: 6 client kills and 2 daemon kills over 2 epochs, then the audit
(``chaos`` says what it checks; ``tests/soak`` runs the long one)."""

from __future__ import annotations

import pytest
from chaos import chaos

pytestmark = pytest.mark.integration


def test_chaos_short(daemons, corpus, tmp_path):
    chaos(daemons, corpus, tmp_path, epochs=2, client_kills=6, daemon_kills=2, pause_ms=30,
          seed=1)  # fmt: skip
