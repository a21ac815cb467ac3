"""Dataset-layer targets: synth time, open + lengths time (warm cache), RSS after open.

    .venv/bin/python benchmarks/bench_dataset.py [--corpus /tmp/dflash-902k] [--samples 902000]

Writes the corpus first if it does not exist (timed: that is the synth figure). The open is
timed in a fresh subprocess after a warm-up open, so the page cache is warm and the RSS
figure belongs to a process that did nothing but open the corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

_PROBE = """
import json, resource, sys, time
t0 = time.perf_counter()
from loader_server.data.dataset import open_dataset
t1 = time.perf_counter()
ds = open_dataset(sys.argv[1])
t2 = time.perf_counter()
rss = int(open('/proc/self/statm').read().split()[1]) * 4096
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "samples": ds.num_samples,
                  "tokens": ds.num_tokens, "rss_mb": rss / 2**20,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@click.command()
@click.option("--corpus", type=click.Path(path_type=Path), default=Path("/tmp/dflash-902k"))
@click.option("--samples", type=int, default=902_000)
def main(corpus: Path, samples: int) -> None:
    synth_s = None
    if not corpus.exists():
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "loader_server",
                "synth",
                str(corpus),
                "--samples",
                str(samples),
                "--shards",
                "8",
            ],
            check=True,
        )
        synth_s = time.perf_counter() - t
    run = [sys.executable, "-c", _PROBE, str(corpus)]
    subprocess.run(run, check=True, capture_output=True)  # warm the page cache
    r = json.loads(subprocess.run(run, check=True, capture_output=True, text=True).stdout)
    print(f"corpus {corpus}: {r['samples']:,} samples, {r['tokens']:,} tokens")
    print(f"{'measure':<34}{'value':>12}{'target':>12}")
    if synth_s is not None:
        print(f"{'synth (s)':<34}{synth_s:>12.1f}{'<= 300':>12}")
    print(f"{'open + all lengths, warm (s)':<34}{r['open_s']:>12.3f}{'<= 1.0':>12}")
    print(f"{'RSS after open (MB)':<34}{r['rss_mb']:>12.1f}{'< 200':>12}")
    print(f"{'peak RSS (MB)':<34}{r['peak_rss_mb']:>12.1f}{'':>12}")
    print(f"{'import loader_server.data.dataset (s)':<34}{r['import_s']:>12.3f}{'':>12}")


if __name__ == "__main__":
    main()
