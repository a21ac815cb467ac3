"""``dflash-train tokenize`` against a plain ``apply_chat_template`` loop, by default with the
real Qwen3 tokenizer (``scripts/fixtures/qwen3_tokenizer.py``, built offline) on real conversations
(``scripts/fixtures/real_chats.py``).

Sets (``--sets``, default ``pairs,long-all``):

* ``pairs``: ``--pairs-rows`` rows (2000), each two HumanEval problems in one chat: 0.5K-2.2K
  Qwen tokens, 1.04K on average;
* ``long-all``: 478 standard-library modules as long replies: 1.1K-9.4K tokens, 3.7K mean;
* ``short`` / ``long``: the tests' 164 HumanEval / 144 stdlib rows (under a second of
  tokenizer work: the fixed costs, tokenizer load and pool start, weigh in);
* ``toy``: ``--conversations`` synthetic rows of ~1K tokens with the 1,024-token byte-level
  BPE of ``scripts/fixtures/tiny_chat.py`` (``--template chatml|qwen3``), the benchmark's old mode.

Every measurement is a fresh process, its imports done before its clock starts:

* baseline: load the tokenizer (not timed: printed as ``load``), parse the rows into
  messages (not timed), then time ``for messages: tok.apply_chat_template(messages,
  tokenize=True)``, one process;
* ``tokenize --workers W``: ``tokenize_corpus(jsonl, out, tokenizer=folder,
  options=TokenizeOptions(workers=W))`` end to end: the tokenizer load, reading and parsing
  the JSONL, the pool, render, tokenize, mask, the shards and the report.

Each round runs every mode once, in turn (baseline, ``--workers 1``, ``--workers 2``), so a
shared machine's drift hits all alike; the ratios to the baseline are taken within a round
and the table shows each column's median over the rounds: ``x wall``, how much faster
than the loop; ``x cpu``, the loop's CPU seconds per CPU second spent (worker processes
included); ``x e2e``, ``x wall`` with the loop's tokenizer load added to its time, as a
script doing the same would spend it (``tokenize`` always includes its own)::

    python benchmarks/bench_tokenize.py                      # pairs and long-all, 3 rounds
    python benchmarks/bench_tokenize.py --sets short,long --rounds 5
    python benchmarks/bench_tokenize.py --sets toy --conversations 30000
    TOKENIZERS_PARALLELISM=false python benchmarks/bench_tokenize.py --workers 1  # one CPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETS = ("pairs", "long-all", "short", "long", "toy")


def write_set(name: str, root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The set's JSONL and its tokenizer folder."""
    from scripts.fixtures import real_chats, tiny_chat

    out = root / f"{name}.jsonl"
    if name == "toy":
        toy = tiny_chat.generate_conversations(args.conversations, seed=0, words=args.words)
        tiny_chat.write_jsonl(out, toy)
        return out, tiny_chat.build_tokenizer(root / "toy-tokenizer", template=args.template)
    from scripts.fixtures.qwen3_tokenizer import qwen3_tokenizer_dir

    rows = {
        "pairs": lambda: real_chats.short_pairs(args.pairs_rows),
        "long-all": lambda: real_chats.long_set(packages=True),
        "short": real_chats.short_set,
        "long": real_chats.long_set,
    }[name]()
    return real_chats.write_jsonl(rows, out), qwen3_tokenizer_dir()


def _cpu_all() -> float:
    """CPU seconds of this process (all its threads) and its reaped children (the pool)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def one(mode: str, src: Path, tok_dir: Path, out: Path) -> dict:
    """One measurement in this (fresh) process: ``baseline`` or ``workers=W``."""
    import transformers  # noqa: F401  (imported before the clock, for both modes)

    from trainer.data.messages import to_messages
    from trainer.data.tokenize import tokenize_corpus
    from trainer.data.tokenizer import load_tokenizer
    from trainer.options import TokenizeOptions

    rows = sum(1 for line in src.open("rb") if line.strip())
    if mode == "baseline":
        t0 = time.perf_counter()
        tok = load_tokenizer(str(tok_dir))
        load = time.perf_counter() - t0
        conversations = [to_messages(json.loads(line)) for line in src.open("rb")]
        t0, c0 = time.perf_counter(), _cpu_all()
        tokens = 0
        for messages in conversations:
            tokens += len(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
        wall, cpu = time.perf_counter() - t0, _cpu_all() - c0
        return {"wall": wall, "cpu": cpu, "tokens": tokens, "rows": rows, "load": load}
    options = TokenizeOptions(workers=int(mode))
    t0, c0 = time.perf_counter(), _cpu_all()
    report = tokenize_corpus(
        [src], out, tokenizer=tok_dir, options=options, force=True, progress=False
    )
    wall, cpu = time.perf_counter() - t0, _cpu_all() - c0
    if report["malformed_rows"] or report["conversations"] != rows:
        raise SystemExit(f"unexpected malformed or missing rows: {report}")
    return {"wall": wall, "cpu": cpu, "tokens": report["tokens"], "rows": rows}


def measure(mode: str, src: Path, tok_dir: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--one", mode, str(src), str(tok_dir), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_set(name: str, root: Path, args: argparse.Namespace) -> dict:
    src, tok_dir = write_set(name, root, args)
    modes = ["baseline", *map(str, args.workers)]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(args.rounds):
        for m in modes:
            runs[m].append(measure(m, src, tok_dir, root / "corpus"))
        base = runs["baseline"][-1]
        for m in modes:
            r = runs[m][-1]
            if r["tokens"] != base["tokens"]:
                raise SystemExit(
                    f"{name}: {m} made {r['tokens']} tokens, baseline {base['tokens']}"
                )
            r["x_wall"], r["x_cpu"] = base["wall"] / r["wall"], base["cpu"] / r["cpu"]
            r["x_e2e"] = (base["wall"] + base["load"]) / (r["wall"] + r.get("load", 0.0))
        print(
            f"{name} round {k}: "
            + ", ".join(f"{m} {runs[m][-1]['wall']:.2f} s" for m in modes)
            + f"; load average {os.getloadavg()[0]:.2f}",
            file=sys.stderr,
        )
    first = runs["baseline"][0]
    result = {
        "set": name,
        "rows": first["rows"],
        "tokens": first["tokens"],
        "rounds": args.rounds,
        "tokenizer_load_s": round(float(np.median([r["load"] for r in runs["baseline"]])), 3),
    }
    for m in modes:
        med = {
            key: float(np.median([r[key] for r in runs[m]])) for key in runs[m][0] if key != "rows"
        }
        label = "baseline" if m == "baseline" else f"workers_{m}"
        result[label] = {
            "rows_s": round(first["rows"] / med["wall"], 1),
            "tokens_s": round(first["tokens"] / med["wall"]),
            "wall_s": round(med["wall"], 3),
            "cpu_s": round(med["cpu"], 3),
            "x_wall": round(med["x_wall"], 2),
            "x_cpu": round(med["x_cpu"], 2),
            "x_e2e": round(med["x_e2e"], 2),
            "x_wall_rounds": [round(r["x_wall"], 2) for r in runs[m]],
        }
    return result


def print_set(r: dict, workers: list[int]) -> None:
    print(
        f"{r['set']}: {r['rows']:,} rows, {r['tokens']:,} tokens ({r['tokens'] / r['rows']:,.0f} "
        f"per row); medians of {r['rounds']} rounds; tokenizer load {r['tokenizer_load_s']:.2f} s"
    )
    print(
        f"{'':26}{'rows/s':>9}{'tokens/s':>11}{'wall s':>8}{'cpu s':>8}"
        f"{'x wall':>8}{'x cpu':>7}{'x e2e':>7}  x wall by round"
    )
    for label, key in [("apply_chat_template loop", "baseline")] + [
        (f"tokenize --workers {w}", f"workers_{w}") for w in workers
    ]:
        m = r[key]
        rounds = " ".join(f"{x:.2f}" for x in m["x_wall_rounds"])
        print(
            f"{label:26}{m['rows_s']:9,.0f}{m['tokens_s']:11,}{m['wall_s']:8.2f}{m['cpu_s']:8.2f}"
            f"{m['x_wall']:7.2f}x{m['x_cpu']:6.2f}x{m['x_e2e']:6.2f}x  {rounds}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="pairs,long-all", help=f"Comma-separated, of {SETS}.")
    p.add_argument("--workers", default="1,2", help="Comma-separated worker counts.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs-rows", type=int, default=2000)
    p.add_argument("--conversations", type=int, default=20_000, help="toy: rows.")
    p.add_argument("--words", type=int, default=880, help="toy: ~1K tokens per row.")
    p.add_argument("--template", default="chatml", choices=["chatml", "qwen3"], help="toy.")
    p.add_argument("--dir", type=Path, help="Work folder (default: a temporary one).")
    p.add_argument("--json", action="store_true", help="Print the results as JSON too.")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        mode, src, tok_dir, out = args.one
        print(json.dumps(one(mode, Path(src), Path(tok_dir), Path(out))))
        return
    sets = args.sets.split(",")
    if bad := set(sets) - set(SETS):
        p.error(f"unknown sets {sorted(bad)}: want {SETS}")
    args.workers = [int(w) for w in args.workers.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in sets:
            results.append(run_set(name, root, args))
    cpus = len(os.sched_getaffinity(0))
    for r in results:
        print_set(r, args.workers)
    print(f"{cpus} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        print(json.dumps({"cpus": cpus, "sets": results}))


if __name__ == "__main__":
    main()
