"""The README demo: synthesize a small corpus and show what the loader sees.

Grows with the project: later stages start the daemon and trainers on the same corpus.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO_DIR = Path("demo-run")


def sh(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    DEMO_DIR.mkdir(exist_ok=True)
    corpus = DEMO_DIR / "corpus"
    cli = [sys.executable, "-m", "loader_server"]
    if not corpus.exists():
        sh(*cli, "synth", str(corpus), "--samples", "20000", "--shards", "2")
    sh(*cli, "inspect", str(corpus))


if __name__ == "__main__":
    main()
