"""Elastic resumes, proven: one epoch served under world sizes 4 -> 2 -> 3 (the last with
another grad_accum) at random steps gives every sample exactly once, and the rest of an
epoch is planned as well and as fast as a fresh epoch.

    .venv/bin/python benchmarks/bench_elastic.py [--samples 902000] [--daemon-samples 20000]

1. Through a real daemon (``dflash-loader serve`` on a synthetic corpus of
   ``--daemon-samples``; one ``LoaderClient`` per rank, in this process): the sample ids the
   clients received, counted (duplicates, missing apart from the last plan's reported
   leftover).
2. On the reference shape (``--samples`` lengths from ``synth_lengths``, the daemon's default
   spec), the same chain through the pure planner: each rest of the epoch against a fresh
   plan of the same samples for the same shape (a corpus holding only them): padding
   efficiency, step mix distance and rank imbalance side by side, and the plan times (rest
   with the last leg's plan cached, as a daemon that served it has it; rest from cold, every
   earlier leg planned again; a fresh epoch), best of ``--repeats``, each with the bucket
   DP's cache cleared (the rest's lengths are a new histogram: its DP runs once).
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/ and benchmarks/ are not installed

from client import LoaderClient  # noqa: E402
from loader_server.data.synth import SynthSpec, synth_lengths, write_corpus  # noqa: E402
from loader_server.planning import metrics  # noqa: E402
from loader_server.planning.elastic import plan_rest, shaped  # noqa: E402
from loader_server.planning.planner import EpochPlan, plan_epoch  # noqa: E402
from loader_server.wire.protocol import Leg  # noqa: E402
from loader_server.wire.spec import BatchSpec  # noqa: E402
from scripts.servers.daemon_process import DaemonProcess  # noqa: E402

#: The chain: (world_size, grad_accum) of each leg, in order.
SHAPES = ((4, 1), (2, 1), (3, 2))
SMALL_SPEC: dict[str, Any] = {"token_budget": 16384, "max_batch_size": 32, "max_seq_len": 4096}


def cut_points(rng: np.random.Generator, steps: int) -> int:
    """A random step inside the middle of a leg of ``steps`` steps."""
    return int(rng.integers(max(1, steps // 5), max(2, steps * 3 // 5)))


def through_daemon(samples: int, seed: int) -> dict[str, Any]:
    """Serve one epoch through a real daemon, changing shape at random steps."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as work:
        corpus = Path(work) / "corpus"
        write_corpus(corpus, SynthSpec(num_samples=samples, seed=seed, max_len=4096), shards=2)
        args = ["--shm-dir", "/dev/shm", *(f"--{k.replace('_', '-')}={v}" for k, v in
                SMALL_SPEC.items())]  # fmt: skip
        d = DaemonProcess(corpus, f"ipc://{work}/elastic.sock", *args,
                          log_path=Path(work) / "daemon.log", ready_timeout_s=120)  # fmt: skip
        try:
            got: list[int] = []
            state, cuts = None, []
            for k, (world, ga) in enumerate(SHAPES):
                clients = []
                for r in range(world):
                    c = LoaderClient(d.endpoint, job="bench-elastic", rank=r, world_size=world,
                                     spec={"grad_accum": ga}, epochs=1, timeout_s=60)  # fmt: skip
                    if state is not None:
                        c.load_state_dict(state)
                    clients.append(c)
                last = k == len(SHAPES) - 1
                done, cut = 0, None  # the last shape serves to the end of the epoch
                while last or cut is None or done < cut:
                    try:
                        for c in clients:
                            for _ in range(ga):
                                b = next(c)
                                got += b.sample_ids.tolist()
                    except StopIteration:
                        break
                    done += 1
                    if cut is None and not last:  # the leg's steps are known from here
                        cut = cut_points(rng, b.steps_per_epoch)
                        cuts.append(cut)
                state = clients[0].state_dict()
                for c in clients:
                    c.close()
            lengths = np.asarray(synth_lengths(SynthSpec(num_samples=samples, seed=seed,
                                                         max_len=4096)))  # fmt: skip
        finally:
            d.stop()
    ids, counts = np.unique(np.array(got, np.int64), return_counts=True)
    base = BatchSpec(**SMALL_SPEC)
    legs = [Leg(w, g, s) for (w, g), s in zip(SHAPES, cuts, strict=False)]
    final = plan_rest(lengths, shaped(base, *SHAPES[-1]), epoch=0, legs=legs)
    servable = int((lengths > 0).sum())
    return {
        "samples": servable,
        "received": len(got),
        "duplicates": int((counts > 1).sum()),
        "missing": servable - ids.size,
        "leftover": int(final.stats["dropped_leftover"]),
        "cuts": cuts,
    }


def best(fn: Any, repeats: int) -> tuple[float, Any]:
    """Best time of ``repeats`` cold runs (the bucket DP's cache cleared before each)."""
    times, out = [], None
    for _ in range(repeats):
        metrics.clear_caches()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def on_reference(samples: int, seed: int, repeats: int) -> list[dict[str, Any]]:
    """The same chain on the reference shape, through the pure planner."""
    rng = np.random.default_rng(seed)
    lengths = synth_lengths(SynthSpec(num_samples=samples))
    base = BatchSpec()
    rows: list[dict[str, Any]] = []
    legs: list[Leg] = []
    prior: EpochPlan | None = None
    for k, (world, ga) in enumerate(SHAPES):
        spec = shaped(base, world, ga)
        rest = partial(plan_rest, lengths, spec, epoch=0, legs=legs)
        t_rest, plan = best(partial(rest, prior=prior), repeats)
        t_cold, _ = best(rest, 1)
        keep = np.ones(lengths.size, bool) if plan.keep is None else plan.keep
        alone = np.where(keep, lengths, 0)  # a corpus of the same samples only
        t_fresh, fresh = best(partial(plan_epoch, alone, spec, epoch=0), repeats)
        t_epoch, _ = best(partial(plan_epoch, lengths, spec, epoch=0), repeats)
        a, b = metrics.summarize(plan), metrics.summarize(fresh)
        rows.append({
            "leg": k, "shape": f"{world}x{ga}", "samples": int((keep & (lengths > 0)).sum()),
            "steps": plan.num_steps,
            **{f"{m}": (a[m], b[m]) for m in ("padding_efficiency", "step_mix_distance",
                                              "rank_imbalance")},
            "rest_s": t_rest, "rest_cold_s": t_cold, "fresh_same_s": t_fresh,
            "fresh_epoch_s": t_epoch,
        })  # fmt: skip
        if k + 1 < len(SHAPES):
            legs = [*legs, Leg(world, ga, cut_points(rng, plan.num_steps))]
            prior = plan
    return rows


@click.command()
@click.option(
    "--samples",
    type=int,
    default=902_000,
    show_default=True,
    help="Reference-shape lengths for the plan quality and time.",
)
@click.option(
    "--daemon-samples",
    type=int,
    default=20_000,
    show_default=True,
    help="Corpus served through the real daemon.",
)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(samples: int, daemon_samples: int, repeats: int, seed: int) -> None:  # fmt: skip
    shapes = " -> ".join(f"{w}x{g}" for w, g in SHAPES)
    print(f"one epoch served under world_size x grad_accum {shapes}")
    r = through_daemon(daemon_samples, seed)
    ok = r["duplicates"] == 0 and r["missing"] == r["leftover"]
    print(
        f"\n1. through a real daemon ({r['samples']} samples, changes after steps "
        f"{r['cuts']}): received {r['received']}, duplicates {r['duplicates']}, missing "
        f"{r['missing']} (the last plan's reported leftover: {r['leftover']}): "
        f"{'EXACTLY ONCE' if ok else 'FAILED'}"
    )
    rows = on_reference(samples, seed, repeats)
    print(f"\n2. {samples} samples, default spec: each rest of the epoch vs a fresh plan of "
          "the same samples (rest / fresh, difference)")  # fmt: skip
    print(f"{'leg':>3} {'shape':>5} {'samples':>8} {'steps':>6} {'padding eff':>24} "
          f"{'step mix distance':>24} {'rank imbalance':>24}")  # fmt: skip
    worst = 0.0
    for row in rows:
        cells = []
        for m in ("padding_efficiency", "step_mix_distance", "rank_imbalance"):
            a, b = row[m]
            worst = max(worst, abs(a - b)) if row["leg"] else worst
            cells.append(f"{a:.4f} / {b:.4f} {a - b:+.4f}")
        print(f"{row['leg']:>3} {row['shape']:>5} {row['samples']:>8} {row['steps']:>6} "
              + " ".join(f"{c:>24}" for c in cells))  # fmt: skip
    print(f"largest difference of a rest from its fresh plan: {worst:.4f} (goal <= 0.01)")
    print(
        f"\nplan times, best of {repeats} (s): rest (last leg cached) / rest cold / fresh plan "
        "of the same samples / fresh whole epoch, and rest / fresh epoch"
    )
    for row in rows[1:]:
        print(
            f"  leg {row['leg']} ({row['shape']}): {row['rest_s']:.3f} / "
            f"{row['rest_cold_s']:.3f} / {row['fresh_same_s']:.3f} / "
            f"{row['fresh_epoch_s']:.3f}, {row['rest_s'] / row['fresh_epoch_s']:.2f}x"
        )
    if not ok or worst > 0.01:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
