"""Digests of the plans the planner makes for a fixed set of specs: a refactor's proof that
plans did not change. Run it on two commits and compare the output (it prints nothing that
depends on the machine or the time):

    .venv/bin/python benchmarks/plan_digests.py > after.json
    git stash / git checkout OLD; .venv/bin/python benchmarks/plan_digests.py > before.json
    diff before.json after.json

Every array of each plan (epochs 0 and 1) goes into the digest, for the default spec, the
packed layout, several world sizes and grad_accum values, bucket and order choices, cost
models with and without an anchor cap, and a drop policy, on 60,000 synthetic lengths.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import click
import numpy as np

from loader_server.data.synth import SynthSpec, synth_lengths
from loader_server.planning.planner import plan_epoch
from loader_server.wire.spec import BatchSpec

# Each names its layout, so a digest means the same plan on either side of a change of the
# default layout (packed since docs/EXPERIMENT.md, Part 3; padded before).
SPECS: list[dict[str, Any]] = [
    {"layout": "padded"},
    {"layout": "packed"},
    {"layout": "padded", "world_size": 8},
    {"layout": "padded", "world_size": 8, "grad_accum": 4},
    {"layout": "packed", "world_size": 8, "grad_accum": 4},
    {"layout": "padded", "buckets": "auto:6"},
    {"layout": "padded", "composition": "sorted"},
    {"layout": "padded", "order": "shuffled"},
    {"layout": "padded", "composition": "random"},
    {"layout": "padded", "cost_attn": 2e-4, "cost_c0": 300.0, "world_size": 8},
    {"cost_attn": 2e-4, "cost_slot": 0.5, "layout": "packed", "world_size": 8},
    {"layout": "padded", "cost_c0": 1000, "cost_slot": 1.0, "max_anchors": 64,
     "anchors_per_doc": 4, "world_size": 4, "grad_accum": 2},
    {"layout": "padded", "attention_weight": 1e-5},
    {"layout": "padded", "max_seq_len": 2048, "overlong": "drop", "world_size": 2},
]  # fmt: skip


def plan_digest(lengths: np.ndarray, spec: BatchSpec, epochs: int = 2) -> str:
    h = hashlib.sha256()
    for epoch in range(epochs):
        plan = plan_epoch(lengths, spec, epoch=epoch)
        for name in sorted(vars(plan)):
            value = getattr(plan, name)
            if isinstance(value, np.ndarray):
                h.update(name.encode())
                h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:16]


@click.command()
@click.option("--samples", type=int, default=60_000, show_default=True)
def main(samples: int) -> None:
    lengths = synth_lengths(SynthSpec(num_samples=samples, seed=5, median_len=400, max_len=8192))
    out = {json.dumps(s): plan_digest(lengths, BatchSpec.from_dict(s)) for s in SPECS}
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
