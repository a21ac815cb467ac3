"""The run's target, whole or with its decoder layers sharded over the ranks
(``--target-shard``), and what loading it cost each rank.

``none`` loads it whole on every rank (as always); ``fsdp`` shards it
(``trainer.model.sharding``) over every rank of the job, or loads it whole in a world of
one, said in the log; ``auto`` shards when a rank holding it whole would not fit
(``trainer.model.sharding.shard_needed``: the target, the drafter's training state and a
quarter of the device for activations, against the device's free memory; on CPU the
host's available memory split between the node's ranks). Each rank estimates from the
target's shape on the meta device, and one rank that needs it shards the job.

After the load each rank logs its parameter bytes (decoder layers held here and in all,
the replicated rest) and its host and GPU memory; rank 0's summary keeps every rank's
(``target_memory``).
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

import torch

from trainer.model.sharding import (
    ACTIVATION_SHARE,
    DRAFTER_BYTES_PER_PARAM,
    drafter_params_estimate,
    param_bytes,
    shard_needed,
    sharder,
)
from trainer.model.target import Target, meta_target, run_dtype, target_from_options
from trainer.option_values import parse_int_list
from trainer.sections import RunOptions
from trainer.train.distributed import DistEnv, all_reduce

log = logging.getLogger(__name__)

GIB, MIB = 2**30, 2**20
#: The per-rank figures ``load_run_target`` reports, in this order.
MEMORY_FIELDS = ("layers_local_mib", "layers_total_mib", "other_mib", "host_rss_gib",
                 "host_peak_gib", "gpu_peak_gib")  # fmt: skip


def load_run_target(opts: RunOptions, env: DistEnv) -> tuple[Target, dict[str, Any]]:
    """The target ``opts`` names, sharded as ``--target-shard`` decides, and the memory
    report of every rank (the same dict on each: a collective)."""
    shard = resolve_shard(opts, env)
    target = target_from_options(
        opts, env.device, parse_int_list(opts.layers), sharder(env.device) if shard else None
    )
    return target, memory_report(target, env)


def resolve_shard(opts: RunOptions, env: DistEnv) -> bool:
    """Whether the target is sharded (the same answer on every rank)."""
    mode = opts.target_shard
    if mode == "none":
        return False
    if not env.distributed:
        if mode == "fsdp":
            log.warning("--target-shard fsdp in a world of one: nothing to shard over, "
                        "the target is loaded whole")  # fmt: skip
        return False
    if mode == "fsdp":
        return True
    need = torch.tensor([float(_needs_sharding(opts, env))], device=env.device)
    shard = bool(all_reduce(need, env, op="max").item())
    if env.is_main:
        log.info("--target-shard auto: the target is %s", "sharded" if shard else "whole")
    return shard


def _needs_sharding(opts: RunOptions, env: DistEnv) -> bool:
    dtype = run_dtype(env.device)
    skeleton = meta_target(opts, dtype)
    target_bytes = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    layers = len(parse_int_list(opts.layers) or [0] * 5)  # the default spreads 5 layers
    drafter = drafter_params_estimate(skeleton.config, opts.drafter_layers or 1, layers)
    free, total = device_memory(env)
    shard = shard_needed(
        world_size=env.world_size, target_bytes=target_bytes, drafter_params=drafter,
        free_bytes=free, total_bytes=total,
    )  # fmt: skip
    log.info(
        "rank %d: target %.2f GiB + drafter training state ~%.2f GiB + activations %.2f GiB "
        "vs %.2f GiB free: %s", env.rank, target_bytes / GIB,
        DRAFTER_BYTES_PER_PARAM * drafter / GIB, ACTIVATION_SHARE * total / GIB, free / GIB,
        "does not fit" if shard else "fits",
    )  # fmt: skip
    return shard


def device_memory(env: DistEnv) -> tuple[int, int]:
    """``(free, total)`` bytes this rank may use: its GPU's, or on CPU the host's
    available and total memory divided among the node's ranks."""
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        return int(free), int(total)
    info = _meminfo()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return info["MemAvailable"] // local, info["MemTotal"] // local


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def memory_report(target: Target, env: DistEnv) -> dict[str, Any]:
    """Each rank's parameter bytes and memory after the load (logged per rank), gathered
    to every rank: ``{"sharded": bool, "ranks": [{field: GiB}, ...]}``."""
    sizes = param_bytes(target.model)
    mine = [sizes.layers_local / MIB, sizes.layers_total / MIB, sizes.other / MIB,
            *_host_memory_gb(), _gpu_peak_gb(env.device)]  # fmt: skip
    log.info(
        "rank %d: target %s: decoder layers %.1f of %.1f MiB here, the rest %.1f MiB; host "
        "RSS %.2f GiB (peak %.2f), GPU peak %.2f GiB", env.rank,
        "sharded" if target.sharded else "whole", *mine,
    )  # fmt: skip
    table = torch.zeros(env.world_size, len(MEMORY_FIELDS), dtype=torch.float64)
    table[env.rank] = torch.tensor(mine, dtype=torch.float64)
    table = all_reduce(table.to(env.device), env).cpu()
    ranks = [{k: round(float(v), 3) for k, v in zip(MEMORY_FIELDS, row, strict=True)}
             for row in table]  # fmt: skip
    return {"sharded": target.sharded, "ranks": ranks}


def _host_memory_gb() -> tuple[float, float]:
    """This process's resident memory now and its peak (VmRSS, VmHWM), in GiB."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024 / GIB
    except OSError:
        pass
    peak = found.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return found.get("VmRSS", peak), peak


def _gpu_peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
