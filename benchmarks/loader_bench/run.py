"""The side-by-side benchmark: the service, a torch DataLoader, and the sort-once pipeline.

One run measures, on the same dataset and the same batch plan:

* single-core memcpy bandwidth (the yardstick for "how close to free is delivery");
* the daemon: cold start to READY, RSS;
* 2 consumer processes (ranks of one job) reading for ``seconds``: tokens/s delivered into
  client-visible torch tensors (every batch touched), bytes/s of padded tensors;
* ``next()`` latency with a full ring (the consumer pauses between batches);
* first-batch latency of a restarted trainer (new client at a mid-epoch position, warm
  daemon) versus the sort-once pipeline's reload of the corpus;
* a ``DataLoader(num_workers=2)`` reading the same micro-batches through pyarrow;
* plan quality: padding efficiency and composition repeat, ours versus sort-once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.loader_bench.baseline import dataloader_throughput, sort_once_restart
from loader_server.data.dataset import open_dataset
from loader_server.planning import metrics
from loader_server.planning.planner import plan_epoch
from loader_server.wire.ring import SHM_DIR_ENV
from loader_server.wire.spec import BatchSpec
from scripts.servers.daemon_process import DaemonProcess


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N single-thread copy bandwidth (GB/s) of a buffer larger than the caches."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def rss_mb(pid: int, kind: str = "VmRSS") -> float:
    """Resident MB of ``pid``: ``VmRSS`` (all), ``RssAnon`` (private) or ``RssFile``
    (mapped file pages: for the daemon, corpus pages it has touched, shared page cache)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _shm_dir(workdir: Path) -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else workdir


def _start_daemon(dataset: Path, workdir: Path, spec: BatchSpec) -> DaemonProcess:
    shm = _shm_dir(workdir)
    args = [f"--{k.replace('_', '-')}={v if not isinstance(v, list) else ','.join(map(str, v))}"
            for k, v in spec.to_dict().items() if k != "world_size"]  # fmt: skip
    return DaemonProcess(dataset, f"ipc://{workdir}/bench.sock", "--shm-dir", str(shm), *args,
                         log_path=workdir / "daemon.log", ready_timeout_s=120)  # fmt: skip


def _consumers(endpoint: str, world: int, seconds: float, job: str, **extra: Any) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.loader_bench.consumer", endpoint, "--job", job,
           "--world", str(world), "--seconds", str(seconds)]  # fmt: skip
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    # The daemon's rings live where _start_daemon put them (the endpoint's folder).
    workdir = Path(endpoint[len("ipc://") :]).parent
    env = {**os.environ, SHM_DIR_ENV: str(_shm_dir(workdir))}
    # The consumer is a module of this (uninstalled) tree: run it from the repository root.
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env, cwd=root
        )
        for r in range(world)
    ]
    return [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in procs]


def _plan_quality(lengths: np.ndarray, spec: BatchSpec, world: int) -> dict[str, float]:
    spec = replace(spec, world_size=world)
    e0, e1 = plan_epoch(lengths, spec, epoch=0), plan_epoch(lengths, spec, epoch=1)
    return {
        "efficiency": metrics.padding_efficiency(e0),
        "repeat": metrics.composition_repeat(e0, e1),
        "mix": metrics.step_mix_distance(e0),
        "imbalance": metrics.rank_imbalance(e0),
    }


def run_bench(
    dataset: Path,
    spec: BatchSpec,
    *,
    seconds: float = 5.0,
    consumers: int = 2,
    warmup: float = 0.0,
) -> dict[str, Any]:
    """Measure everything; returns the numbers (``format_report`` prints them)."""
    r: dict[str, Any] = {"dataset": str(dataset), "spec": spec.to_dict(), "warmup_s": warmup}
    r["memcpy_gbps"] = memcpy_gbps()
    ds = open_dataset(dataset)
    r["samples"], r["tokens"] = ds.num_samples, ds.num_tokens
    # Plan quality as an 8-GPU job would see it (unless --world-size says otherwise); the
    # throughput runs use one rank per consumer process.
    quality_world = spec.world_size if spec.world_size > 1 else 8
    r["quality_world_size"] = quality_world
    r["ours_plan"] = _plan_quality(ds.lengths, spec, quality_world)
    sorted_spec = replace(spec, composition="sorted", layout="padded")  # the original pipeline
    r["sorted_plan"] = _plan_quality(ds.lengths, sorted_spec, quality_world)
    spec = replace(spec, world_size=consumers)
    plan0 = plan_epoch(ds.lengths, spec, epoch=0)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        d = _start_daemon(dataset, Path(tmp), spec)
        try:
            r["daemon_ready_s"] = d.ready_s
            flat = _consumers(d.endpoint, consumers, seconds, "throughput", warmup=warmup)
            r["service"] = {
                "tokens_per_s": sum(c["tokens_per_s"] for c in flat),
                "bytes_per_s": sum(c["bytes_per_s"] for c in flat),
                "per_rank_tokens_per_s": [c["tokens_per_s"] for c in flat],
                "client_rss_mb": max(c["rss_mb"] for c in flat),
                "wait_fraction": max(c["wait_fraction"] for c in flat),
            }
            lat = _consumers(d.endpoint, 1, min(seconds, 3.0), "latency", pause_ms=2)[0]
            r["next_p50_ms"], r["next_p99_ms"] = lat["next_p50_ms"], lat["next_p99_ms"]
            r["next_ms_samples"] = lat["next_ms"]
            warm = _consumers(d.endpoint, 1, 0.2, "restart")[0]
            r["first_batch_warm_s"] = warm["first_batch_s"]
            r["daemon_rss_mb"] = rss_mb(d.pid, "RssAnon")
            r["daemon_file_rss_mb"] = rss_mb(d.pid, "RssFile")
        finally:
            d.stop()
    batches = [plan0.micro(s, 0, 0) for s in range(plan0.num_steps)]
    r["dataloader"] = dataloader_throughput(
        dataset, batches, spec.max_seq_len, seconds, warmup=warmup
    )
    r["sort_once"] = sort_once_restart(dataset)
    return r


def format_report(r: dict[str, Any]) -> str:
    svc, dl, so = r["service"], r["dataloader"], r["sort_once"]
    mem = r["memcpy_gbps"] * 1e9
    ratio = svc["tokens_per_s"] / dl["tokens_per_s"]
    rows = [
        ("tokens/s delivered", f"{svc['tokens_per_s'] / 1e6:.1f}M",
         f"{dl['tokens_per_s'] / 1e6:.1f}M", "-", f"{ratio:.1f}x vs DataLoader"),
        ("padded tensor GB/s (share of memcpy)",
         f"{svc['bytes_per_s'] / 1e9:.2f} ({svc['bytes_per_s'] / mem:.0%})",
         f"{dl['bytes_per_s'] / 1e9:.2f} ({dl['bytes_per_s'] / mem:.0%})", "-", ""),
        ("padding efficiency", f"{r['ours_plan']['efficiency']:.3f}", "same plan",
         f"{r['sorted_plan']['efficiency']:.3f}", ""),
        ("composition repeat (e0 vs e1)", f"{r['ours_plan']['repeat']:.4f}", "same plan",
         f"{r['sorted_plan']['repeat']:.4f}", ""),
        (f"step mix distance (world {r['quality_world_size']})", f"{r['ours_plan']['mix']:.3f}",
         "same plan", f"{r['sorted_plan']['mix']:.3f}", ""),
        ("first batch after trainer restart", f"{r['first_batch_warm_s'] * 1e3:.0f} ms",
         f"{dl['first_batch_s'] * 1e3:.0f} ms", f"{so['restart_s'] * 1e3:.0f} ms",
         f"{so['restart_s'] / r['first_batch_warm_s']:.0f}x vs sort-once"),
        ("client RSS", f"{svc['client_rss_mb']:.0f} MB", "-",
         f">= {so['resident_bytes'] / 2**20:.0f} MB", ""),
    ]  # fmt: skip
    head = f"{'':<36}{'service':>18}{'DataLoader(2w)':>18}{'sort-once':>14}{'ratio':>22}"
    lines = [
        f"dataset {r['dataset']}: {r['samples']:,} samples, {r['tokens']:,} tokens; "
        f"memcpy {r['memcpy_gbps']:.1f} GB/s (one core); throughput measured "
        + (f"after {r['warmup_s']:g} s of warm-up" if r["warmup_s"] else "from a cold daemon"),
        head,
        *(f"{a:<36}{b:>18}{c:>18}{d:>14}{e:>22}" for a, b, c, d, e in rows),
        "",
        f"daemon cold start to READY {r['daemon_ready_s']:.2f} s, daemon private memory "
        f"{r['daemon_rss_mb']:.0f} MB (+{r['daemon_file_rss_mb']:.0f} MB of corpus pages "
        f"mapped from the shared page cache); client next() with a full ring: p50 "
        f"{r['next_p50_ms']:.3f} ms, p99 {r['next_p99_ms']:.3f} ms; client wait fraction "
        f"{svc['wait_fraction']:.1%}; per-rank tokens/s "
        + ", ".join(f"{x / 1e6:.1f}M" for x in svc["per_rank_tokens_per_s"]),
    ]
    return "\n".join(lines)


def plot_report(r: dict[str, Any], out: Path) -> None:
    """Three panels: throughput, restart latency, plan quality (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    names = ["service", "DataLoader (2 workers)"]
    tput = [r["service"]["tokens_per_s"] / 1e6, r["dataloader"]["tokens_per_s"] / 1e6]
    ax[0].bar(names, tput, color=["#2b8cbe", "#bbbbbb"])
    ax[0].set_ylabel("real tokens/s delivered (M)")
    ax[0].set_title("throughput, same batch plan")
    restart = [r["first_batch_warm_s"], r["dataloader"]["first_batch_s"],
               r["sort_once"]["restart_s"]]  # fmt: skip
    ax[1].bar(["service", "DataLoader", "sort-once"], restart,
              color=["#2b8cbe", "#bbbbbb", "#e34a33"])  # fmt: skip
    ax[1].set_yscale("log")
    ax[1].set_ylabel("seconds to first batch after a trainer restart")
    ax[1].set_title("restart latency (log scale)")
    labels = ["efficiency", "1 - composition repeat", "1 - step mix distance"]
    ours, srt = r["ours_plan"], r["sorted_plan"]
    x = np.arange(3)
    ax[2].bar(x - 0.2, [ours["efficiency"], 1 - ours["repeat"], 1 - ours["mix"]], 0.4,
              label="ours", color="#2b8cbe")  # fmt: skip
    ax[2].bar(x + 0.2, [srt["efficiency"], 1 - srt["repeat"], 1 - srt["mix"]], 0.4,
              label="sort-once", color="#e34a33")  # fmt: skip
    ax[2].set_xticks(x, labels, fontsize=8)
    ax[2].set_ylim(0, 1.05)
    ax[2].legend()
    ax[2].set_title("plan quality (higher is better)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
