"""A benchmark consumer: one trainer rank that only reads batches (no model).

Runs in its own process with the client's imports only (torch, zmq, msgpack; no pyarrow),
so its RSS is what a trainer pays for the loader. Every batch is touched (``touch``: a sum
over every element of ``input_ids``) so zero-copy delivery is not mistaken for free delivery.

    python -m benchmarks.loader_bench.consumer ENDPOINT --rank R --world W --seconds S
"""

from __future__ import annotations

import json
import time

import click
import numpy as np
import torch

from client import LoaderClient


def touch(input_ids: torch.Tensor) -> int:
    """Read every element (an int32 sum: int64 accumulation would cost 5x more and measure
    torch's reduction, not delivery). Both benchmark consumers touch batches this way."""
    return int(input_ids.sum(dtype=torch.int32))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@click.command()
@click.argument("endpoint")
@click.option("--job", default="bench")
@click.option("--rank", type=int, default=0)
@click.option("--world", type=int, default=1)
@click.option("--seconds", type=float, default=5.0)
@click.option("--pause-ms", type=float, default=0.0, help="Sleep between batches (full ring).")
@click.option("--warmup", type=float, default=0.0, help="Read this long before measuring.")
@click.option("--spec", default="{}", help="BatchSpec overrides as JSON.")
def main(
    endpoint: str,
    job: str,
    rank: int,
    world: int,
    seconds: float,
    pause_ms: float,
    warmup: float,
    spec: str,
) -> None:
    torch.set_num_threads(1)  # a data consumer: OpenMP spin on 2 busy cores costs ms per sum
    t0 = time.perf_counter()
    client = LoaderClient(endpoint, job=job, rank=rank, world_size=world, spec=json.loads(spec))
    batch = next(client)
    first_batch_s = time.perf_counter() - t0
    tokens = padded_bytes = batches = 0
    latencies = []
    checksum = 0
    while time.perf_counter() - t0 < first_batch_s + warmup:
        checksum += touch(batch.input_ids)
        batch = next(client)
    start = time.perf_counter()
    wait0 = client.wait_s
    while time.perf_counter() - start < seconds:
        checksum += touch(batch.input_ids)
        tokens += batch.num_tokens
        padded_bytes += batch.input_ids.numel() * 5  # int32 ids + uint8 mask
        batches += 1
        if pause_ms:
            time.sleep(pause_ms / 1000)
        t = time.perf_counter()
        batch = next(client)
        latencies.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    lat = np.array(latencies) * 1000
    print(
        json.dumps(
            {
                "rank": rank,
                "first_batch_s": first_batch_s,
                "batches": batches,
                "tokens_per_s": tokens / elapsed,
                "bytes_per_s": padded_bytes / elapsed,
                "next_p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
                "next_p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
                "next_ms": np.round(lat[:: max(1, lat.size // 2000)], 4).tolist(),
                "wait_fraction": (client.wait_s - wait0) / elapsed,
                "rss_mb": _rss_mb(),
                "checksum": checksum,
            }
        )
    )
    client.close()


if __name__ == "__main__":
    main()
