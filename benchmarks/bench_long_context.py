"""Long context on CPU: a corpus of 200-token and 64K-token samples planned, and the
verifier on 16K-32K-token prompts.

    python benchmarks/bench_long_context.py plan [--short 50000] [--long 200] [--baseline REV]
        [--write CORPUS]
    python benchmarks/bench_long_context.py tau [--lengths 16384,32768] [--new-tokens 32]

``plan``: lengths of ``--short`` samples of ~200 tokens (lognormal, median 200, sigma 0.5,
16..2048) and ``--long`` samples of 32K-64K tokens (uniform), about half of the tokens
each, planned at ``--max-seq-len 65536 --token-budget 65536``, world size 8, with the
cost model of an 8B target on one H100 (``cost_c0`` 0.02 s, ``cost_tok`` 2.3e-5 s,
``cost_attn`` 4e-10 s, ``cost_slot`` 3.6e-6 s: shape-true, not measured; at 64K tokens
attention is half of a micro-batch's time). Printed: the table ``dflash-loader plan
--compare`` prints for that spec (this spec, token-balanced, sorted, random, the
reference 6 buckets), then the quality figures of each shape (grad_accum 1 and 4, padded
and packed, ``max_batch_size`` 512) next to the planner of ``--baseline`` (default: the
commit before costly micro-batches were grouped; ``benchmarks/baseline.py``).
``--write CORPUS`` also writes the corpus (random ids, Arrow) for the command line:
``dflash-loader plan CORPUS --max-seq-len 65536 --token-budget 65536 --world-size 8
--cost-c0 0.02 --cost-tok 2.3e-5 --cost-attn 4e-10 --cost-slot 3.6e-6 --compare``.

``tau``: a tiny Qwen3 target with YaRN in its config (x4 over 8,192 positions, to
32,768), a drafter trained against it for 60 steps on the target's greedy continuations
of short prompts (the real loop, in process), then the batched verifier
(``trainer.model.speculate.BatchedVerifier``) on one random prompt of each ``--lengths``,
greedy: tau per prompt and the time (prefill included). The target has random weights, so
tau is what its greedy continuations of random prompts allow a drafter trained on short
ones (~1); what is measured is that the long-context path runs, and how long it takes.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader_server.planning import metrics
from loader_server.wire.spec import BatchSpec

H100 = {"cost_c0": 0.02, "cost_tok": 2.3e-5, "cost_attn": 4e-10, "cost_slot": 3.6e-6}
SPEC: dict[str, Any] = {"max_seq_len": 65536, "token_budget": 65536, "world_size": 8, **H100}
SHAPES: dict[str, dict[str, Any]] = {
    "padded, ga 1": {"layout": "padded"},
    "padded, ga 4": {"layout": "padded", "grad_accum": 4},
    "padded, ga 4, 512 rows": {"layout": "padded", "grad_accum": 4, "max_batch_size": 512},
    "packed, ga 1": {"layout": "packed"},
    "packed, ga 4": {"layout": "packed", "grad_accum": 4},
}
#: The planner before costly micro-batches were grouped (``--baseline``).
BASELINE = "8b9c6c7"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}


def mixed_lengths(n_short: int, n_long: int, seed: int = 0) -> np.ndarray:
    """~200-token and 32K-64K-token samples in random order (int32)."""
    rng = np.random.default_rng(seed)
    short = np.clip(np.rint(rng.lognormal(np.log(200), 0.5, n_short)), 16, 2048)
    long = rng.integers(32_768, 65_537, n_long)
    return rng.permutation(np.concatenate([short, long])).astype(np.int32)


@click.group()
def main() -> None:
    """Long context on CPU (see the module docstring)."""


@main.command()
@click.option("--short", "n_short", type=int, default=50_000, show_default=True)
@click.option("--long", "n_long", type=int, default=200, show_default=True)
@click.option("--baseline", default=BASELINE, show_default=True, help="Commit to compare with.")
@click.option("--write", type=click.Path(path_type=Path), help="Also write the corpus here.")
def plan(n_short: int, n_long: int, baseline: str, write: Path | None) -> None:
    """The mixed corpus planned: the --compare table, then every shape vs the baseline."""
    lengths = mixed_lengths(n_short, n_long)
    long = lengths >= 32_768
    print(
        f"{lengths.size:,} samples: {int((~long).sum()):,} short ({int(lengths[~long].sum()):,} "
        f"tokens), {int(long.sum())} long ({int(lengths[long].sum()):,} tokens); spec {SPEC}"
    )
    spec = BatchSpec(**SPEC, **SHAPES["padded, ga 1"])
    rows = {
        name: metrics.evaluate(lengths, other, model=np.asarray(spec.coefficients))
        for name, other in metrics.baselines(spec).items()
    }
    print("dflash-loader plan --compare (grad_accum 1):")
    print(metrics.format_table(rows))
    print(f"\nby shape: this checkout, then the planner of {baseline}")
    table = {}
    for name, shape in SHAPES.items():
        other = BatchSpec(**SPEC, **shape)
        table[name] = metrics.evaluate(lengths, other)
        table[f"{name} @{baseline}"] = _at(baseline, lengths, other)
    print(metrics.format_table(table))
    if write is not None:
        _write(write, lengths)
        print(f"corpus: {write}")


def _at(rev: str, lengths: np.ndarray, spec: BatchSpec) -> dict[str, Any]:
    """``metrics.evaluate``'s figures of ``rev``'s plans (its own code, a fresh process)."""
    from benchmarks.baseline import plans_at

    (first, cold), (second, warm) = plans_at(rev, lengths, spec)
    out = metrics.summarize(first, second)
    out.update(plan_s=cold, plan_warm_s=warm)
    return out


def _write(path: Path, lengths: np.ndarray) -> None:
    """The corpus itself (random ids, every token supervised), for ``dflash-loader plan``."""
    import pyarrow as pa

    from loader_server.data.dataset import CORPUS_SCHEMA, record_batch

    rng = np.random.default_rng(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, CORPUS_SCHEMA) as writer:
        for lo in range(0, lengths.size, 8192):
            lens = lengths[lo : lo + 8192]
            ids = rng.integers(0, 151_936, int(lens.sum()), dtype=np.int32)
            writer.write_batch(record_batch(ids, np.ones(ids.size, np.uint8), lens))


@main.command()
@click.option("--lengths", default="16384,32768", show_default=True, help="Prompt lengths.")
@click.option("--new-tokens", type=int, default=32, show_default=True)
@click.option("--steps", type=int, default=60, show_default=True, help="Training steps.")
@click.option("--threads", type=int, default=2, show_default=True)
def tau(lengths: str, new_tokens: int, steps: int, threads: int) -> None:
    """The batched verifier on long prompts (see the module docstring)."""
    import torch

    from trainer.model.speculate import BatchedVerifier
    from trainer.model.target import Target, TinyTargetSpec, build_tiny_model

    torch.set_num_threads(threads)
    sizes = [int(x) for x in lengths.split(",")]
    spec = TinyTargetSpec(max_positions=max(32_768, *sizes), rope_scaling=YARN)
    target = Target(build_tiny_model(spec), [0, 1, 2])
    t0 = time.perf_counter()
    drafter = _trained_drafter(target, steps)
    print(f"target: tiny Qwen3, YaRN {YARN}; drafter trained {steps} steps in "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for n in sizes:
        prompt = torch.randint(1, 511, (n,), generator=g)
        t0 = time.perf_counter()
        (out,) = BatchedVerifier(target, drafter, max_new_tokens=new_tokens).generate([prompt])
        secs = time.perf_counter() - t0
        print(
            f"prompt {n:>6} tokens: tau {out.tau:.3f} ({out.tokens.numel()} tokens in "
            f"{len(out.acceptance_lengths)} steps), {secs:.1f} s (prefill included)"
        )


def _trained_drafter(target: Any, steps: int) -> Any:
    """A drafter trained by the real loop on the target's 32-token greedy continuations of
    8-token random prompts (what ``tests/drafters.py`` trains), in eval mode."""
    import torch

    from trainer.hf.export import read_trained_drafter
    from trainer.model.blocks import LossConfig
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.verifier import greedy_generate
    from trainer.options import TargetOptions
    from trainer.run import run_meta
    from trainer.sections import RunOptions
    from trainer.train.batches import ListSource
    from trainer.train.distributed import local_env
    from trainer.train.loop import Trainer

    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(16):
        prompt = torch.randint(0, 511, (8,), generator=g)
        ids = torch.cat([prompt, greedy_generate(target, prompt, 32)]).tolist()
        docs.append((ids, [1] * len(ids)))
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=8, mask_token_id=511
    )
    torch.manual_seed(0)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-long-context-"))
    loss = LossConfig(block_size=8, anchors_per_doc=8)
    tc = RunOptions(endpoint="in-process", run_dir=run_dir, steps=steps, lr=3e-3, warmup=2,
                    no_progress=True, cost_samples=0, **loss.options())  # fmt: skip
    Trainer(
        tc, target=target, drafter=DFlashDrafter(cfg), source=ListSource(docs, rows=4),
        env=local_env(), meta=run_meta(TargetOptions(), target),
    ).run()  # fmt: skip
    src = read_trained_drafter(run_dir)
    drafter = DFlashDrafter(dataclasses.replace(src.config))
    drafter.load_state_dict(src.weights)
    return drafter.eval()


if __name__ == "__main__":
    main()
