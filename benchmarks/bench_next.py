"""``next()`` latency with a full ring: what a trainer slower than the daemon pays per batch.

    .venv/bin/python benchmarks/bench_next.py CORPUS [--batches 3000] [--pause-ms 2]

Starts a daemon on CORPUS (default spec, rings in /dev/shm), reads 300 batches to warm up,
then times ``next()`` over ``--batches`` batches, sleeping ``--pause-ms`` before each (a
trainer's step: the ring is full when ``next()`` is called, so the time is the client's own
work: taking the batch, and since batches are copied out of the ring, the copy). Prints
p50/p90/p99 in ms and the mean padded bytes per batch.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from client import LoaderClient  # noqa: E402
from scripts.servers.daemon_process import DaemonProcess  # noqa: E402


@click.command()
@click.argument("corpus", type=click.Path(exists=True, path_type=Path))
@click.option("--batches", type=int, default=3000, show_default=True)
@click.option("--pause-ms", type=float, default=2.0, show_default=True)
def main(corpus: Path, batches: int, pause_ms: float) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        d = DaemonProcess(corpus, f"ipc://{work}/next.sock", "--shm-dir", "/dev/shm",
                          log_path=Path(work) / "daemon.log", ready_timeout_s=120)  # fmt: skip
        try:
            client = LoaderClient(d.endpoint, job="bench-next", rank=0, world_size=1)
            for _ in range(300):
                next(client)
            lat, nbytes = [], []
            for _ in range(batches):
                time.sleep(pause_ms / 1000)
                t = time.perf_counter()
                b = next(client)
                lat.append(time.perf_counter() - t)
                nbytes.append(b.input_ids.numel() * 5)
            client.close()
        finally:
            d.stop()
    p50, p90, p99 = np.percentile(np.array(lat) * 1e3, [50, 90, 99])
    print(
        f"{corpus}: next() with a full ring over {batches} batches: p50 {p50:.3f} ms, "
        f"p90 {p90:.3f} ms, p99 {p99:.3f} ms; {np.mean(nbytes) / 1e3:.0f} KB padded per batch"
    )


if __name__ == "__main__":
    main()
