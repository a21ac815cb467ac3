"""`dflash-train regen --server` throughput against a server of known capacity.

    .venv/bin/python benchmarks/bench_regen_server.py [--conversations 300] [--delay 0.05]
        [--capacity 32] [--concurrency 1,8,64] [--json]

Starts ``scripts/servers/chat_server.py --fixed-delay DELAY --max-concurrent CAPACITY`` (every
request takes DELAY seconds, at most CAPACITY at once: ``CAPACITY / DELAY`` requests/s at
best), writes generated conversations (``scripts/fixtures/tiny_chat``: 1-3 turns each) and a tiny
tokenizer, and regenerates them with each ``--concurrency``. Requests/s counts the
regeneration phase only (the tokenization after it is the same for every run). Expected:
about ``concurrency / DELAY`` up to the server's capacity, then flat at its ceiling.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_server(delay: float, capacity: int) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "servers" / "chat_server.py"),
        "--fixed-delay",
        str(delay),
        "--max-concurrent",
        str(capacity),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"chat_server did not start: {line!r}")
    return proc, line.split()[1]


def run_one(url: str, src: Path, tok: Path, out: Path, concurrency: int) -> dict:
    from trainer.data.server.run import regen_from_server
    from trainer.data.server.spec import ServerRegenSpec

    spec = ServerRegenSpec(url=url, tokenizer=tok, concurrency=concurrency, max_tokens=64)
    return regen_from_server([src], out, spec, progress=False)


@click.command()
@click.option("--conversations", type=int, default=300, show_default=True)
@click.option("--delay", type=float, default=0.05, show_default=True, help="Seconds/request.")
@click.option("--capacity", type=int, default=32, show_default=True, help="Server slots.")
@click.option("--concurrency", default="1,8,64", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(conversations: int, delay: float, capacity: int, concurrency: str, as_json: bool) -> None:
    from scripts.fixtures.tiny_chat import build_tokenizer, generate_conversations, write_jsonl

    logging.basicConfig(level=logging.WARNING)
    levels = [int(c) for c in concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as tmp_dir:
        tmp = Path(tmp_dir)
        tok = build_tokenizer(tmp / "tokenizer", template="qwen3")
        src = write_jsonl(tmp / "conv.jsonl", generate_conversations(conversations, words=40))
        proc, url = start_server(delay, capacity)
        rows = []
        try:
            for c in levels:
                t = time.perf_counter()
                s = run_one(url, src, tok, tmp / f"out-c{c}", c)
                rows.append(
                    {
                        "concurrency": c,
                        "requests": s["requests"],
                        "regen_s": s["regen_s"],
                        "requests_per_s": s["requests_per_s"],
                        "expected_per_s": min(c, capacity) / delay,
                        "total_s": round(time.perf_counter() - t, 2),
                        "failed": s["failed"],
                    }
                )
        finally:
            proc.kill()
            proc.wait()
    base = rows[0]["requests_per_s"]
    for r in rows:
        r["ratio"] = round(r["requests_per_s"] / base, 2)
    if as_json:
        print(json.dumps({"delay_s": delay, "capacity": capacity, "rows": rows}))
        return
    print(
        f"fixed-delay server: {delay * 1000:.0f} ms/request, {capacity} at once "
        f"(ceiling {capacity / delay:.0f} requests/s); {conversations} conversations"
    )
    print(
        f"{'concurrency':>11} {'requests':>9} {'regen s':>8} {'req/s':>8} {'ideal':>7} "
        f"{'x c=' + str(levels[0]):>8}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>11} {r['requests']:>9} {r['regen_s']:>8.2f} "
            f"{r['requests_per_s']:>8.1f} {r['expected_per_s']:>7.0f} {r['ratio']:>8.2f}"
        )


if __name__ == "__main__":
    main()
