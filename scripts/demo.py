"""The README demo (`make demo`): the whole user path on CPU, from a chat dataset to a
drafter that Transformers reloads and drafts with.

1. generate a small chat dataset (ShareGPT and OpenAI rows, system prompts, several turns)
   and train a byte-level BPE tokenizer with a Qwen3-style chat template on it; save a
   tiny random-weight Qwen3 target with that tokenizer as a local checkpoint;
2. tokenize the conversations with the target's chat template (`dflash-train tokenize`);
3. regenerate every assistant reply with the target through a local OpenAI-compatible
   server (`dflash-train regen --server`), which also tokenizes the result;
4. inspect the corpus and compare batch plans (ours versus sort-once, random, 6 buckets);
5. start the loader daemon; two client processes read for a few seconds;
6. train a DFlash drafter with 2 ranks under torchrun, kill -9 one rank mid-run, and
   restart the job with --resume: it continues at the next batch, the daemon untouched;
7. export the drafter as a Hugging Face folder (`dflash-train export`), reload it with
   Transformers and run Transformers' own DFlash speculative decoding on the held-out
   prompts: the output equals the target's greedy output, and tau is printed;
8. stop the daemon (SIGTERM: clients told, shared memory unlinked);
9. measure the drafter as the field reports it (`dflash-train eval`): the built-in HumanEval,
   rendered with the target's chat template, every protocol's tau in one table.

Everything lands in demo-run/ (delete it to start over).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.servers.chat_server import running
from scripts.servers.daemon_process import DaemonProcess

DEMO_DIR = Path("demo-run")
PY = sys.executable
LOADER = [PY, "-m", "loader_server"]
TRAIN = [PY, "-m", "trainer.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
STEPS = 60
CONVERSATIONS = 500


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
    cmd = [PY, "-m", "benchmarks.loader_bench.consumer", endpoint, "--job", "readers",
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


def train_cmd(endpoint: str, run_dir: Path, heldout: Path, target: Path) -> list[str]:
    return [*TORCHRUN, "-m", "trainer.cli", "train", "--endpoint", endpoint,
            "--target", str(target), "--job", "demo", "--run-dir", str(run_dir),
            "--steps", str(STEPS),
            "--block-size", "8", "--anchors-per-doc", "16", "--token-budget", "2048",
            "--max-seq-len", "512", "--eval-every", "30",
            "--eval-prompts", str(heldout), "--num-eval-prompts", "8", "--eval-new-tokens", "32",
            "--ckpt-every", "10", "--no-progress"]  # fmt: skip


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def train_with_a_crash(endpoint: str, run_dir: Path, heldout: Path, target: Path) -> None:
    print(f"$ torchrun --nproc-per-node 2 -m trainer.cli train ... --steps {STEPS}  (then kill -9)")
    log = open(DEMO_DIR / "train-1.log", "wb")  # noqa: SIM115
    job = subprocess.Popen(train_cmd(endpoint, run_dir, heldout, target), stdout=log,
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
        subprocess.run([*train_cmd(endpoint, run_dir, heldout, target), "--resume"], stdout=log2,
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


@contextlib.contextmanager
def chat_server(model_dir: Path) -> Iterator[str]:
    """The target behind a local OpenAI-compatible server (as SGLang or vLLM would serve it)."""
    args = ["--model", str(model_dir), "--batch", "16", "--port", "0"]
    print("$ python scripts/servers/chat_server.py", " ".join(args), " (an SGLang/vLLM stand-in)")
    try:
        with running(args, DEMO_DIR / "chat-server.log", python=PY) as url:
            yield url
    except RuntimeError as e:  # it did not start: its log says why
        raise SystemExit(str(e)) from None


def prepare_data(chat: Path, target: Path, corpus: Path) -> None:
    """Conversations -> tokenizer + target checkpoint -> tokenized and regenerated corpus."""
    if not (chat / "conversations.jsonl").exists():
        sh(PY, "-m", "scripts.fixtures.tiny_chat", str(chat), "--conversations", str(CONVERSATIONS),
           "--words", "40", "--template", "qwen3")  # fmt: skip
    if not (target / "config.json").exists():
        sh(*TRAIN, "save-target", str(target), "--tiny-vocab", "1024",
           "--tokenizer", str(chat / "tokenizer"))  # fmt: skip
    original = DEMO_DIR / "corpus-original"
    if not original.exists():
        sh(*TRAIN, "tokenize", str(chat / "conversations.jsonl"), str(original),
           "--tokenizer", str(target), "--no-thinking", "--workers", "2",
           "--no-progress")  # fmt: skip
    if not corpus.exists():
        with chat_server(target) as url:
            sh(*TRAIN, "regen", str(chat / "conversations.jsonl"), str(corpus), "--server", url,
               "--tokenizer", str(target), "--max-tokens", "40", "--concurrency", "16",
               "--holdout", "16", "--no-progress")  # fmt: skip


def count_calls(module: Any) -> list[int]:
    """A one-element counter of ``module``'s forward calls (reset it by assigning 0)."""
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def reload_and_draft(target_dir: Path, drafter_dir: Path, heldout: Path) -> None:
    """Transformers loads the export and runs its own DFlash loop with it."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from trainer.data.regen import load_prompts

    print(f"reload {drafter_dir} with transformers (trust_remote_code) and draft with it:")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).float().eval()
    target_calls, drafter_calls = count_calls(target), count_calls(drafter)
    taus, lossless = [], True
    for prompt in load_prompts(heldout)[:8]:
        ids, kw = prompt[None], dict(do_sample=False, max_new_tokens=32, min_new_tokens=32)
        greedy = target.generate(ids, **kw)
        target_calls[0] = drafter_calls[0] = 0
        spec = target.generate(ids, assistant_model=drafter, speculation_type="dflash", **kw)
        lossless &= torch.equal(spec, greedy)
        # After the prefill, each drafting step commits accepted + 1 tokens; a target
        # forward without a drafter call (the very last token) commits one.
        plain_steps = target_calls[0] - 1 - drafter_calls[0]
        drafted = spec.shape[1] - ids.shape[1] - 1 - plain_steps
        taus.append(drafted / max(drafter_calls[0], 1))
    print(
        f"  {len(taus)} held-out prompts: speculative output == target greedy output: "
        f"{lossless}; tau (Transformers' DFlash loop) {sum(taus) / len(taus):.2f}"
    )
    if not lossless:
        raise SystemExit("the reloaded drafter changed the target's output")


_STOPPING: list[int] = []


def _stop(signum: int, frame: Any) -> None:
    if not _STOPPING:  # once: a second signal does not cut the cleanup short
        _STOPPING.append(signum)
        raise SystemExit(128 + signum)


def main() -> None:
    # SIGTERM/SIGHUP end the demo as Ctrl-C does, through its finally blocks (the chat
    # server and the daemon are stopped); on kill -9 the chat server still follows.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:  # nohup's ignored SIGHUP stays ignored
            signal.signal(sig, _stop)
    DEMO_DIR.mkdir(exist_ok=True)
    chat, target, corpus = DEMO_DIR / "chat", DEMO_DIR / "target", DEMO_DIR / "corpus"
    prepare_data(chat, target, corpus)
    heldout = corpus / "heldout.jsonl"
    sh(*LOADER, "inspect", str(corpus))
    sh(*LOADER, "plan", str(corpus), "--token-budget", "2048", "--max-seq-len", "512",
       "--world-size", "2", "--compare")  # fmt: skip
    print(
        "  (a corpus this small fills few micro-batches: `auto` keeps >= 24 per bucket; the\n"
        "   902K-sample comparison is `python benchmarks/bench_planner.py`, README 'Measured')"
    )
    endpoint = f"ipc://{DEMO_DIR.resolve()}/loader.sock"
    daemon = start_daemon(corpus, endpoint)
    try:
        print("two client processes (ranks of job 'readers') read for 2 s:")
        consume(endpoint, 2, 2.0)
        run_dir = DEMO_DIR / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        train_with_a_crash(endpoint, run_dir, heldout, target)
        summarize(run_dir)
        plots = sh(*TRAIN, "plot", str(run_dir), quiet=True).split()
        print("plots: " + ", ".join(plots))
        sh(*LOADER, "stats", "--endpoint", endpoint)
    finally:
        print(f"daemon stopped with exit code {daemon.stop()}")
    drafter = DEMO_DIR / "drafter"
    sh(*TRAIN, "export", str(run_dir), str(drafter), "--force")
    reload_and_draft(target, drafter, heldout)
    sh(*TRAIN, "eval", str(drafter), "--target", str(target), "--sets", "humaneval",
       "--limit", "16", "--max-new-tokens", "64", "--out", str(DEMO_DIR / "eval"),
       "--force")  # fmt: skip


if __name__ == "__main__":
    main()
