"""``train --target-engine vllm`` against a stand-in server (``tests/data/fake_vllm_states.py``,
vLLM's conventions, computed with Transformers): the features reach the loss as the
colocated target's do, exactly once across a trainer's kill, through a server that dies
and comes back, and never wrong; nothing is left in the states folder. The real vLLM:
``make serve-check`` (``scripts/checks/serve_engine_states.py``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from trainer_jobs import daemon, env, run, train_cmd

from trainer.model.target import TinyTargetSpec, build_tiny_model
from trainer.vllm.process import free_port

__all__ = ["daemon"]  # the fixture, re-used from the 2-rank integration tests

STAND_IN = Path(__file__).resolve().parents[1] / "data" / "fake_vllm_states.py"
LAYERS = "0,1,3"  # our ids: the first and the last layer (vLLM's 1, 2 and 4)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("target") / "tiny"
    build_tiny_model(TinyTargetSpec()).save_pretrained(out)
    return out


class StandIn:
    """The stand-in server on a fixed port (restartable there), its files in ``states``."""

    def __init__(self, target: Path, states: Path, store: dict | None = None,
                 **environ: str) -> None:  # fmt: skip
        self.target, self.states, self.port = target, states, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store  # a Mooncake master's addresses, for its puts
        states.mkdir(exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start(**environ)

    def start(self, **environ: str) -> None:
        cmd = [sys.executable, str(STAND_IN), "--model", str(self.target), "--port",
               str(self.port), "--layer-ids", "1,2,4", "--states", str(self.states),
               "--max-model-len", "300"]  # fmt: skip
        if self.store:
            cmd += ["--mooncake-master", self.store["master"],
                    "--mooncake-metadata", self.store["metadata"]]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env={**env(), **environ})
        deadline = time.monotonic() + 60
        import urllib.error
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return
            except urllib.error.HTTPError:  # it answers (FAKE_STATES_STATUS)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stand-in server did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def files(self) -> list[str]:
        return sorted(p.name for p in self.states.iterdir())


class Master:
    """A Mooncake master on fixed ports (restartable there, as a restarted one would be)."""

    def __init__(self, tmp: Path) -> None:
        from trainer.engine.mooncake import metadata_url

        self.tmp, self.rpc, self.http, self.admin = tmp, free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc}"
        self.store = {"master": self.address, "metadata": metadata_url(self.address, self.http)}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        from trainer.engine.mooncake import _wait_listening, master_command

        self.starts += 1
        log = self.tmp / f"master-{self.starts}.log"
        with open(log, "wb") as out:
            cmd = master_command(self.rpc, self.http, "127.0.0.1", admin_port=self.admin)
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait_listening("127.0.0.1", self.rpc, self.proc, log)
        _wait_listening("127.0.0.1", self.http, self.proc, log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def flags(self) -> tuple[str, ...]:
        return ("--states-transport", "mooncake", "--mooncake-master", self.address,
                "--mooncake-metadata", self.store["metadata"])  # fmt: skip

    def left(self, run_dir: Path) -> int:
        """How many keys of the run of ``run_dir`` the store still holds (a probe client
        removes them, and counts)."""
        import torch  # noqa: F401  (the store's client wants torch loaded first)

        from trainer.vllm.connector.dflash_states_mooncake import connect

        run_id = (run_dir / "engine-id").read_text().strip()
        probe = connect(master=self.address, metadata=self.store["metadata"], protocol="tcp",
                        local_host="127.0.0.1")  # fmt: skip
        try:
            return int(probe.remove_by_regex(f"^dflash-{run_id}-", True))
        finally:
            probe.close()


@pytest.fixture
def mooncake(tmp_path):
    m = Master(tmp_path)
    yield m
    m.stop()


@pytest.fixture
def stand_in(target_dir, tmp_path):
    s = StandIn(target_dir, tmp_path / "states")
    yield s
    s.stop()


def train(
    endpoint: str, run_dir: Path, target: Path, *extra: str, steps: int = 6,
    fault: str | None = None, check: bool = True,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", endpoint,
           "--job", run_dir.name, "--run-dir", str(run_dir), "--steps", str(steps),
           "--block-size", "8", "--anchors-per-doc", "8", "--token-budget", "1024",
           "--max-seq-len", "256", "--lr", "3e-3", "--warmup", "2", "--grad-accum", "2",
           "--num-eval-prompts", "0", "--no-progress", "--target", str(target),
           "--layers", LAYERS, "--ckpt-every", "2", *extra]  # fmt: skip
    environ = {**env(), **({"DFLASH_FAULT": fault} if fault else {})}
    res = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=240)
    if check:
        assert res.returncode == 0, res.stderr[-4000:]
    return res


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("loss") is not None}


def engine(s: StandIn, *more: str) -> tuple[str, ...]:
    return ("--target-engine", "vllm", "--engine-url", s.url, "--engine-dir", str(s.states),
            *more)  # fmt: skip


def test_engine_features_train_the_colocated_run(daemon, stand_in, target_dir, tmp_path):
    """Packed rows (the daemon's default) and padded: the same losses step for step as the
    target in the trainer, and the states folder empty after the run."""
    for layout in ("packed", "padded"):
        colo = train(daemon.endpoint, tmp_path / f"colo-{layout}", target_dir, "--layout", layout)
        assert colo.returncode == 0
        train(daemon.endpoint, tmp_path / f"eng-{layout}", target_dir, "--layout", layout,
              *engine(stand_in))  # fmt: skip
        want, got = losses(tmp_path / f"colo-{layout}"), losses(tmp_path / f"eng-{layout}")
        assert sorted(got) == sorted(want) == list(range(1, 7))
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=1e-6), (layout, step)
        assert stand_in.files() == []


def test_two_ranks_fed_by_one_server_on_this_node_and_on_another(daemon, target_dir, tmp_path,
                                                                  mooncake):  # fmt: skip
    """Two ranks (torchrun, gloo), each fetching its own micro-batches' features from the
    one server: through shm (the server on this node, its folder given), and through a
    Mooncake store from a server and master on another node (their own memory: no folder
    given to the trainers): the colocated 2-rank run's losses both ways, nothing left in
    the server's folder or the store."""
    here = StandIn(target_dir, tmp_path / "states")
    there = StandIn(target_dir, tmp_path / "other-node", store=mooncake.store)
    logs = {}
    ways = (("colo", ()), ("shm", engine(here)),
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
        here.stop()
        there.stop()
    for way in ("shm", "mooncake"):
        assert sorted(logs[way]) == [1, 2, 3, 4]
        for step, loss in logs["colo"].items():
            assert logs[way][step] == pytest.approx(loss, rel=1e-6), (way, step)
    assert here.files() == [] and there.files() == []
    assert mooncake.left(tmp_path / "mooncake") == 0


_UNINTERRUPTED: dict[str, dict[int, float]] = {}


@pytest.fixture
def uninterrupted(daemon, target_dir, tmp_path) -> dict[int, float]:
    """The losses of an engine-fed run with ``train``'s flags, uninterrupted (what the runs
    that are killed, or whose server dies, must log): run once for the file (every test's
    daemon serves the same corpus, so the same plan)."""
    if "run" not in _UNINTERRUPTED:
        s = StandIn(target_dir, tmp_path / "whole-states")
        try:
            train(daemon.endpoint, tmp_path / "whole", target_dir, *engine(s))
        finally:
            s.stop()
        _UNINTERRUPTED["run"] = losses(tmp_path / "whole")
    return _UNINTERRUPTED["run"]


def ways(transport: str, request, target_dir: Path, tmp_path: Path) -> tuple:
    """A stand-in and the run's flags for ``transport``: shm beside the server (its folder
    given), or Mooncake (a master, no folder given to the trainer)."""
    if transport == "mooncake":
        master = request.getfixturevalue("mooncake")
        s = StandIn(target_dir, tmp_path / "states", store=master.store)
        return s, ("--target-engine", "vllm", "--engine-url", s.url, *master.flags()), master
    s = StandIn(target_dir, tmp_path / "states")
    return s, (*engine(s), "--states-transport", transport), None


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


@pytest.mark.parametrize("transport", ["shm", "files", "mooncake"])
def test_a_server_that_dies_is_waited_for(daemon, target_dir, tmp_path, transport,
                                          uninterrupted, request):  # fmt: skip
    """The server exits after its 6th reply before that document's states are written (the
    arena region's lock gone with it, its header unwritten; or the file's lock there and
    half of it in the writer's ``NAME.part``), and comes back 1 s later: one warning, the
    document asked for again, the uninterrupted losses, and nothing left in the folder."""
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
    (--engine-timeout-s 4), then stops after a final checkpoint with one line naming the
    master and --resume; the master comes back (the same address), the server's connector
    makes its store client anew, and --resume logs the uninterrupted run's losses, leaving
    nothing in the store."""
    s = StandIn(target_dir, tmp_path / "states", store=mooncake.store)
    flags = ("--target-engine", "vllm", "--engine-url", s.url, *mooncake.flags(),
             "--engine-timeout-s", "4")  # fmt: skip
    run_dir = tmp_path / "run"
    stopper = threading.Thread(target=_kill_when, args=(run_dir, 2, mooncake))
    stopper.start()
    try:
        res = train(daemon.endpoint, run_dir, target_dir, *flags, check=False)
        stopper.join(60)
        assert res.returncode != 0
        last = res.stderr.strip().splitlines()[-1]
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


def test_a_server_still_starting_is_waited_for(daemon, target_dir, tmp_path):
    """The trainer starts first; the server answers only some seconds later: waited for
    (one warning), then the run trains as usual."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    states = tmp_path / "states"
    states.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", daemon.endpoint,
           "--job", "late", "--run-dir", str(run_dir), "--steps", "2", "--block-size", "8",
           "--token-budget", "1024", "--max-seq-len", "256", "--num-eval-prompts", "0",
           "--no-progress", "--target", str(target_dir), "--layers", LAYERS,
           "--target-engine", "vllm", "--engine-url", url, "--engine-dir", str(states)]  # fmt: skip
    trainer = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env())
    time.sleep(4)
    late = StandIn.__new__(StandIn)
    late.target, late.states, late.port, late.url, late.proc = target_dir, states, port, url, None
    late.store = None
    try:
        late.start()
        _, err = trainer.communicate(timeout=240)
    finally:
        late.stop()
    assert trainer.returncode == 0, err[-3000:]
    assert err.count("is not answering") == 1 and "is answering again" in err
    assert sorted(losses(run_dir)) == [1, 2]


def test_the_next_micro_batch_is_asked_for_while_one_trains(target_dir, stand_in):
    """The feed itself, against the stand-in: with 3 documents a micro-batch and 2 in
    flight, every micro-batch it yields has the next one's first documents already asked
    for, so the engine computes while the step trains (not only when asked)."""
    import torch

    from trainer.engine.client import StateClient
    from trainer.engine.feed import EngineFeed
    from trainer.engine.target import EngineTarget
    from trainer.train.batches import ListSource

    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 500, (40,), generator=g).tolist(), [1] * 40) for _ in range(12)]
    source = ListSource(samples, rows=3, layout="packed", epochs=1)
    target = EngineTarget(target_dir, [0, 1, 3], "cpu", torch.float32)
    client = StateClient(stand_in.url, run="feed-0", rank=0, num_states=3, hidden_size=128,
                         inflight=2, states_dir=stand_in.states)  # fmt: skip
    feed = EngineFeed(source, target, client)
    asked_at_yield = []
    for k, batch in enumerate(feed):
        asked_at_yield.append(client.asked)  # documents asked for so far
        assert target.batch_features(batch).shape == (1, 120, 3 * 128)
        assert k == batch.step
    feed.close()
    assert len(asked_at_yield) == 4
    for k, asked in enumerate(asked_at_yield[:-1]):
        assert asked > 3 * (k + 1), (k, asked_at_yield)  # some of micro-batch k+1's asked
    assert stand_in.files() == []


def test_a_server_gone_for_good_stops_the_run_after_a_final_checkpoint(daemon, target_dir,
                                                                        tmp_path):  # fmt: skip
    """The server exits after 60 replies (three steps' documents) and never comes back: one
    line naming the URL and the timeout, the checkpoint that holds the last step, and how
    to go on."""
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_DIE_AFTER="60")
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir,
                    *engine(s, "--engine-timeout-s", "3"), check=False)  # fmt: skip
    finally:
        s.stop()
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert s.url in last and "no answer for 3 s (--engine-timeout-s" in last, last
    assert "bring the vLLM server back" in last and "--resume" in last, last
    assert "checkpoint step-" in last, last
    assert "Traceback" not in res.stderr


def test_nan_states_stop_the_run_at_once_naming_the_sample(daemon, target_dir, tmp_path):
    """A run fed NaN states trained on them and exited 0: now one line names the sample,
    the token and the layer column, and no file is left. (The other refusals, another
    dtype, a web server at the URL, ...: tests/integration/test_engine_client.py.)"""
    says = "are not finite (token"
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_BAD="nan@5")
    t0 = time.monotonic()
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir,
                    *engine(s, "--engine-timeout-s", "120"), check=False)  # fmt: skip
    finally:
        s.stop()
    assert res.returncode != 0 and time.monotonic() - t0 < 100
    last = res.stderr.strip().splitlines()[-1]
    assert says in last, last
    assert "Traceback" not in res.stderr
    assert s.files() == []


def test_states_of_other_tokens_are_refused(daemon, target_dir, tmp_path):
    s = StandIn(target_dir, tmp_path / "states", FAKE_STATES_WRONG_TOKENS="1")
    try:
        res = train(daemon.endpoint, tmp_path / "run", target_dir, *engine(s), check=False)
    finally:
        s.stop()
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "returned states for other tokens than sample" in last, last
    assert "refusing a wrong feature" in last


@pytest.mark.parametrize(
    ("transport", "says"),
    [("files", "which is not in {elsewhere} here: give --engine-dir"),
     ("shm", "cannot put sample .* in this rank's arena {elsewhere}/arena-dflash-.*No such "
             "file or directory.*give --engine-dir the folder the server writes to")],
)  # fmt: skip
def test_an_engine_dir_where_the_server_does_not_write_is_named(
    daemon, stand_in, target_dir, tmp_path, transport, says
):
    """The server writes where this machine does not look (files), or cannot reach this
    rank's arena (shm): one line naming the folder and --engine-dir, at the first document
    (not 300 s of retries), and the server goes on serving."""
    import re

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = train(daemon.endpoint, tmp_path / "run", target_dir, "--target-engine", "vllm",
                "--engine-url", stand_in.url, "--engine-dir", str(elsewhere),
                "--states-transport", transport, check=False)  # fmt: skip
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(says.format(elsewhere=re.escape(str(elsewhere))), last), last
    assert "Traceback" not in res.stderr and "not answering" not in res.stderr
    assert stand_in.proc is not None and stand_in.proc.poll() is None
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--target-engine", "vllm", "--target", "tiny"], "save-target DIR"),
        (["--target-engine", "vllm"], "needs one of --engine-url"),
        (["--engine-url", "http://x"], "--engine-url is an engine option"),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--target-shard", "fsdp"],
            "no decoder to shard",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--eval-sets", "humaneval"],
            "dflash-train eval --engine vllm",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--engine-inflight", "0"],
            "--engine-inflight must be >= 1",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "localhost:8000"],
            "give the server's URL, e.g. http://HOST:8000",
        ),
        (
            ["--target-engine", "vllm", "--engine-url", "http://x", "--engine-dir", "/nowhere/x"],
            "'/nowhere/x' does not exist",
        ),
    ],
)
def test_engine_options_that_do_not_go_together(flags, says, target_dir, tmp_path):
    if "--target" not in flags:
        flags = [*flags, "--target", str(target_dir)]
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--endpoint", "ipc:///nowhere",
           "--run-dir", str(tmp_path / "run"), "--steps", "1", *flags]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120)
    assert res.returncode != 0
    assert says in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_engine_command_prints_the_server_the_run_expects(target_dir, stand_in):
    """``dflash-train engine-command``: vLLM's ids for the run's --layers (ours + 1), the
    connector on PYTHONPATH, its folder, prefix caching off; bad layers refused."""
    cmd = [sys.executable, "-m", "trainer.cli", "engine-command", str(target_dir), "--layers",
           LAYERS, "--states-dir", str(stand_in.states), "--max-model-len", "513"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=60)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("PYTHONPATH=") and "trainer/vllm/connector" in line
    assert '"eagle_aux_hidden_state_layer_ids": [1, 2, 4]' in line
    assert f'"shared_storage_path": "{stand_in.states}"' in line
    assert "--no-enable-prefix-caching" in line and "--max-model-len 513" in line
    bad = subprocess.run([*cmd[:6], "0,4", *cmd[7:]], capture_output=True, text=True,
                         env=env(), timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--layers: layer ids [0, 4] must be in 0..3" in bad.stderr
    # Mooncake: the master's command (its own metadata server), the server's with the
    # store's addresses, and the flags every trainer adds
    more = subprocess.run([*cmd, "--states-transport", "mooncake", "--host", "node-a"],
                          capture_output=True, text=True, env=env(), timeout=60)  # fmt: skip
    assert more.returncode == 0, more.stderr
    lines = [x for x in more.stdout.splitlines() if not x.startswith("#")]
    assert lines[0].endswith("mooncake_master --rpc_port=50051 --enable_http_metadata_server="
                             "true --http_metadata_server_host=0.0.0.0 "
                             "--http_metadata_server_port=8080")  # fmt: skip
    assert '"mooncake_master": "node-a:50051"' in lines[1]
    assert '"mooncake_metadata": "http://node-a:8080/metadata"' in lines[1]
    assert lines[2].endswith("--engine-url http://node-a:8000 --states-transport mooncake "
                             "--mooncake-master node-a:50051")  # fmt: skip
