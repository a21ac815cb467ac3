"""A client that lost its daemon backs off between attempts, keeps its deadline, and finds
a daemon that comes (back) up. (A daemon killed mid-epoch and replaced, with exact
delivery across it: ``test_kill9_daemon_then_new_daemon_client_continues``.)"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from client import LoaderClient, LoaderUnavailableError
from client import backoff as B

pytestmark = pytest.mark.integration
DEAD_AFTER_S = 0.1  # each attempt waits this long for an answer to its open
#: Generous bound on scheduling delays: the timing bounds below only tell "waited about the
#: backoff" from "waited for the 60 s timeout", so a loaded machine cannot fail them.
SLACK_S = 5.0
_WAIT = re.compile(r"reconnecting to \S+ in ([0-9.]+) s")


def logged_waits(caplog) -> list[float]:
    """The waits the client chose, as it logged them (its backoff's decisions, not the
    clock's: these do not depend on how busy the machine is)."""
    return [
        float(m.group(1)) for r in caplog.records if (m := _WAIT.search(r.getMessage())) is not None
    ]


def nominal(k: int) -> float:
    return min(B.INITIAL_S * B.FACTOR**k, B.CAP_S)


def test_without_a_daemon_waits_grow_and_the_timeout_is_kept(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client.session")
    timeout_s = 3.0
    c = LoaderClient(f"ipc://{tmp_path}/absent.sock", job="r", rank=0, world_size=1,
                     timeout_s=timeout_s, dead_after_s=DEAD_AFTER_S)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(LoaderUnavailableError, match="no loader daemon answered"):
        next(c)
    elapsed = time.monotonic() - t0
    c.close(wait_s=0)
    # The deadline runs from the first attempt and is not extended.
    assert timeout_s <= elapsed < timeout_s + SLACK_S
    waits = logged_waits(caplog)
    # A fixed 0.2 s pause would make ~10 attempts in 3 s; the backoff makes at most 6.
    assert 2 <= len(waits) <= 6, waits
    for k, w in enumerate(waits[:-1]):  # the last one may be cut short by the deadline
        assert (1 - B.JITTER) * nominal(k) - 0.01 <= w <= nominal(k) + 0.01, (k, waits)
    assert waits[-1] <= nominal(len(waits) - 1) + 0.01, waits


def test_the_timeout_is_kept_when_an_answer_is_awaited_longer(tmp_path):
    # each open waits dead_after_s for an answer, but not past the deadline: timeout_s
    # means from the call, not from the first open given up (timeout_s + dead_after_s)
    c = LoaderClient(f"ipc://{tmp_path}/absent.sock", job="r", rank=0, world_size=1,
                     timeout_s=2.0, dead_after_s=6.0)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(LoaderUnavailableError, match=r"no loader daemon answered .* for 2 s"):
        next(c)
    elapsed = time.monotonic() - t0
    c.close(wait_s=0)
    assert 2.0 <= elapsed < 4.0, elapsed  # before: 8 s


def test_a_daemon_that_starts_late_is_found_within_the_cap(daemons, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client.session")
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
    waits = logged_waits(caplog)
    assert len(waits) >= 3 and max(waits) <= B.CAP_S + 0.01, waits
    # Found after at most one capped wait, far from the 60 s timeout.
    assert got["at"] - ready < B.CAP_S + SLACK_S
