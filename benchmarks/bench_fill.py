"""The daemon's per-micro-batch cost, in-process: one ``ArrowDataset.fill`` of the plan's
micro-batches into a slot-sized buffer, with and without the pages mapped beforehand.

    .venv/bin/python benchmarks/bench_fill.py CORPUS [--batches 2000]

Three passes over different micro-batches of epoch 0 (default spec, world size 2), each in
a fresh process so no page is mapped at the start:

* first touch: the fill faults the corpus pages in itself;
* read-ahead: ``populate`` (what the read-ahead thread does) first, timed separately, then
  the fill;
* mapped: every sample populated up front, the fill timed after a warm-up pass (the steady
  state of a long-running daemon).

Prints microseconds per micro-batch and the padded bytes written per second, next to a
256 MB single-core memcpy measured in the same process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

# The probe imports benchmarks/ (not installed), so it runs from the repository root.
ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys, time
import numpy as np
from benchmarks.loader_bench.run import memcpy_gbps
from loader_server.data.dataset import open_dataset
from loader_server.planning.planner import plan_epoch
from loader_server.wire.spec import BatchSpec

path, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
ds = open_dataset(path)
spec = BatchSpec(world_size=2, layout="padded")
plan = plan_epoch(ds.lengths, spec, epoch=0)
micro = [(plan.micro(s, r, 0), int(plan.micro_len(s, r, 0)))
         for s in range(plan.num_steps) for r in range(2)]
rng = np.random.default_rng(0)
picked = [micro[i] for i in rng.permutation(len(micro))[: 2 * count]]
warm, timed = picked[:count], picked[count:]
cap = spec.token_budget
out = dict(input_ids=np.zeros(cap, np.int32), loss_mask=np.zeros(cap, np.uint8),
           lengths=np.zeros(spec.max_batch_size, np.int32),
           sample_ids_out=np.zeros(spec.max_batch_size, np.int64))
populate_s = 0.0
if mode == "mapped":
    ds.populate(np.arange(ds.num_samples), spec.max_seq_len)
    for ids, width in warm:
        ds.fill(ids, spec.max_seq_len, width=width, **out)
if mode == "readahead":
    t = time.perf_counter()
    for ids, _ in timed:
        ds.populate(ids, spec.max_seq_len)
    populate_s = time.perf_counter() - t
t = time.perf_counter()
padded = 0
for ids, width in timed:
    ds.fill(ids, spec.max_seq_len, width=width, **out)
    padded += ids.size * width * 5
fill_s = time.perf_counter() - t
n = len(timed)
print(json.dumps({"fill_us": fill_s / n * 1e6, "populate_us": populate_s / n * 1e6,
                  "gbps": padded / fill_s / 1e9, "memcpy_gbps": memcpy_gbps(),
                  "rows": float(np.mean([ids.size for ids, _ in timed]))}))
"""


@click.command()
@click.argument("corpus", type=click.Path(exists=True, path_type=Path))
@click.option("--batches", type=int, default=2000, show_default=True, help="Timed per pass.")
def main(corpus: Path, batches: int) -> None:
    print(f"{corpus}: fill of {batches} micro-batches of epoch 0 (default spec), per pass")
    for mode in ("first-touch", "readahead", "mapped"):
        t = time.perf_counter()
        cmd = [sys.executable, "-c", _PROBE, str(corpus), mode, str(batches)]
        r = json.loads(
            subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
        )
        extra = f" (+ populate {r['populate_us']:.0f} us)" if mode == "readahead" else ""
        print(
            f"  {mode:<12} fill {r['fill_us']:6.0f} us/batch{extra}, {r['gbps']:.2f} GB/s padded "
            f"= {r['gbps'] / r['memcpy_gbps']:.0%} of memcpy ({r['memcpy_gbps']:.1f} GB/s); "
            f"{r['rows']:.0f} rows/batch  [{time.perf_counter() - t:.0f} s]"
        )


if __name__ == "__main__":
    main()
