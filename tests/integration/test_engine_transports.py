"""``train --target-engine vllm`` through each transport (``--states-transport shm``,
``files``, ``mooncake``) against the stand-in server: exactly once as colocated, across an
elastic job's kills, shrink and grow (through Mooncake: ranks fed from another node, no
folder given to the trainers), a server that dies and comes back, and a Mooncake master
that goes away; and nothing left behind: no arena or file in the server's folder, no key
in the store."""

from __future__ import annotations

import subprocess
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
from trainer_jobs import RUN_TIMEOUT_S, daemon, env, train_cmd

__all__ = ["daemon", "mooncake", "target_dir", "uninterrupted"]  # the fixtures
pytestmark = [pytest.mark.integration, pytest.mark.heavy(100)]


#: The shape changes of an elastic job: (ranks, the step whose start kills every rank);
#: the last phase runs to the end. Killed as step 3 starts on 2 ranks (checkpoint 2, reads
#: ahead in flight), resumed on 1 (the shrink), killed as step 5 starts, resumed on 2.
PHASES = ((2, 3), (1, 5), (2, None))
ELASTIC_STEPS = 7


def elastic(daemon, run_dir: Path, target: Path, *flags: str) -> dict[int, float]:
    """``PHASES`` for one run (torchrun on CPU, gloo); its losses."""
    for k, (ranks, kill_at) in enumerate(PHASES):
        cmd = train_cmd(daemon.endpoint, run_dir, "elastic", ELASTIC_STEPS, "--target",
                        str(target), "--layers", LAYERS, "--num-eval-prompts", "0",
                        "--ckpt-every", "1", *flags, *(("--resume",) if k else ()))  # fmt: skip
        cmd[cmd.index("--nproc-per-node") + 1] = str(ranks)
        environ = {**env(), **({"DFLASH_FAULT": f"step={kill_at}"} if kill_at else {})}
        log = run_dir.parent / f"{run_dir.name}-{k}.log"
        with open(log, "wb") as f:
            res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=environ,
                                 timeout=RUN_TIMEOUT_S)  # fmt: skip
        text = log.read_text(errors="replace")
        assert (res.returncode != 0) == (kill_at is not None), text[-3000:]
        if k:
            assert f"world_size {PHASES[k - 1][0]} x grad_accum 1 -> {ranks} x 1" in text
    return losses(run_dir)


_ELASTIC: dict[str, dict[int, float]] = {}


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_an_elastic_job_killed_shrunk_and_grown_resumes_exactly_and_leaves_nothing(
    daemon, target_dir, tmp_path, transport, request
):
    """SIGKILL of every rank with requests read ahead in flight, ``--resume`` on fewer ranks
    (an elastic shrink mid-epoch: rank 1's arena or segment is gone with it), killed again,
    resumed on more (a grow): the colocated job's losses through the same shape changes,
    and nothing left of any start or rank: no arena or file in the server's folder, no key
    in the store (the next start sweeps what the killed ones and the dead rank left).
    Through Mooncake the server and the master are another node's: the trainers are given
    their addresses only, no folder (``ways``)."""
    if "colo" not in _ELASTIC:
        _ELASTIC["colo"] = elastic(daemon, tmp_path / "colo", target_dir)
    s, flags, master = ways(transport, request, target_dir, tmp_path)
    try:
        got = elastic(daemon, tmp_path / "run", target_dir, *flags)
    finally:
        s.stop()
    want = _ELASTIC["colo"]
    # a step on 1 rank consumes half a 2-rank step's data: the job takes one step more
    assert sorted(got) == sorted(want) == list(range(1, ELASTIC_STEPS + 2))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-6), step
    assert s.files() == []
    if master is not None:
        assert master.left(tmp_path / "run") == 0


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
    master and --resume, without the store's teardown (it waits on the dead master); the
    master comes back (the same address), the server's connector
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
        # ended without the store's teardown, which waited 18 s on the dead master to
        # unmount its segment (``trainer.engine.mooncake.abandoned``)
        assert "unmount segment" not in res.stderr
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
