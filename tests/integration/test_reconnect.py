"""A client that lost its daemon backs off between attempts, keeps its deadline, and finds
a daemon that comes (back) up. (A daemon killed mid-epoch and replaced, with exact
delivery across it: ``test_kill9_daemon_then_new_daemon_client_continues``.)"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest

from client import LoaderClient, LoaderUnavailableError
from client import backoff as B

pytestmark = pytest.mark.integration
DEAD_AFTER_S = 0.1  # each attempt waits this long for an answer to its open
#: Scheduling noise allowed on a timed step (a loaded 2-core CI machine).
SLACK_S = 0.5


def reconnect_times(caplog) -> list[float]:
    return [r.created for r in caplog.records if "reconnecting to" in r.getMessage()]


def test_without_a_daemon_waits_grow_and_the_timeout_is_kept(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client.loader")
    timeout_s = 3.0
    c = LoaderClient(f"ipc://{tmp_path}/absent.sock", job="r", rank=0, world_size=1,
                     timeout_s=timeout_s, dead_after_s=DEAD_AFTER_S)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(LoaderUnavailableError, match="no loader daemon answered"):
        next(c)
    elapsed = time.monotonic() - t0
    c.close(wait_s=0)
    # The deadline runs from the first failure (one unanswered open in) and is not extended.
    assert timeout_s <= elapsed < timeout_s + 2 * DEAD_AFTER_S + SLACK_S
    at = reconnect_times(caplog)
    gaps = [b - a for a, b in itertools.pairwise(at)]
    # Waits of 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6, 1-2 s (a fixed 0.2 s pause: ~10 attempts).
    assert 4 <= len(at) <= 6, gaps
    assert gaps[2] > gaps[0] + 0.1, gaps  # the third wait is at least twice the first
    assert max(gaps) <= B.CAP_S + DEAD_AFTER_S + SLACK_S, gaps


def test_a_daemon_that_starts_late_is_found_within_the_cap(daemons, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client.loader")
    endpoint = f"ipc://{tmp_path}/loader.sock"  # where daemons() will serve
    got: dict = {}

    def read() -> None:
        with LoaderClient(endpoint, job="late", rank=0, world_size=1, timeout_s=60,
                          dead_after_s=DEAD_AFTER_S) as c:  # fmt: skip
            got["position"] = next(c).position
            got["at"] = time.monotonic()

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(2 * B.CAP_S)  # the client's waits are near the cap by now
    d = daemons()
    assert d.endpoint == endpoint
    ready = time.monotonic()
    reader.join(30)
    assert got.get("position") == (0, 0, 0)
    assert len(reconnect_times(caplog)) >= 4
    # At most one capped wait plus the open (the test corpus plans in well under a second).
    assert got["at"] - ready < B.CAP_S + DEAD_AFTER_S + 1.0 + SLACK_S
