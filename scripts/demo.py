"""The README demo (`make demo`): the whole story on a small synthetic corpus, on CPU.

1. synthesize a learnable corpus and regenerate its responses with the (tiny) target;
2. inspect it and compare batch plans (ours versus sort-once, random, 6 buckets);
3. start the loader daemon; two client processes read for a few seconds;
4. train a DFlash drafter with 2 ranks under torchrun, kill -9 one rank mid-run, and
   restart the job with --resume: it continues at the next batch, the daemon untouched;
5. print the summary (loss, tau, steps/s, data wait) and where the plots are;
6. stop the daemon (SIGTERM: clients told, shared memory unlinked).

Everything lands in demo-run/ (delete it to start over).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from loader_server.launch import DaemonProcess

DEMO_DIR = Path("demo-run")
PY = sys.executable
LOADER = [PY, "-m", "loader_server"]
TRAIN = [PY, "-m", "trainer.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
STEPS = 60


def sh(*args: str, quiet: bool = False) -> str:
    print("$", " ".join(a.replace(PY, "python") for a in args), flush=True)
    out = subprocess.run(args, check=True, text=True, stdout=subprocess.PIPE if quiet else None)
    return out.stdout or ""


def start_daemon(corpus: Path, endpoint: str) -> DaemonProcess:
    log = DEMO_DIR / "daemon.log"
    print(f"$ dflash-loader serve --dataset {corpus} --endpoint {endpoint}  (log: {log})")
    d = DaemonProcess(corpus, endpoint, "--token-budget", "2048", "--max-seq-len", "512",
                      log_path=log)  # fmt: skip
    print("  " + d.ready_line())
    return d


def consume(endpoint: str, world: int, seconds: float) -> None:
    cmd = [PY, "-m", "loader_server.bench.consumer", endpoint, "--job", "readers",
           "--world", str(world), "--seconds", str(seconds)]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        r = json.loads(p.communicate(timeout=seconds + 60)[0])
        print(
            f"  rank {r['rank']}: {r['batches']} micro-batches, "
            f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s, first batch after "
            f"{r['first_batch_s'] * 1e3:.0f} ms, next() p99 {r['next_p99_ms']:.2f} ms"
        )


def train_cmd(endpoint: str, run_dir: Path, heldout: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, *extra, "-m", "trainer.cli", "train", "--endpoint", endpoint,
            "--job", "demo", "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--block-size", "8", "--num-anchors", "16", "--token-budget", "2048",
            "--max-seq-len", "512", "--lr", "3e-3", "--eval-every", "30",
            "--eval-prompts", str(heldout), "--num-eval-prompts", "8", "--eval-new-tokens", "32",
            "--ckpt-every", "10", "--no-progress"]  # fmt: skip


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def train_with_a_crash(endpoint: str, run_dir: Path, heldout: Path) -> None:
    print(f"$ torchrun --nproc-per-node 2 -m trainer.cli train ... --steps {STEPS}  (then kill -9)")
    log = open(DEMO_DIR / "train-1.log", "wb")  # noqa: SIM115
    job = subprocess.Popen(train_cmd(endpoint, run_dir, heldout), stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while steps_logged(run_dir) < 25:
        if job.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"training stopped early:\n{(DEMO_DIR / 'train-1.log').read_text()}")
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
    victim = int(workers.stdout.split()[-1])  # a rank process (torchrun's child)
    print(f"  step {steps_logged(run_dir)}: kill -9 rank process {victim}")
    os.kill(victim, signal.SIGKILL)
    job.wait(120)
    print(f"  torchrun exited with {job.returncode}; last checkpoint kept the loader position")
    print("$ torchrun ... train --resume   (the daemon keeps running, nothing reloaded)")
    with open(DEMO_DIR / "train-2.log", "wb") as log2:
        subprocess.run([*train_cmd(endpoint, run_dir, heldout), "--resume"], stdout=log2,
                       stderr=subprocess.STDOUT, check=True)  # fmt: skip
    resumed = [x for x in (DEMO_DIR / "train-2.log").read_text().splitlines() if "resum" in x]
    for line in resumed[:2]:
        print("  " + line.split(": ", 1)[-1])


def summarize(run_dir: Path) -> None:
    s = json.loads((run_dir / "summary.json").read_text())
    print(
        f"summary: {s['steps']} optimizer steps (2 ranks), loss {s['first_loss']:.2f} -> "
        f"{s['last_loss']:.2f}, tau {s['first_tau']:.2f} -> {s['last_tau']:.2f}, "
        f"{s['median_steps_per_s']:.1f} steps/s, data wait {s['mean_data_wait_frac']:.1%} "
        f"of step time; resumed: {s['resumed']}"
    )
    print(
        f"full summary: {run_dir / 'summary.json'}, per-step metrics: {run_dir / 'metrics.jsonl'}"
    )


def main() -> None:
    DEMO_DIR.mkdir(exist_ok=True)
    raw, corpus = DEMO_DIR / "corpus-raw", DEMO_DIR / "corpus.arrow"
    heldout = corpus.with_suffix(".heldout.jsonl")
    if not corpus.exists():
        sh(*LOADER, "synth", str(raw), "--samples", "500", "--content", "learnable",
           "--vocab-size", "512", "--median-len", "100", "--max-len", "384")  # fmt: skip
        sh(*TRAIN, "regen", str(raw), str(corpus), "--holdout", "16", "--no-progress")
    sh(*LOADER, "inspect", str(corpus))
    sh(*LOADER, "plan", str(corpus), "--token-budget", "2048", "--max-seq-len", "512",
       "--world-size", "2", "--compare")  # fmt: skip
    endpoint = f"ipc://{DEMO_DIR.resolve()}/loader.sock"
    daemon = start_daemon(corpus, endpoint)
    try:
        print("two client processes (ranks of job 'readers') read for 2 s:")
        consume(endpoint, 2, 2.0)
        run_dir = DEMO_DIR / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        train_with_a_crash(endpoint, run_dir, heldout)
        summarize(run_dir)
        plots = sh(*TRAIN, "plot", str(run_dir), quiet=True).split()
        print("plots: " + ", ".join(plots))
        sh(*LOADER, "stats", "--endpoint", endpoint)
    finally:
        print(f"daemon stopped with exit code {daemon.stop()}")


if __name__ == "__main__":
    main()
