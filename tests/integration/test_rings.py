"""Shared-memory rings: file modes, the one-slot wake-up handshake, a corrupt control page."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from conftest import (
    consume,
    plan_sequence,
)

from client import LoaderClient, LoaderRequestError
from loader_server.wire import ring as R

pytestmark = pytest.mark.integration


def test_ring_and_socket_modes_follow_config(daemons):
    d = daemons()
    sock_path = Path(d.endpoint[len("ipc://") :])
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600  # owner only by default
    d.stop()
    d = daemons("--shm-mode", "0640")
    client = LoaderClient(d.endpoint, job="m", rank=0, world_size=1)
    next(client)
    ring, ctl = sorted(d.shm_dir.iterdir())
    assert stat.S_IMODE(ring.stat().st_mode) == 0o640
    # group members may read rings, so they may connect and write their control page.
    assert stat.S_IMODE(ctl.stat().st_mode) == 0o660
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o660
    client.close()


# --- the shared-memory counters -----------------------------------------------------------


def test_one_slot_ring_wakes_both_sides_every_batch(daemons, corpus):
    """With one slot, every batch needs both wake-ups: the daemon waits for each release
    and the client for each batch. A lost client wake-up would stall until a heartbeat
    (5 s here), so no next() may take seconds; and delivery stays exact."""
    d = daemons("--slots", "1")
    client = LoaderClient(
        d.endpoint, job="w", rank=0, world_size=1, epochs=1, heartbeat_s=5.0, dead_after_s=20.0
    )
    got, slowest = [], 0.0
    while True:
        t = time.monotonic()
        try:
            b = next(client)
        except StopIteration:
            break
        slowest = max(slowest, time.monotonic() - t)
        got.append((b.position, b.sample_ids.tolist()))
    assert got == plan_sequence(corpus, 0, range(1))
    assert slowest < 2.5, f"a next() took {slowest:.2f} s: a wake-up was lost"


def test_garbage_in_a_control_page_ends_only_that_session(daemons, corpus):
    d = daemons()
    victim = LoaderClient(d.endpoint, job="g", rank=0, world_size=2)
    other = LoaderClient(d.endpoint, job="g", rank=1, world_size=2, epochs=1)
    next(victim)
    next(other)
    ctl = next(p for p in d.shm_dir.iterdir() if p.suffix == ".ctl" and victim._sid in p.name)
    with open(ctl, "r+b") as f:
        f.seek(R.CONSUMED)
        f.write((10**12).to_bytes(8, "little"))  # consumed far past anything produced
    deadline = time.monotonic() + 10
    while "consumed counter" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)  # the daemon reads counters at least every 20 ms
    with pytest.raises(LoaderRequestError, match="consumed counter 1000000000000 outside"):
        for _ in range(10):  # batches already in the ring are still delivered
            next(victim)
    assert len(consume(other)) + 1 == len(plan_sequence(corpus, 1, range(1), world_size=2))
