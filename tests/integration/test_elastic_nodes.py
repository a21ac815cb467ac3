"""Two "nodes" on one machine under torchrun's elastic launcher (``tests/elastic_nodes.py``):
node B lost with kill -9, node A continues alone under world size 1, node B comes back and
both finish under world size 2; every step once, the LR clock at the data of all steps.
And node B's daemon alone lost: both ranks stop together, with one final checkpoint."""

from __future__ import annotations

import time

import pytest
import torch
from elastic_nodes import Node, _free_port, _wait, elastic_cycles

from loader_server.data.synth import SynthSpec, write_corpus
from trainer.train.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.heavy(62)]


def test_a_job_loses_a_node_continues_alone_and_grows_back_in_the_epoch_s_last_step(tmp_path):
    """Node B (2 ranks) is lost mid-epoch; node A trains alone to the epoch's last step;
    node B returns when what is left cannot fill one step of 3 ranks: the rest is served
    as one short step, and the job goes on into the next epoch under 3 ranks."""
    steps = 40  # 120 micro-batches: past the 102 of epoch 0
    run = elastic_cycles(tmp_path, cycles=1, steps=steps, ranks_b=2, together_steps=24,
                         back_at_epoch_end=True)  # fmt: skip
    assert "world_size 3 x grad_accum 1 -> 1 x 1 at epoch 0" in run.logs
    assert "world_size 1 x grad_accum 1 -> 3 x 1 at epoch 0" in run.logs
    assert "too few for one step" not in run.logs and "none of them" not in run.logs
    assert sorted(run.records) == list(range(max(run.records) + 1))  # every step once
    k1, k2 = run.resumed_at
    after = [run.records[s] for s in range(k2 + 1, max(run.records) + 1)]
    assert after[0]["epoch"] == 0 and all(r["epoch"] == 1 for r in after[1:]), after[:3]
    model = torch.load(run.last / "model.pt", weights_only=True)
    assert model["world_size"] == 3 and model["epoch"] == 1
    assert 3 * steps <= model["clock"]["micro"] <= 3 * steps + 2
    legs = torch.load(run.last / "rank-00000.pt", weights_only=True)["loader"]["legs"]
    assert legs == []  # epoch 1 is planned whole for 3 ranks
    lost, back = run.timings[0]
    print(f"node lost -> first step alone: {lost:.1f} s; node back -> first step on both "
          f"nodes: {back:.1f} s; steps alone: {k2 - k1}")  # fmt: skip


HANG = """
import sys, time, torch
from trainer.train.distributed import init_distributed
env = init_distributed("cpu", timeout_s=float(sys.argv[1]))
if env.rank == 1:
    time.sleep(60)  # a frozen node: alive, never reaching the collective
t0 = time.monotonic()
try:
    torch.distributed.all_reduce(torch.ones(1))
except Exception as e:
    print(f"FAILED after {time.monotonic() - t0:.1f} s: {type(e).__name__}", flush=True)
    sys.exit(3)
"""


def test_a_frozen_rank_fails_the_collective_at_the_timeout_given(tmp_path):
    """--collective-timeout-s reaches the process group: rank 0 waiting on a frozen rank 1
    fails after about that long (gloo's own default is 30 minutes)."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(HANG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), "3"]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.monotonic() - t0 < 50
    line = next(x for x in out.stdout.splitlines() if x.startswith("FAILED after"))
    assert 2.5 <= float(line.split()[2]) <= 15, line


def test_one_rank_s_loader_failure_stops_every_rank_at_once(tmp_path):
    """Node B's daemon dies (kill -9) while node A's serves on: B's rank gives up after its
    --timeout-s, and A's rank, which would otherwise wait in the gradient all-reduce until
    the process group's timeout, stops with it. Both save the last completed step once
    (one collective checkpoint), and each ends with one line naming what to do."""
    corpus = tmp_path / "corpus.arrow"
    write_corpus(corpus, SynthSpec(num_samples=600, seed=3, median_len=96, max_len=256,
                                   vocab_size=512, content="learnable"))  # fmt: skip
    run_dir, port = tmp_path / "run", _free_port()
    a = Node("a", corpus, tmp_path, port, is_host=True)
    b = Node("b", corpus, tmp_path, port, is_host=False)
    flags = ("--timeout-s", "3", "--ckpt-every", "1000", "--eval-every", "0")
    try:
        a.start(run_dir, 500, *flags, max_restarts=0)
        b.start(run_dir, 500, *flags, max_restarts=0)
        _wait(lambda: max(records(run_dir), default=0) >= 3, "steps on two nodes", (a, b))
        assert b.daemon is not None and a.agent is not None and b.agent is not None
        b.daemon.kill()
        t0 = time.monotonic()
        a.agent.wait(timeout=120)
        b.agent.wait(timeout=120)
        stopped_in = time.monotonic() - t0
    finally:
        a.stop()
        b.stop()
    assert a.agent.returncode != 0 and b.agent.returncode != 0
    print(f"both ranks stopped {stopped_in:.1f} s after node B's daemon died (--timeout-s 3)")
    assert stopped_in < 60  # the client's 3 s and the final save, not gloo's 30 minutes
    last = max(records(run_dir))
    (ckpt,) = sorted((run_dir / "checkpoints").iterdir())  # the one final checkpoint
    assert ckpt.name == f"step-{last:08d}"
    line_a = _error_line(a.log.read_text(errors="replace"))
    line_b = _error_line(b.log.read_text(errors="replace"))
    assert "rank 1's loader failed" in line_a and f"saved checkpoint {ckpt.name}" in line_a
    assert str(b.daemon.endpoint) in line_b and "--resume" in line_b and "--resume" in line_a
    # Resuming from it on both nodes repeats no step and skips none.
    assert torch.load(ckpt / "model.pt", weights_only=False)["step"] == last


def records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def _error_line(log: str) -> str:
    lines = [x for x in log.splitlines() if "Error: training stopped after step" in x]
    assert lines, log[-3000:]
    return lines[-1]
