"""``train --target-engine vllm`` through each transport (``--states-transport shm``,
``files``, ``mooncake``) against the stand-in server: exactly once as colocated, across a
trainer's kill, a server that dies and comes back, a Mooncake master that goes away, and
two ranks fed from another node through Mooncake (no folder given to the trainers); and
nothing left behind: no arena or file in the server's folder, no key in the store."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from engine_jobs import (
    LAYERS,
    Master,
    StandIn,
    engine,
    losses,
    mooncake,
    target_dir,
    train,
    uninterrupted,
    ways,
)
from trainer_jobs import daemon, run, train_cmd

__all__ = ["daemon", "mooncake", "target_dir", "uninterrupted"]  # the fixtures
pytestmark = [pytest.mark.integration, pytest.mark.heavy(150)]


def test_two_ranks_fed_from_another_node_through_mooncake(daemon, target_dir, tmp_path,
                                                         mooncake):  # fmt: skip
    """Two ranks (torchrun, gloo), each fetching its own micro-batches' features from one
    server through a Mooncake store, the server and the master on another node (their own
    memory: no folder given to the trainers): the colocated 2-rank run's losses, nothing
    left in the server's folder or the store."""
    there = StandIn(target_dir, tmp_path / "other-node", store=mooncake.store)
    logs = {}
    ways = (("colo", ()),
            ("mooncake", ("--target-engine", "vllm", "--engine-url", there.url,
                          *mooncake.flags())))  # fmt: skip
    try:
        for name, extra in ways:
            run_dir = tmp_path / name
            cmd = train_cmd(daemon.endpoint, run_dir, name, 4, "--target", str(target_dir),
                            "--layers", LAYERS, "--num-eval-prompts", "0", *extra)  # fmt: skip
            run(cmd, tmp_path / f"{name}.log")
            logs[name] = losses(run_dir)
    finally:
        there.stop()
    for way in ("mooncake",):
        assert sorted(logs[way]) == [1, 2, 3, 4]
        for step, loss in logs["colo"].items():
            assert logs[way][step] == pytest.approx(loss, rel=1e-6), (way, step)
    assert there.files() == []
    assert mooncake.left(tmp_path / "mooncake") == 0


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_killed_trainer_resumes_exactly_and_leaves_nothing(
    daemon, target_dir, tmp_path, uninterrupted, transport, request
):
    """Killed (SIGKILL) as step 5 starts, with requests read ahead in flight: --resume from
    checkpoint 4 logs the uninterrupted run's losses, and what the killed process left (its
    arena, its files, its keys in the store) is gone once the resumed run has run."""
    s, flags, master = ways(transport, request, target_dir, tmp_path)
    run = tmp_path / "killed"
    try:
        res = train(daemon.endpoint, run, target_dir, *flags, fault="step=5", check=False)
        assert res.returncode == -signal.SIGKILL
        train(daemon.endpoint, run, target_dir, *flags, "--resume")
    finally:
        s.stop()
    want, got = uninterrupted, losses(run)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert s.files() == []
    if master is not None:
        assert master.left(run) == 0


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_server_that_dies_is_waited_for(daemon, target_dir, tmp_path, transport,
                                          uninterrupted, request):  # fmt: skip
    """The server exits after its 6th reply before that document's states are written (the
    arena region's lock gone with it, its header unwritten; or the key never put), and
    comes back 1 s later: one warning, the document asked for again, the uninterrupted
    losses, and nothing left in the folder or the store. (``files``: its lock there and
    half of it in the writer's ``NAME.part``; the same client, waited for and asked again,
    before 2026-12-07 the only transport, its case in the client's tests.)"""
    states = tmp_path / "states"
    how: tuple[str, ...] = ("--states-transport", transport)
    store = None
    if transport == "mooncake":
        master = request.getfixturevalue("mooncake")
        store, how = master.store, master.flags()
    flaky = StandIn(target_dir, states, store=store, FAKE_STATES_DIE_AFTER="6",
                    FAKE_STATES_DIE_UNWRITTEN="1")  # fmt: skip
    restarted = []

    def restart() -> None:
        assert flaky.proc is not None
        flaky.proc.wait(120)
        time.sleep(1)
        flaky.start()
        restarted.append(True)

    import threading

    t = threading.Thread(target=restart)
    t.start()
    try:
        flags = engine(flaky, *how) if store is None else (
            "--target-engine", "vllm", "--engine-url", flaky.url, *how)  # fmt: skip
        res = train(daemon.endpoint, tmp_path / "flaky", target_dir, *flags)
    finally:
        t.join(130)
        flaky.stop()
    assert restarted
    assert res.stderr.count("is not answering") == 1, res.stderr[-3000:]
    assert "is answering again" in res.stderr
    want, got = uninterrupted, losses(tmp_path / "flaky")
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert sorted(p.name for p in states.iterdir()) == []


def test_a_mooncake_master_that_goes_away_stops_the_run_and_it_resumes(
    daemon, target_dir, tmp_path, mooncake, uninterrupted
):
    """The store's master is killed after the run's second step: the run waits for it
    (--engine-timeout-s 2), then stops after a final checkpoint with one line naming the
    master and --resume; the master comes back (the same address), the server's connector
    makes its store client anew, and --resume logs the uninterrupted run's losses, leaving
    nothing in the store."""
    s = StandIn(target_dir, tmp_path / "states", store=mooncake.store)
    flags = ("--target-engine", "vllm", "--engine-url", s.url, *mooncake.flags(),
             "--engine-timeout-s", "2")  # fmt: skip
    run_dir = tmp_path / "run"
    stopper = threading.Thread(target=_kill_when, args=(run_dir, 2, mooncake))
    stopper.start()
    try:
        res = train(daemon.endpoint, run_dir, target_dir, *flags, check=False)
        stopper.join(60)
        assert res.returncode != 0
        # the run's one line (the store's client may log its own lines as the process ends)
        last = [x for x in res.stderr.splitlines() if x.startswith("Error:")][-1]
        assert mooncake.address in last and "--resume" in last and "checkpoint step-" in last, last
        assert "Traceback" not in res.stderr
        mooncake.start()
        train(daemon.endpoint, run_dir, target_dir, *flags, "--resume")
    finally:
        s.stop()
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == pytest.approx(uninterrupted[step], rel=1e-6), step
    assert mooncake.left(run_dir) == 0


def _kill_when(run_dir: Path, step: int, master: Master) -> None:
    """Kill the master once ``run_dir`` has logged ``step`` (bounded: 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if step in (losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}):
            master.stop()
            return
        time.sleep(0.05)
