"""Scenarios shared by the integration (short) and soak (long) tests: protocol fuzzing
against a live daemon, and a load test with many ranks.

Fuzzing: hypothesis generates messages (2,500 by default, 11,000 with ``-m slow``): random
bytes, random msgpack values, well-formed maps with hostile field values, multi-frame and
oversized messages, from many connections, while a legitimate client keeps consuming. The
daemon must stay up, answer what it can, keep its memory flat (< 10 MB RSS growth after
warm-up) and keep serving the legitimate client.

Load: 2 jobs x 8 ranks consume concurrently; every rank's throughput must be within 20%
of the others' and the daemon's rings must stay bounded (the short version runs in the
default suite; ``-m slow`` runs it for minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import LoaderClient
from loader_server.wire import protocol as P

KINDS = ["open", "release", "heartbeat", "close", "stats", "ping", "batch", "welcome", "", "x"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=50),
    st.binary(max_size=50),
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)
spec_maps = st.dictionaries(
    st.sampled_from(["token_budget", "seed", "layout", "buckets", "bogus"]), scalars
)
hostile_maps = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 0, 2, "1", None]), "t": st.sampled_from(KINDS)},
    optional={
        "job": values,
        "rank": values,
        "world_size": values,
        "spec": st.one_of(values, spec_maps),
        "pos": values,
        "epochs": values,
        "s": values,
        "slot": values,
        "w": values,
    },
)
frames = st.one_of(
    st.binary(max_size=300).map(lambda b: [b]),
    values.map(lambda v: [msgpack.packb(v, use_bin_type=True)]),
    hostile_maps.map(lambda m: [msgpack.packb(m, use_bin_type=True)]),
    st.lists(st.binary(max_size=20), min_size=2, max_size=4),
)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


class _Fuzzer:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.sent = 0
        self.replies = 0
        self._new()

    def _new(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)

    def send(self, parts: list[bytes]) -> None:
        self.sock.send_multipart(parts)
        self.sent += 1
        if self.sent % 200 == 0:  # drain replies, rotate connections
            while self.sock.poll(0):
                self.sock.recv()
                self.replies += 1
            self.sock.close()
            self._new()


def fuzz(daemons, examples: int) -> None:
    d = daemons("--session-timeout-s", "5")
    stop = threading.Event()
    legit: dict[str, float] = {"batches": 0}

    def consume() -> None:
        c = LoaderClient(d.endpoint, job="legit", rank=0, world_size=1)
        while not stop.is_set():
            next(c)
            legit["batches"] += 1
        c.close()

    t = threading.Thread(target=consume)
    t.start()
    fuzzer = _Fuzzer(d.endpoint)
    base_kb = None

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(frames)
    def fuzz(parts: list[bytes]) -> None:
        nonlocal base_kb
        fuzzer.send(parts)
        if fuzzer.sent == examples // 5:
            base_kb = _rss_kb(d.proc.pid)  # after warm-up (plan cache, allocator arenas)

    started = time.monotonic()
    before = legit["batches"]
    fuzz()
    for _ in range(20):  # oversized frames: ZeroMQ drops the sender at the transport level
        fuzzer.send([b"\x00" * (P.MAX_MESSAGE_BYTES + 1)])
    elapsed = time.monotonic() - started
    during = legit["batches"] - before
    time.sleep(1.0)
    stop.set()
    t.join(30)
    assert d.proc.poll() is None, d.log()
    assert fuzzer.sent >= examples and fuzzer.replies > examples // 10
    grown_mb = (_rss_kb(d.proc.pid) - (base_kb or 0)) / 1024
    assert grown_mb < 10, f"daemon RSS grew {grown_mb:.1f} MB under fuzzing"
    # Starvation shows as ~0 batches/s; on the 2-core CI machine an unstarved client got
    # 47-103 batches/s (47 in a clean-clone CI run, under the old bound of 50).
    rate = during / elapsed
    assert rate > 20, f"legit client got {rate:.0f} batches/s while fuzzed"
    stats = subprocess.run(
        [sys.executable, "-m", "loader_server", "stats", "--endpoint", d.endpoint, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(stats)["errors"] > examples // 10


def load(daemons, seconds: float) -> None:
    """Fairness is the daemon's job only when the daemon sets the pace: big micro-batches
    make it the slow side, and each rank "trains" 1 ms per batch (releasing the GIL, as
    a GPU step does), so the 16 client threads of this one process do not compete for
    the GIL instead. The test checks that premise (clients wait for data) first."""
    d = daemons()
    jobs, world = 2, 8
    spec = {"token_budget": 65536, "max_batch_size": 512}
    counts: dict[tuple[int, int], int] = {}
    waits: dict[tuple[int, int], float] = {}
    stop = threading.Event()
    fills: list[int] = []

    def run(job: int, rank: int) -> None:
        c = LoaderClient(d.endpoint, job=f"load{job}", rank=rank, world_size=world, spec=spec)
        n = 0
        next(c)
        start.wait()
        t0, w0 = time.monotonic(), c.wait_s
        while not stop.is_set():
            time.sleep(0.001)
            next(c)
            n += 1
        counts[(job, rank)] = n
        waits[(job, rank)] = (c.wait_s - w0) / (time.monotonic() - t0)
        c.close()

    start = threading.Event()
    threads = [threading.Thread(target=run, args=(j, r)) for j in range(jobs) for r in range(world)]
    for t in threads:
        t.start()
    start.set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(1.0, seconds / 4))
        rings = [p for p in d.shm_dir.iterdir() if p.suffix != ".ctl"]
        fills.append(len(rings))
    stop.set()
    for t in threads:
        t.join(60)
    rates = list(counts.values())
    assert len(rates) == jobs * world
    # Each client copies its batch out of the ring (~0.1 ms for these 330 KB batches here),
    # with 16 client threads of this one process on 2 cores: waits measured 0.10-0.32 of
    # the time (0.53 before batches were copied out), so the daemon still sets the pace.
    assert sum(waits.values()) / len(waits) > 0.05, f"clients set the pace: waits {waits}"
    assert min(rates) >= 0.8 * max(rates), f"unfair: {sorted(rates)}"
    assert max(fills) <= jobs * world, "more rings than sessions"
    assert d.proc.poll() is None
