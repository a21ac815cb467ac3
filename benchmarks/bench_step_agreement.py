"""What it costs every rank to agree on each micro-batch's fetch (``trainer.train.
loader_failure.agree``): the price of one rank's loader failure stopping all ranks at once.

Two gloo ranks on CPU (torchrun) time ``agree()`` (one 3-element max all-reduce) against
the one per-step collective the loop already had (``stop.agreed``, 1 element), then the
demo-shaped tiny step (``bench_trainer_tiny.measure``, one process) gives the step time the
added cost is a share of.

    python benchmarks/bench_step_agreement.py [--calls 2000] [--grad-accum 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(calls: int) -> None:
    from trainer.train import stop
    from trainer.train.distributed import init_distributed, shutdown
    from trainer.train.loader_failure import Fetch, agree

    env = init_distributed("cpu")
    out = {}
    for name, fn in (("agree", lambda: agree(Fetch.GOT, env)), ("stop", lambda: stop.agreed(env))):
        for _ in range(100):  # warm-up
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls
    if env.is_main:
        print(json.dumps(out))
    shutdown(env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=20, help="tiny micro-batches timed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.calls)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, "--worker", "--calls", str(args.calls)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    costs = json.loads(res.stdout.strip().splitlines()[-1])
    from benchmarks.bench_trainer_tiny import measure

    step = 1 / measure(args.steps)["micro_per_s"]  # one micro-batch: the smallest step
    added = costs["agree"] * args.grad_accum
    print(f"agree (per micro-batch, 2 gloo ranks): {1e6 * costs['agree']:.1f} us; "
          f"stop.agreed (per step, before): {1e6 * costs['stop']:.1f} us")  # fmt: skip
    print(f"per step with grad_accum {args.grad_accum}: +{1e6 * added:.1f} us on a "
          f"{1e3 * step:.1f} ms tiny step = {100 * added / step:.3f}% "
          f"({added / costs['stop']:.2f}x the stop check already there)")  # fmt: skip


if __name__ == "__main__":
    main()
