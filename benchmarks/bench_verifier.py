"""The evaluation's verifier: the batched one (``trainer.model.speculate``) against the
one-prompt-at-a-time reference (``trainer.model.verifier.speculative_generate``) on the same
prompts and tokens, with the demo's target and drafter (``make demo`` makes them).

Both decode the built-in HumanEval's first ``--prompts`` prompts, rendered with the target's
chat template, greedy, ``--max-new-tokens`` each; the outputs and acceptance lengths must be
identical, and the times are printed side by side with the ratio.

    python benchmarks/bench_verifier.py [--prompts 32] [--max-new-tokens 128] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "demo-run" / "target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "demo-run" / "drafter")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for p in (args.target, args.drafter):
        if not (p / "config.json").is_file():
            sys.exit(f"{p}: no model folder; `make demo` makes the demo's target and drafter")

    import torch

    from trainer.eval.runner import load_base_target, load_drafter
    from trainer.eval.sets import conversation, load_set, render
    from trainer.model.speculate import BatchedVerifier
    from trainer.model.verifier import DrafterProposer, SpecResult, speculative_generate

    torch.set_num_threads(args.threads)
    base, tok, eos = load_base_target(args.target)
    d = load_drafter(args.drafter, base)
    pset = load_set("humaneval", None, limit=args.prompts)
    prompts = [torch.tensor(render(tok, conversation(p, 0, []), thinking=False))
               for p in pset.prompts]  # fmt: skip
    n = args.max_new_tokens
    proposer = DrafterProposer(d.target, d.drafter)
    t0 = time.perf_counter()
    ref = [
        speculative_generate(
            d.target, proposer, p, block_size=d.block_size, max_new_tokens=n, eos_token_ids=eos
        )
        for p in prompts
    ]
    t_ref = time.perf_counter() - t0
    verifier = BatchedVerifier(d.target, d.drafter, max_new_tokens=n, eos_token_ids=eos)
    order = sorted(range(len(prompts)), key=lambda k: prompts[k].numel())
    t0 = time.perf_counter()
    got: dict[int, SpecResult] = {}
    for lo in range(0, len(order), args.batch_size):
        chunk = order[lo : lo + args.batch_size]
        got.update(zip(chunk, verifier.generate([prompts[k] for k in chunk]), strict=True))
    t_new = time.perf_counter() - t0
    same = all(
        torch.equal(r.tokens, got[k].tokens) and r.acceptance_lengths == got[k].acceptance_lengths
        for k, r in enumerate(ref)
    )
    tokens = sum(int(r.tokens.numel()) for r in ref)
    tau = sum(r.tau for r in ref) / len(ref)
    print(f"{len(prompts)} HumanEval prompts ({sum(p.numel() for p in prompts)} prompt tokens), "
          f"{tokens} tokens out, tau {tau:.3f}, outputs identical: {same}")  # fmt: skip
    print(f"{'verifier':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'one prompt at a time':<28}{t_ref:>10.2f}{tokens / t_ref:>12.1f}")
    print(f"{'batched (' + str(args.batch_size) + ' per forward)':<28}{t_new:>10.2f}"
          f"{tokens / t_new:>12.1f}")  # fmt: skip
    print(f"speed-up: {t_ref / t_new:.1f}x")
    if not same:
        sys.exit("the batched verifier's outputs differ from the reference's")


if __name__ == "__main__":
    main()
