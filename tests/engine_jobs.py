"""What the engine tests share (``tests/integration/test_engine_*.py``): a tiny target, the
stand-in server with vLLM's conventions (``tests/data/fake_vllm_states.py``) as a process,
a Mooncake master as a process, and a training run's command and losses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_jobs import env

from trainer.model.target import TinyTargetSpec, build_tiny_model
from trainer.vllm.process import free_port

STAND_IN = Path(__file__).resolve().parent / "data" / "fake_vllm_states.py"
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
