"""A 2-rank CPU training job with the Qwen3 vocabulary, as a new user would start one.

The daemon serves 2,048-token samples (``--token-budget 4096 --max-seq-len 2048``, so two
documents per micro-batch); the tiny target has a 151,936-token vocabulary; every trainer
flag is at its default except ``--anchors-per-doc 256``. Prints steps, peak RSS per rank (the
largest over ranks and steps), step time and loss. Before the chunked head this job was
killed by the OOM killer at 22-23 GB per rank.

    python benchmarks/bench_trainer_job.py [--steps 16] [--work /tmp/dflash-job]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from scripts.servers.daemon_process import DaemonProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-job"))
    ap.add_argument("--anchors-per-doc", type=int, default=256)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.arrow"
    if not corpus.exists():
        subprocess.run(
            [sys.executable, "-m", "loader_server", "synth", str(corpus), "--samples", "400",
             "--median-len", "2400", "--sigma", "0.3", "--min-len", "2048", "--max-len", "4096",
             "--vocab-size", "151936", "--content", "learnable"],
            check=True,
        )  # fmt: skip
    run_dir = args.work / f"run-{int(time.time())}"
    daemon = DaemonProcess(
        corpus,
        f"ipc://{args.work}/loader.sock",
        "--token-budget", "4096", "--max-seq-len", "2048",
        log_path=args.work / "daemon.log",
    )  # fmt: skip
    try:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "trainer.cli", "train", "--endpoint", daemon.endpoint,
            "--target", "tiny", "--tiny-vocab", "151936", "--steps", str(args.steps),
            "--anchors-per-doc", str(args.anchors_per_doc), "--run-dir", str(run_dir),
            "--no-progress",
        ]  # fmt: skip
        t0 = time.perf_counter()
        with open(args.work / "train.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - t0
    finally:
        daemon.stop()
    if rc != 0:
        sys.exit(f"training failed (rc {rc}); see {args.work / 'train.log'}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["step"] > 0]
    print(f"steps completed: {len(steps)} of {args.steps} (wall {wall:.0f} s, evaluation included)")
    print(f"peak RSS, max over ranks: {max(r['rss_peak_gb'] for r in steps):.2f} GB (target < 6)")
    print(f"median step time: {statistics.median(r['step_time_s'] for r in steps):.1f} s")
    anchors = statistics.median(r["anchors_per_micro"] for r in steps)
    print(f"anchors per micro-batch: {anchors:.0f}")
    first, last = steps[0]["loss"], steps[-1]["loss"]
    k = min(4, len(steps) // 2)
    head = statistics.mean(r["loss"] for r in steps[:k])
    tail = statistics.mean(r["loss"] for r in steps[-k:])
    print(f"loss: step 1 {first:.3f} -> step {len(steps)} {last:.3f}; mean of first/last {k}: "
          f"{head:.3f} -> {tail:.3f} ({'falls' if tail < head else 'DOES NOT FALL'})")  # fmt: skip


if __name__ == "__main__":
    main()
