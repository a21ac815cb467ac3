"""``dflash-train tokenize`` against a plain ``apply_chat_template`` loop.

Generates N synthetic conversations (default 100000, ~1K tokens each with the local byte-level
BPE of ``scripts/tiny_chat.py``; alternating OpenAI and ShareGPT shapes, 1-3 turns), writes
them as JSONL, then times:

* baseline: one process, ``for conv: tok.apply_chat_template(messages, tokenize=True)``
  (conversations already parsed and normalized in memory: the baseline gets that for free);
* tokenize: ``tokenize_corpus(jsonl, out, options=TokenizeOptions(workers=W))`` end to end:
  read and parse the JSONL,
  render, tokenize, build the loss masks, write the Arrow shards.

Prints conversations/s and tokens/s side by side and the ratio (target: >= 1.8x with 2
workers on 2 cores), and the CPU milliseconds per conversation of each (the tokenize figure
includes the worker processes), which a busy machine disturbs less than wall time::

    python benchmarks/bench_tokenize.py --conversations 20000 --workers 2 --rounds 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.tiny_chat import build_tokenizer, generate_conversations, write_jsonl
from trainer.data.encoder import ChatEncoder
from trainer.data.messages import to_messages
from trainer.data.tokenize import tokenize_corpus
from trainer.options import TokenizeOptions


def baseline(tok: object, conversations: list[list[dict]]) -> tuple[float, float, int]:
    """Seconds, CPU seconds and tokens of the plain single-process loop."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for messages in conversations:
        tokens += len(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def ours(src: Path, out: Path, tok_dir: Path, workers: int) -> tuple[float, float, int]:
    """Seconds, CPU seconds (with the worker pool's) and tokens of ``tokenize_corpus``."""
    t0, c0 = time.perf_counter(), _cpu_all()
    options = TokenizeOptions(workers=workers)
    report = tokenize_corpus(
        [src], out, tokenizer=tok_dir, options=options, force=True, progress=False
    )
    if report["fallback_conversations"] or report["malformed_rows"]:
        raise SystemExit(f"unexpected fallbacks or malformed rows: {report}")
    return time.perf_counter() - t0, _cpu_all() - c0, report["tokens"]


def _cpu_all() -> float:
    """CPU seconds of this process and its reaped children (the worker pool)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--words", type=int, default=880, help="~1K tokens per conversation.")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Alternate baseline and tokenize on this many equal parts (a shared machine's "
        "load drift then hits both alike).",
    )
    p.add_argument("--template", default="chatml", choices=["chatml", "qwen3"])
    p.add_argument("--dir", type=Path, help="Work folder (default: a temporary one).")
    p.add_argument("--json", action="store_true", help="Print the result as JSON too.")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        tok_dir = build_tokenizer(root / "tokenizer", template=args.template)
        tok = ChatEncoder(tok_dir).tokenizer
        stream = generate_conversations(args.conversations, seed=0, words=args.words)
        size = -(-args.conversations // args.rounds)
        totals, ratios = np.zeros((2, 3)), []
        for k in range(args.rounds):
            part = list(itertools.islice(stream, size))
            if not part:
                break
            src = write_jsonl(root / f"part{k}.jsonl", part)
            b = baseline(tok, [to_messages(r) for r in part])
            n = len(part)
            del part  # a small parent heap when the workers fork, as under the CLI
            o = ours(src, root / "corpus", tok_dir, args.workers)
            if b[2] != o[2]:
                raise SystemExit(f"token counts differ: baseline {b[2]}, tokenize {o[2]}")
            totals += [b, o]
            ratios.append(b[0] / o[0])
            print(
                f"round {k}: {n} conversations, baseline {b[0]:.1f} s, tokenize "
                f"{o[0]:.1f} s ({b[0] / o[0]:.2f}x), load {os.getloadavg()[0]:.2f}",
                file=sys.stderr,
            )
    result = _result(args, totals)
    result["round_speedups"] = [round(r, 2) for r in ratios]
    result["median_round_speedup"] = round(float(np.median(ratios)), 2)
    _print(result, args.workers)
    if args.json:
        print(json.dumps(result))


def _result(args: argparse.Namespace, totals: np.ndarray) -> dict:
    (base_s, base_cpu, tokens), (ours_s, ours_cpu, _) = totals
    n = args.conversations
    return {
        "conversations": n,
        "rounds": args.rounds,
        "tokens_per_conversation": round(tokens / n, 1),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m": os.getloadavg()[0],
        "workers": args.workers,
        "baseline_conv_s": round(n / base_s, 1),
        "baseline_tok_s": round(tokens / base_s),
        "baseline_s": round(base_s, 2),
        "baseline_cpu_ms_per_conv": round(base_cpu / n * 1e3, 3),
        "tokenize_conv_s": round(n / ours_s, 1),
        "tokenize_tok_s": round(tokens / ours_s),
        "tokenize_s": round(ours_s, 2),
        "tokenize_cpu_ms_per_conv": round(ours_cpu / n * 1e3, 3),
        "speedup": round(base_s / ours_s, 2),
    }


def _print(r: dict, workers: int) -> None:
    print(f"{r['conversations']} conversations, {r['tokens_per_conversation']} tokens each")
    print(f"{'':24}{'conv/s':>10}{'tokens/s':>12}{'seconds':>10}{'cpu ms/conv':>13}")
    for label, kind in (
        ("apply_chat_template", "baseline"),
        (f"tokenize --workers {workers}", "tokenize"),
    ):
        print(
            f"{label:24}{r[kind + '_conv_s']:10.0f}{r[kind + '_tok_s']:12,}{r[kind + '_s']:10.1f}"
            f"{r[kind + '_cpu_ms_per_conv']:13.2f}"
        )
    print(
        f"speedup: {r['speedup']:.2f}x overall, {r['median_round_speedup']:.2f}x median round "
        f"(target >= 1.8x); {r['cpus']} CPUs, load average {r['load_avg_1m']:.2f} at the end"
    )


if __name__ == "__main__":
    main()
