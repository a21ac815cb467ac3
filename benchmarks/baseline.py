"""Plans made by the planner of another commit, for side-by-side benchmarks in one run.

``plans_at(rev, lengths, spec, epochs=(0, 1))`` extracts ``loader_server/`` of commit
``rev`` (``git archive``) into a temporary folder, plans there in a fresh interpreter (its
own code, not this checkout's), and returns the plans as ``EpochPlan`` objects of this
checkout with the time each took (the first from a cold bucket cache), so that the same
metrics and the same timing loop judge both. Plans are pure functions of (lengths, spec,
epoch), so nothing else of the old commit is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from loader_server.planning.planner import EpochPlan
from loader_server.wire.spec import BatchSpec

_ARRAYS = (
    "sample_ids", "sample_lengths", "offsets", "micro_lens", "micro_costs", "micro_buckets",
    "bucket_bounds",
)  # fmt: skip

_SCRIPT = """
import json, sys, time
import numpy as np
import loader_server.planning.planner as planner
from loader_server.wire.spec import BatchSpec
folder = sys.argv[1]
ARRAYS = json.loads(sys.argv[2])
import os
here = os.path.realpath(planner.__file__)
assert here.startswith(os.path.realpath(folder)), here  # the old commit's code
lengths = np.load(folder + "/lengths.npy")
spec = BatchSpec.from_dict(json.load(open(folder + "/spec.json")))
for epoch in json.load(open(folder + "/epochs.json")):
    t0 = time.perf_counter()
    p = planner.plan_epoch(lengths, spec, epoch=epoch)
    seconds = time.perf_counter() - t0
    np.savez(f"{folder}/plan{epoch}.npz", num_steps=p.num_steps, seconds=seconds,
             **{k: getattr(p, k) for k in ARRAYS})
    json.dump(p.stats, open(f"{folder}/stats{epoch}.json", "w"))
"""


def repo_root() -> Path:
    """This checkout (whatever the working directory)."""
    return Path(__file__).resolve().parents[1]


def plans_at(
    rev: str, lengths: np.ndarray, spec: BatchSpec, epochs: tuple[int, ...] = (0, 1)
) -> list[tuple[EpochPlan, float]]:
    """``[(plan, seconds)]`` of each epoch, planned by commit ``rev``'s planner."""
    with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(repo_root()), "archive", rev, "loader_server"],
            capture_output=True, check=True,
        )  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        np.save(f"{tmp}/lengths.npy", np.asarray(lengths))
        Path(tmp, "spec.json").write_text(json.dumps(spec.to_dict()))
        Path(tmp, "epochs.json").write_text(json.dumps(list(epochs)))
        subprocess.run(
            [sys.executable, "-c", _SCRIPT, tmp, json.dumps(_ARRAYS)],
            cwd=tmp,
            check=True,
            env={**os.environ, "PYTHONPATH": tmp},
        )
        out = []
        for epoch in epochs:
            z = np.load(f"{tmp}/plan{epoch}.npz")
            stats = json.loads(Path(tmp, f"stats{epoch}.json").read_text())
            plan = EpochPlan(
                spec=spec, epoch=epoch, num_steps=int(z["num_steps"]), stats=stats,
                **{k: z[k] for k in _ARRAYS},
            )  # fmt: skip
            out.append((plan, float(z["seconds"])))
        return out
