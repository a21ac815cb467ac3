"""`make serve-check`: vLLM in the loop, before serving a drafter (docs/SERVING.md).

Run by ``scripts/checks/serve_check.sh`` (which makes the vLLM virtualenv once) with the
project's ``.venv``; vLLM runs in its own virtualenv (``--vllm-python``), as subprocesses:

1. data: tiny chat conversations and a byte-level BPE tokenizer with Qwen3's template, and
   a tiny random-weight Qwen3 target saved with it (``dflash-train save-target``), as in the
   demo;
2. vLLM's OpenAI server serves the target: ``dflash-train regen --server`` regenerates every
   reply through it (the training corpus and the held-out prompts); the first rows again
   through ``scripts/servers/chat_server.py``, the stand-in the tests use, must give the same
   replies; vLLM's plain greedy output on the held-out prompts is kept (token ids);
3. a drafter trains on that corpus (the loader daemon and ``dflash-train train``, one
   process) and is exported (``dflash-train export``, bf16);
4. vLLM serves the target with the exported drafter as its DFlash speculator, and:

   * weights: every tensor of the export was read by vLLM and its values are in one of the
     drafter's parameters, and every parameter of vLLM's drafter holds checkpoint values
     (or is the target's own embedding / LM head, or one vLLM does not use). vLLM's DFlash
     loader does not report a missing tensor (it serves the drafter with ~0 acceptance),
     so a probe in vLLM's processes (``vllm_weight_probe.py``, as ``sitecustomize`` on
     ``PYTHONPATH``) records what it loaded and compares the values;
   * output: speculative greedy == plain greedy == the trainer's verifier, token ids, on
     every held-out prompt;
   * acceptance: vLLM's spec-decode counters (``/metrics``: drafts, accepted tokens, per
     position) over those requests == the trainer's verifier on the same prompts
     (``trainer.model.verifier``: ``tau_served``; its ``tau`` is z-lab's statistic), and
     above 1, so that the comparison means something;

5. a DFlash2 drafter, which vLLM's CPU build refuses to serve: vLLM's and speculators'
   DFlash2 model classes load it and compute what the trainer's drafter computes;
6. long context (``long_context_check``): the export of a drafter trained against a target
   with YaRN scaling, in both dialects, read by vLLM's config machinery: the target's
   RoPE and context length, and vLLM's rotary equal to the trainer's drafter's;
7. a table of the checks and of the time each phase took; exit status 1 naming what failed.

This module is the flow; the parts: ``serve_harness`` (checks, phases, commands, the
trainer's verifier), ``serve_drafters`` (each drafter trained, served and compared),
``serve_weights`` (the weight probe), ``serve_parity`` (speculators' and vLLM's DFlash code
against the trainer's drafter), ``serve_engine`` (the evaluation's vLLM engine against
serve-check's own requests); vLLM's server and the calls to it are ``trainer.eval.engine``,
shared with the batching experiment and ``dflash-train eval``.

``python -m scripts.checks.serve_check --vllm-python VENV/bin/python [--work DIR]``: without
``--work`` everything goes to a temporary folder, removed when every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.checks.long_context_check import run as long_context_checks
from scripts.checks.serve_drafters import DRAFTERS, dflash2_checks, drafter_checks, drafter_tag
from scripts.checks.serve_engine_states import (
    ENGINE_DRAFTER,
    TWIN,
    across_nodes_check,
    engine_flags,
    states_checks,
    training_check,
    two_ranks_check,
)
from scripts.checks.serve_harness import COMPARISON, PY, TRAIN, Check, Phases, sh
from scripts.servers.chat_server import running
from trainer.vllm.api import complete
from trainer.vllm.process import vllm_server


def journal_replies(out: Path) -> dict[int, list[dict[str, str]]]:
    from trainer.data.server.journal import journal_path

    recs: dict[int, list[dict[str, str]]] = {}
    for line in journal_path(out).read_text().splitlines()[1:]:
        rec = json.loads(line)
        recs[int(rec["row"])] = rec["messages"]
    return recs


def regen(src: Path, out: Path, url: str, target: Path, holdout: int, log: Path) -> dict[str, Any]:
    text = sh(*TRAIN, "regen", str(src), str(out), "--server", url, "--tokenizer", str(target),
              "--max-tokens", "40", "--concurrency", "16", "--holdout", str(holdout),
              "--no-progress", log=log)  # fmt: skip
    return dict(json.loads(text.strip().splitlines()[-1]))


def stand_in_server(target: Path, log: Path) -> contextlib.AbstractContextManager[str]:
    return running(["--model", str(target), "--batch", "16"], log, python=PY)


def stop_token(output: list[int], start: int = 8) -> list[int]:
    """A stop token for a second pass: the first token of ``output`` at index >= ``start``
    that does not occur before it (so the response ends there), or none."""
    for i in range(start, len(output) - 1):
        if output[i] not in output[:i]:
            return [output[i]]
    return []


def cut_at(output: list[int], stop: list[int]) -> list[int]:
    return output[: output.index(stop[0]) + 1] if stop else output


# ---- the run ---------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path, phases: Phases) -> list[Check]:
    from trainer.data.regen import load_prompts

    checks: list[Check] = []
    chat, target, corpus = work / "chat", work / "target", work / "corpus"
    with phases("data: conversations, tokenizer, tiny Qwen3 target"):
        sh(PY, "-m", "scripts.fixtures.tiny_chat", str(chat), "--conversations",
           str(args.conversations), "--words", "40", "--template", "qwen3")  # fmt: skip
        sh(*TRAIN, "save-target", str(target), "--tiny-vocab", "1024",
           "--tokenizer", str(chat / "tokenizer"))  # fmt: skip
    conversations = chat / "conversations.jsonl"
    head = work / "head.jsonl"
    head.write_text("".join(conversations.read_text().splitlines(True)[: args.compare_rows]))

    with (
        phases("vLLM serves the target: regen, plain greedy"),
        vllm_server(args.vllm_python, target, work / "vllm-target.log") as url,
    ):
        summary = regen(conversations, corpus, url, target, args.prompts, work / "regen.log")
        ok = summary["failed"] == 0 and summary["regenerated"] > 0
        checks.append(Check(
                "regen --server through vLLM", ok,
                f"{summary['regenerated']} conversations regenerated, {summary['failed']} "
                f"failed, {summary['corpus']['conversations']} in the corpus, "
                f"{summary['holdout']} held out",
            ))  # fmt: skip
        heldout = corpus / "heldout.jsonl"
        prompts = [p.tolist() for p in load_prompts(heldout)][: args.prompts]
        plain = complete(url, prompts, args.max_tokens)
        # a second pass ends each response at a stop token of its own, inside a step
        stops = [stop_token(o) for o in plain]
        plain_stop = [cut_at(o, s) for o, s in zip(plain, stops, strict=True)]

    with phases("stand-in (scripts/servers/chat_server.py) regen of the first rows"):
        with stand_in_server(target, work / "chat-server.log") as url:
            regen(head, work / "corpus-stand-in", url, target, 0, work / "regen-stand-in.log")
        ours, theirs = journal_replies(corpus), journal_replies(work / "corpus-stand-in")
        rows = sorted(theirs)
        differ = [r for r in rows if ours.get(r) != theirs[r]]
        checks.append(Check(
            "stand-in replies == vLLM replies", not differ and bool(rows),
            f"{len(rows) - len(differ)} of {len(rows)} conversations identical"
            + (f"; differ: rows {differ[:10]}" if differ else ""),
        ))  # fmt: skip

    for name, flags in DRAFTERS.items():
        checks += drafter_checks(
            args, work, phases, name, flags, corpus, target, prompts, plain, plain_stop, stops
        )
    checks += states_checks(args, work, phases, target, prompts)
    checks += drafter_checks(
        args, work, phases, ENGINE_DRAFTER, DRAFTERS[TWIN] + engine_flags(args.vllm_python),
        corpus, target, prompts, plain, plain_stop, stops,
    )  # fmt: skip
    checks.append(training_check(work, drafter_tag(ENGINE_DRAFTER), drafter_tag(TWIN)))
    checks += [f(args, work, phases, corpus, target) for f in (two_ranks_check, across_nodes_check)]
    checks += dflash2_checks(args, work, phases, corpus, target, prompts, plain)
    with phases("long context: a YaRN target's exports in vLLM's config reader"):
        checks += long_context_checks(args.vllm_python, work / "long-context")
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="Python of the vLLM virtualenv.")
    p.add_argument("--work", type=Path, help="Working folder (kept) [a temporary one].")
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--compare-rows", type=int, default=32, help="Rows the stand-in regenerates.")
    p.add_argument("--prompts", type=int, default=16, help="Held-out prompts.")
    p.add_argument("--max-tokens", type=int, default=48, help="Tokens per held-out prompt.")
    p.add_argument("--steps", type=int, default=120, help="Training steps.")
    p.add_argument("--min-tau", type=float, default=1.1)
    args = p.parse_args(argv)
    # SIGTERM/SIGHUP end the check as Ctrl-C does: through the finally blocks that stop the
    # servers (vLLM's run in sessions of their own, so no signal reaches them otherwise).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    keep = args.work is not None
    work = (args.work or Path(tempfile.mkdtemp(prefix="serve-check-"))).resolve()
    if keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    t0 = time.perf_counter()
    try:
        checks = run(args, work, phases)
    except RuntimeError as e:
        checks = [Check("serve-check ran to the end", False, str(e))]
    print_report(checks, phases, time.perf_counter() - t0)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"serve-check FAILED: {'; '.join(failed)} (logs: {work})")
        return 1
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"serve-check passed: {len(checks)} checks")
    return 0


def print_report(checks: list[Check], phases: Phases, total: float) -> None:
    """The closing tables: every check, the drafters served, the time of each phase."""
    print("\nserve-check (vLLM in the loop):")
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}")
    if COMPARISON:
        print("drafters (same data, same steps; tau of the max_tokens pass):")
        print(f"  {'drafter':<24} {'flags':<64} {'vLLM tau':>8} {'served':>7} {'z-lab':>6} "
              f"{'loss':>6} {'step s':>7} {'RSS GB':>7}")  # fmt: skip
        for r in COMPARISON:
            vllm_tau = "n/a" if r["vllm_tau"] is None else f"{r['vllm_tau']:.3f}"
            print(
                f"  {r['drafter']:<24} {r['flags']:<64} {vllm_tau:>8} "
                f"{r['tau_served']:>7.3f} {r['tau']:>6.3f} {r['last_loss']:>6.2f} "
                f"{r['step_s']:>7.3f} {r['rss_peak_gb']:>7.2f}"
            )
    print("phases:")
    for name, dt in phases.times:
        print(f"  {dt:7.1f} s  {name}")
    print(f"  {total:7.1f} s  total")


if __name__ == "__main__":
    sys.exit(main())
