"""Fault injection, the scenario shared by the integration (short) and soak (long) tests:
kill -9 clients and the daemon at random moments; audit the delivery.

4 trainer stand-ins (tests/workers/consume.py, real processes) consume 2+ epochs through
a real daemon, checkpointing their loader state after every batch. A seeded chaos loop
SIGKILLs random clients (restarted from their last saved state) and the daemon (a new one
is started on the same endpoint). The audit then requires, for every rank, exactly the
planned micro-batches in order (a batch replayed after a restore counts once, as the
restore intends), every batch's tokens equal to the source (crc32 of the delivered
tensors), every sample exactly once per epoch across ranks, and no shared memory left.

The default run is short (6 client kills, 2 daemon kills); ``-m slow`` runs the long one
(24 client kills, 6 daemon kills over 3 epochs).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import WORKER, audited, batch_crc, expected_plan, python_path, read_runs

WORLD = 4


class Worker:
    def __init__(self, endpoint: str, rank: int, tmp: Path, epochs: int, pause_ms: float):
        self.args = [sys.executable, str(WORKER), endpoint, "chaos", str(rank), str(WORLD),
                     str(tmp / f"state{rank}.json"), str(tmp / f"log{rank}.txt"), str(epochs),
                     "{}", str(pause_ms)]  # fmt: skip
        self.log = tmp / f"log{rank}.txt"
        self.env = {**os.environ, "PYTHONPATH": python_path(Path(__file__).parent.parent)}
        self.start()

    def start(self) -> None:
        self.lines_at_start = self._lines()
        self.proc = subprocess.Popen(self.args, env=self.env)

    def _lines(self) -> int:
        return self.log.read_text().count("\n") if self.log.exists() else 0

    def consuming(self) -> bool:
        """Running and past its START line and a first batch (not still importing)."""
        return self.proc.poll() is None and self._lines() > self.lines_at_start + 1


def chaos(daemons, corpus, tmp_path, *, epochs, client_kills, daemon_kills, pause_ms, seed):
    rng = random.Random(seed)
    d = daemons()
    workers = [Worker(d.endpoint, r, tmp_path, epochs, pause_ms) for r in range(WORLD)]
    killed_clients = killed_daemons = 0
    # The kills in a seeded random order, one each time a worker is consuming: every fault
    # is injected while the run lasts (a daemon kill drawn with a probability at each turn
    # could come too late, once the client kills were done).
    schedule = ["daemon"] * daemon_kills + ["client"] * client_kills
    rng.shuffle(schedule)
    deadline = time.monotonic() + 600
    while any(w.proc.poll() is None for w in workers):
        assert time.monotonic() < deadline, "chaos run did not finish in 600 s"
        time.sleep(rng.uniform(0.1, 0.4))
        running = [w for w in workers if w.consuming()]
        if not running or not schedule:
            continue
        if schedule.pop() == "daemon":
            d.kill()
            d = daemons()  # same endpoint and shm dir; sweeps the dead one's rings
            killed_daemons += 1
        else:
            w = rng.choice(running)
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(10)
            w.start()
            killed_clients += 1
    for w in workers:
        assert w.proc.returncode == 0, f"worker exited with {w.proc.returncode}"
    assert killed_clients == client_kills and killed_daemons == daemon_kills, (
        f"the run ended before all faults were injected ({killed_clients} client, "
        f"{killed_daemons} daemon kills): slow the workers down"
    )
    assert d.stop() == 0
    _audit(corpus, tmp_path, epochs)
    assert not list(d.shm_dir.iterdir()), "shared memory leaked"
    restarts = sum(len(read_runs(w.log)) - 1 for w in workers)
    assert restarts == client_kills  # every kill hit a consuming worker that then resumed
    return restarts


def _audit(corpus, tmp_path: Path, epochs: int) -> None:
    plans = [expected_plan(corpus, e, world_size=WORLD) for e in range(epochs)]
    served: dict[int, list[int]] = {e: [] for e in range(epochs)}
    for rank in range(WORLD):
        got = audited(tmp_path / f"log{rank}.txt")
        want = [
            ((e, s, 0), p.micro(s, rank, 0).tolist())
            for e, p in enumerate(plans)
            for s in range(p.num_steps)
        ]
        assert [(pos, ids) for pos, _, ids in got] == want, f"rank {rank} sequence differs"
        for (e, _, _), crc, ids in got:
            assert crc == batch_crc(corpus, ids), f"rank {rank}: tokens differ from source"
            served[e] += ids
    for e, p in enumerate(plans):
        assert sorted(served[e]) == sorted(p.sample_ids.tolist()), f"epoch {e} not exactly once"
