"""Two "nodes" on one machine under torchrun's elastic launcher (``tests/elastic_nodes.py``):
node B lost with kill -9, node A continues alone under world size 1, node B comes back and
both finish under world size 2; every step once, the LR clock at the data of all steps."""

from __future__ import annotations

import time

import pytest
import torch
from elastic_nodes import elastic_cycles

pytestmark = [pytest.mark.integration, pytest.mark.heavy(55)]


def test_a_job_loses_a_node_continues_alone_and_grows_back(tmp_path):
    steps = 24
    run = elastic_cycles(tmp_path, cycles=1, steps=steps)
    assert "world_size 2 x grad_accum 1 -> 1 x 1 at epoch 0" in run.logs
    assert "world_size 1 x grad_accum 1 -> 2 x 1 at epoch 0" in run.logs
    assert sorted(run.records) == list(range(max(run.records) + 1))  # every step once
    k1, k2 = run.resumed_at
    model = torch.load(run.last / "model.pt", weights_only=True)
    assert model["world_size"] == 2 and 2 * steps <= model["clock"]["micro"] <= 2 * steps + 1
    legs = torch.load(run.last / "rank-00000.pt", weights_only=True)["loader"]["legs"]
    assert legs == [[2, 1, k1], [1, 1, k2 - k1]]  # both shape changes, in epoch 0
    assert k2 - k1 < 2 * (steps - k1) - 2  # node B came back with data left for two
    lost, back = run.timings[0]
    print(f"node lost -> first step alone: {lost:.1f} s; node back -> first step on two "
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
