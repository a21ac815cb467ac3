"""serve-check's check of the evaluation engine (``trainer.eval.engine.VllmEngine``, what
``dflash-train eval --engine vllm`` serves with): a server of its own for the exported
drafter, with the engine's settings (vLLM's neutral sampling defaults, a call's prompts all
in flight at once), against serve-check's own requests (one at a time) to its server.

* temperature 0: the engine's completions and its spec-decode counters (drafts, draft
  tokens, accepted, by position) over the held-out prompts equal serve-check's, exactly;
* temperature 1, seeded (two calls with seed 0): vLLM accepts the sampling parameters and
  its counters are coherent (``SpecCounters.inconsistencies``); how many completions the
  two calls share is reported, not checked: vLLM's CPU build with a DFlash drafter does
  not reproduce seeded sampling exactly (measured: without a drafter it does).
"""

from __future__ import annotations

import argparse
from itertools import pairwise
from pathlib import Path

from scripts.checks.serve_harness import BLOCK, Check
from trainer.eval.engine import VllmEngine
from trainer.vllm.metrics import SpecCounters
from trainer.vllm.process import MAX_MODEL_LEN

#: The drafters whose export the engine serves as well (one vLLM start each, ~25 s).
ENGINE_SERVED = {"full attention"}


def engine_checks(
    args: argparse.Namespace, work: Path, name: str, tag: str, target: Path, export: Path,
    prompts: list[list[int]], spec: list[list[int]], theirs: SpecCounters,
) -> list[Check]:  # fmt: skip
    """The engine on ``export`` against serve-check's pass over ``prompts``: its outputs
    ``spec`` (greedy, ``args.max_tokens`` each) and the counters ``theirs`` over it."""
    with VllmEngine(target=target, drafter=export, vllm_python=Path(args.vllm_python),
                    num_speculative_tokens=BLOCK - 1, max_model_len=MAX_MODEL_LEN,
                    log=work / f"vllm-engine-{tag}.log") as engine:  # fmt: skip
        reads = [engine.counters()]
        greedy = engine.generate(prompts, max_new_tokens=args.max_tokens)
        reads.append(engine.counters())
        sampled = []
        for _ in range(2):
            sampled.append(engine.generate(prompts, max_new_tokens=args.max_tokens,
                                           temperature=1.0, seed=0))  # fmt: skip
            reads.append(engine.counters())
        concurrency = engine.concurrency
    ours = reads[1].minus(reads[0])
    n = len(prompts)
    same = sum(1 for a, b in zip(greedy, spec, strict=True) if a == b)
    equal = Check(
        f"{name}: the eval engine == serve-check's requests", same == n and ours == theirs,
        f"VllmEngine ({concurrency} in flight) vs one at a time: {same}/{n} outputs equal; "
        f"drafts {ours.drafts}/{theirs.drafts}, draft tokens {ours.draft_tokens}/"
        f"{theirs.draft_tokens}, accepted {ours.accepted}/{theirs.accepted}, per position "
        + ("equal" if ours.per_position == theirs.per_position
           else f"{list(ours.per_position)} vs {list(theirs.per_position)}"),
    )  # fmt: skip
    return [equal, _sampled_check(name, sampled, reads[1:], ours)]


def _sampled_check(
    name: str, sampled: list[list[list[int]]], reads: list[SpecCounters], greedy: SpecCounters
) -> Check:
    """The two seeded temperature-1 calls: their counters coherent, their tau, and how many
    completions they share."""
    passes = [b.minus(a) for a, b in pairwise(reads)]
    problems = [p for c in passes for p in c.inconsistencies()]
    drafted = all(c.drafts > 0 for c in passes)
    shared = sum(1 for a, b in zip(*sampled, strict=True) if a == b)
    taus = "/".join(f"{c.tau:.3f}" for c in passes) if drafted else "no drafts"
    return Check(
        f"{name}: the eval engine samples at temperature 1", drafted and not problems,
        f"two calls with seed 0: tau {taus} (greedy {greedy.tau:.3f}), counters "
        + ("coherent" if not problems else "; ".join(problems))
        + f"; {shared}/{len(sampled[0])} completions the same in both (vLLM's CPU build "
        "does not reproduce seeded sampling with a drafter exactly)",
    )  # fmt: skip
