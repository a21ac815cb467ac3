"""Two "nodes" on one machine under torchrun's elastic launcher, for the integration test
(one cycle) and the soak test (several): each node has its own daemon (endpoint and shm
folder) and its own `torchrun --nnodes 1:2` agent over one c10d rendezvous on 127.0.0.1.
A cycle: node B is lost with kill -9 (daemon, agent and rank); node A's agent restarts its
rank alone and the trainer continues from the newest checkpoint under world size 1; node B
comes back and both restart under world size 2. The launcher recipe is docs/TRAINER.md's.

While node B starts again, node A's rank is frozen (SIGSTOP), so how many steps it trains
alone does not depend on how long a fresh torchrun and daemon take to start (many seconds
on a loaded machine): running on, it could use up the data before node B is back, and the
two-node round would resume at the last step with nothing left to train. It is thawed once
its agent, seeing node B waiting in the rendezvous, has told it to stop for the two-node
round (the SIGTERM is pending in the frozen rank until then)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import children, kill_tree

from loader_server.data.synth import SynthSpec, write_corpus
from scripts.servers.daemon_process import DaemonProcess
from trainer.train.metrics import read_metrics

#: docs/TRAINER.md "Elastic jobs": fast detection of a lost node, no split brain.
RDZV_CONF = (
    "join_timeout=60,last_call_timeout=2,close_timeout=5,keep_alive_interval=1,"
    "keep_alive_max_attempt=3"
)
WAIT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One "node": a daemon with its own endpoint and shm folder, and a torchrun agent."""

    def __init__(
        self, name: str, corpus: Path, tmp: Path, port: int, is_host: bool, nproc: int = 1
    ) -> None:
        self.name, self.corpus, self.tmp, self.port, self.is_host = name, corpus, tmp, port, is_host
        self.nproc = nproc  # ranks on this node
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp
        self.shm = base / f"dflash-node-{name}-{uuid.uuid4().hex[:6]}"
        self.shm.mkdir()
        self.daemon: DaemonProcess | None = None
        self.agent: subprocess.Popen | None = None
        self.runs = 0

    def start(self, run_dir: Path, steps: int, *extra: str, max_restarts: int = 3) -> None:
        """The daemon, then the agent training ``steps`` into ``run_dir``; ``extra`` flags
        of ``train`` come last (they win)."""
        self.runs += 1
        self.daemon = DaemonProcess(
            self.corpus, f"ipc://{self.tmp}/{self.name}.sock", "--shm-dir", str(self.shm),
            log_path=self.tmp / f"{self.name}-daemon-{self.runs}.log",
        )  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", str(self.nproc), "--max-restarts", str(max_restarts),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "elastic-test",
            "--rdzv-conf", f"{RDZV_CONF},is_host={'true' if self.is_host else 'false'}",
            "-m", "trainer.cli", "train", "--endpoint", self.daemon.endpoint, "--job", "nodes",
            "--run-dir", str(run_dir), "--steps", str(steps), "--ckpt-every", "1",
            "--block-size", "8", "--anchors-per-doc", "16", "--token-budget", "1024",
            "--max-seq-len", "256", "--lr", "3e-3", "--warmup", "2", "--no-progress", "--resume",
            "--layout", "padded",  # the node loss and return are timed to padded's steps
            # an evaluation every step keeps one rank alone from finishing the run before
            # node B is back
            "--num-eval-prompts", "2", "--eval-every", "1", "--eval-new-tokens", "8",
            # as an elastic job should run (docs/TRAINER.md): a collective waits 60 s for a
            # rank, not gloo's 30 minutes; once, node A's ranks waited out the test's 240 s
            # after node B was killed, as if B were frozen (not understood)
            "--collective-timeout-s", "60", *extra,
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "DFLASH_LOADER_SHM_DIR": str(self.shm),
        }
        self.log = self.tmp / f"{self.name}-agent-{self.runs}.log"
        with open(self.log, "wb") as f:
            self.agent = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def rank(self) -> int:
        """The pid of the rank this node's agent runs now (it leads its own process group)."""
        assert self.agent is not None
        for pid in children(self.agent.pid):
            with contextlib.suppress(OSError):
                if b"trainer.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        raise AssertionError(f"{self.name}'s agent runs no rank")

    def lose(self) -> None:
        """The node dies at once: kill -9 of its agent, its rank and its daemon."""
        assert self.agent is not None and self.daemon is not None
        kill_tree(self.agent)
        self.daemon.kill()

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            kill_tree(self.agent)
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()
        import shutil

        shutil.rmtree(self.shm, ignore_errors=True)


def _epoch_end_alone(logs: str, corpus: Path, run_dir: Path, world: int) -> int:
    """The step at which node A alone ends epoch 0, from the pure plan of what the
    ``world``-rank leg it resumed after left (its step count read off the log)."""
    import json

    from loader_server.data.dataset import open_dataset
    from loader_server.planning.elastic import plan_rest, shaped
    from loader_server.wire.protocol import Leg
    from loader_server.wire.spec import BatchSpec

    line = logs.split(f"world_size {world} x grad_accum 1 -> 1 x 1 at epoch 0 step ")[1]
    k = int(line.split()[0].rstrip(":;,"))
    spec = BatchSpec.from_dict(json.loads((run_dir / "loader_spec.json").read_text()))
    lengths = open_dataset(corpus).lengths
    rest = plan_rest(lengths, shaped(spec, 1, 1), epoch=0, legs=[Leg(world, 1, k)])
    return k + rest.num_steps


def _sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits in process ``pid`` (frozen, it cannot take it yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: nothing is waiting to be told any more
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _wait(cond, what: str, nodes) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        for n in nodes:
            if n.agent is not None and n.agent.poll() not in (None, 0):
                pytest.fail(f"{n.name}'s agent exited {n.agent.returncode}:\n"
                            + n.log.read_text(errors="replace")[-3000:])  # fmt: skip
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@dataclass
class Cycles:
    """What a run of ``elastic_cycles`` left: the steps each resume started from (in
    order), the metrics by step, the agents' logs, the newest checkpoint folder."""

    resumed_at: list[int]
    records: dict[int, dict]
    logs: str
    last: Path
    timings: list[tuple[float, float]]  # (lost -> first step alone, back -> first on two)


def elastic_cycles(
    tmp_path: Path, *, cycles: int, steps: int, alone_steps: int = 3, ranks_b: int = 1,
    together_steps: int = 3, back_at_epoch_end: bool = False,
) -> Cycles:  # fmt: skip
    """Train ``steps`` (of all ranks' data) on two nodes, losing and restoring node B (with
    ``ranks_b`` ranks) ``cycles`` times after ``together_steps`` steps on both; every agent
    must end with 0. ``back_at_epoch_end``: node A alone trains until at most two of its
    micro-batches are left in epoch 0 (it may finish one more step before it is frozen),
    so node B returns in the epoch's last step, with too little left for one step of all
    ranks."""
    corpus = tmp_path / "corpus.arrow"
    write_corpus(corpus, SynthSpec(num_samples=600, seed=3, median_len=96, max_len=256,
                                   vocab_size=512, content="learnable"))  # fmt: skip
    run_dir, port = tmp_path / "run", _free_port()
    a = Node("a", corpus, tmp_path, port, is_host=True)
    b = Node("b", corpus, tmp_path, port, is_host=False, nproc=ranks_b)
    world = 1 + ranks_b
    back_line = f"-> {world} x 1 at epoch"  # the log line of node B's return

    def done() -> int:
        return max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")), default=0)

    def logs() -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted(tmp_path.glob("*-agent-*.log"))
        )

    marks = []
    try:
        a.start(run_dir, steps)
        b.start(run_dir, steps)
        mark = 0  # the step training on two nodes (re)started from
        for k in range(cycles):
            _wait(lambda mark=mark: done() >= mark + together_steps, "steps on both", (a, b))
            lost, since = time.time(), done()
            b.lose()
            n = k + 1  # losses (and returns) so far, this one included

            def alone(n: int = n, since: int = since) -> bool:
                if logs().count("-> 1 x 1 at epoch") < n:
                    return False
                if back_at_epoch_end:
                    return done() >= _epoch_end_alone(logs(), corpus, run_dir, world) - 2
                return done() >= since + alone_steps

            _wait(alone, "node A alone", (a,))
            frozen = a.rank()
            os.killpg(frozen, signal.SIGSTOP)  # see the module docstring
            try:
                back = time.time()
                b.start(run_dir, steps)
                marks.append((lost, back))
                _wait(lambda r=frozen: _sigterm_pending(r), "A's agent to stop A for B", (a, b))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(frozen, signal.SIGCONT)
            _wait(lambda n=n: logs().count(back_line) >= n, "node B back", (a, b))
            mark = done()
        _wait(lambda: a.agent.poll() == 0 and b.agent.poll() == 0, "the end of the run", (a, b))
    finally:
        a.stop()
        b.stop()
    text = logs()
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    starts = [
        int(x.split(" at step ")[1].split()[0]) for x in text.split("rank 0 resumed from ")[1:]
    ]
    starts = sorted(set(starts))
    times = {s: r.get("time") for s, r in records.items()}
    missing = [s + 1 for s in starts[: 2 * len(marks)] if s + 1 not in times]
    assert not missing, f"resumed at steps {starts}, but step(s) {missing} have no record"
    timings = [
        (times[starts[2 * i] + 1] - lost, times[starts[2 * i + 1] + 1] - back)
        for i, (lost, back) in enumerate(marks)
    ]
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    return Cycles(starts, records, text, last, timings)
