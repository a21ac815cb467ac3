"""The README demo (`make demo`): the whole story on a small synthetic corpus.

1. synthesize a corpus and inspect it;
2. compare batch plans (ours versus sort-once, random and the reference 6 buckets);
3. start the loader daemon, run two client processes (ranks of one job) for a few
   seconds and print what they received;
4. stop the daemon (SIGTERM: clients told, shared memory unlinked).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

DEMO_DIR = Path("demo-run")
CLI = [sys.executable, "-m", "loader_server"]


def sh(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def start_daemon(corpus: Path, endpoint: str) -> subprocess.Popen:
    log = DEMO_DIR / "daemon.log"
    print(f"$ dflash-loader serve --dataset {corpus} --endpoint {endpoint}  (log: {log})")
    out = open(log, "wb")  # noqa: SIM115 - the daemon owns it until stop
    proc = subprocess.Popen([*CLI, "serve", "--dataset", str(corpus), "--endpoint", endpoint],
                            stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while "READY endpoint=" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"daemon did not start:\n{log.read_text()}")
        time.sleep(0.05)
    print("  " + next(x for x in log.read_text().splitlines() if "READY" in x))
    return proc


def consume(endpoint: str, world: int, seconds: float) -> None:
    cmd = [sys.executable, "-m", "loader_server.bench.consumer", endpoint, "--job", "demo",
           "--world", str(world), "--seconds", str(seconds)]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        r = json.loads(p.communicate(timeout=seconds + 60)[0])
        print(
            f"  rank {r['rank']}: {r['batches']} micro-batches, "
            f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s, first batch after "
            f"{r['first_batch_s'] * 1e3:.0f} ms, next() p99 {r['next_p99_ms']:.2f} ms, "
            f"client RSS {r['rss_mb']:.0f} MB"
        )


def main() -> None:
    DEMO_DIR.mkdir(exist_ok=True)
    corpus = DEMO_DIR / "corpus"
    if not corpus.exists():
        sh(*CLI, "synth", str(corpus), "--samples", "20000", "--shards", "2")
    sh(*CLI, "inspect", str(corpus))
    sh(*CLI, "plan", str(corpus), "--world-size", "2", "--compare")
    endpoint = f"ipc://{DEMO_DIR.resolve()}/loader.sock"
    daemon = start_daemon(corpus, endpoint)
    try:
        print("two client processes (ranks 0 and 1 of job 'demo') read for 3 s:")
        consume(endpoint, 2, 3.0)
        sh(*CLI, "stats", "--endpoint", endpoint)
    finally:
        daemon.send_signal(signal.SIGTERM)
        print(f"daemon stopped with exit code {daemon.wait(30)}")


if __name__ == "__main__":
    main()
