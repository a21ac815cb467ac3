"""serve-check's drafter checks: each drafter trained on vLLM's regenerated corpus, exported,
and served by vLLM (or, for DFlash2, which vLLM's CPU build refuses, loaded by vLLM's and
speculators' model classes).

For each DFlash drafter of ``DRAFTERS``: vLLM loaded every weight (``serve_weights``), its
speculative greedy output equals plain greedy and the trainer's verifier, its spec-decode
counters equal the verifier's acceptance, which is above 1, and speculators converts the
export and drafts alike (``serve_parity``); the ``SPECULATORS_SERVED`` ones are served from
their ``--format speculators`` export too, and the ``ENGINE_SERVED`` ones by the evaluation's
engine (``serve_engine``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.checks.serve_engine import ENGINE_SERVED, engine_checks
from scripts.checks.serve_harness import (
    BLOCK,
    COMPARISON,
    NEAR_TIE,
    TIES_TRIED,
    TRAIN,
    Check,
    Phases,
    PromptSteps,
    Verifier,
    pooled_positions,
    sh,
)  # fmt: skip
from scripts.checks.serve_parity import speculators_parity, vllm_dflash2_parity
from scripts.checks.serve_weights import check_weights, probe_env
from scripts.servers.daemon_process import DaemonProcess
from trainer.vllm.api import complete
from trainer.vllm.metrics import SpecCounters, read_counters
from trainer.vllm.process import tail, vllm_server

SLIDING_WINDOW = 16  # the sliding drafter's window: shorter than most prompts

#: The drafters served: the first DFlash (full attention), and a sliding-window one (all
#: layers sliding: vLLM's V1 runner, the one its CPU build has, serves no mix of sliding
#: and full layers: "Model Runner V1 does not support: mixed sliding/full dflash drafts").
DRAFTERS: dict[str, list[str]] = {
    "full attention": ["--drafter-layers", "2"],
    "sliding window": ["--drafter-layers", "2", "--sliding-window", str(SLIDING_WINDOW)],
    "sliding, bidirectional": [
        "--drafter-layers", "2", "--sliding-window", str(SLIDING_WINDOW),
        "--sliding-bidirectional",
    ],
}  # fmt: skip

#: The drafters vLLM also serves from their speculators-dialect export (``--format
#: speculators``, given to vLLM as ``--model``).
SPECULATORS_SERVED = {"full attention"}

#: vLLM's CPU build (V1 model runner only) refuses a DFlash2 drafter with this line.
DFLASH2_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"
#: The DFlash2 drafter (full-attention layers: speculators' sliding mask is another rule).
DFLASH2_FLAGS = ["--drafter", "dflash2", "--drafter-layers", "2", "--selector-rank", "64"]


def train_and_export(
    args: argparse.Namespace, work: Path, phases: Phases, name: str, tag: str,
    flags: list[str], corpus: Path, target: Path,
) -> tuple[Path, Path, dict[str, Any], float]:  # fmt: skip
    """The drafter ``flags`` describe, trained on ``corpus`` (the loader daemon and
    ``dflash-train train``) and exported (bf16): run folder, export, summary, peak RSS."""
    run_dir, export = work / f"run-{tag}", work / f"drafter-{tag}"
    with phases(f"{name}: train the drafter ({args.steps} steps) and export it"):
        endpoint = f"ipc://{work}/loader-{tag}.sock"
        # Padded, the position decay and AdamW, as when docs/SERVING.md's figures were
        # measured on these drafters: serving does not depend on the layout, the loss
        # weighting or the optimizer a drafter was trained with (the demo trains the
        # defaults: packed, D-PACE, Muon).
        daemon = DaemonProcess(corpus, endpoint, "--token-budget", "2048", "--max-seq-len", "512",
                               "--layout", "padded",
                               log_path=work / f"daemon-{tag}.log")  # fmt: skip
        try:
            sh(*TRAIN, "train", "--endpoint", endpoint, "--target", str(target), "--job", tag,
               "--run-dir", str(run_dir), "--steps", str(args.steps), "--block-size", str(BLOCK),
               "--anchors-per-doc", "16", "--token-budget", "2048", "--max-seq-len", "512",
               "--optimizer", "adamw", "--lr", "3e-3", "--loss-weighting", "decay",
               "--num-eval-prompts", "0",
               "--cost-samples", "0",
               "--no-progress", *flags, log=work / f"train-{tag}.log",
               env=_threads(flags))  # fmt: skip
        finally:
            daemon.stop()
        sh(*TRAIN, "export", str(run_dir), str(export))
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rss = max(r.get("rss_peak_gb", 0.0) for r in records)
        print(  # tau is the verifier's, below (the run evaluates none)
            f"   training: loss {summary['first_loss']:.2f} -> {summary['last_loss']:.2f}, "
            f"{summary.get('steps', '?')} steps"
        )
    return run_dir, export, summary, rss


def _threads(flags: list[str]) -> dict[str, str] | None:
    """A run fed by a vLLM server it started on this machine trains with one thread: the
    server's threads and the trainer's share the cores, and two spinning OpenMP pools on
    two cores made each step 17x slower (1.02 s against 0.060 s; one thread: 0.080 s)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"} if "--target-engine" in flags else None


def drafter_tag(name: str) -> str:
    """A drafter's name in its files (``run-TAG``, ``drafter-TAG``)."""
    return name.replace(",", "").replace(" ", "-")


def drafter_checks(
    args: argparse.Namespace,
    work: Path,
    phases: Phases,
    name: str,
    flags: list[str],
    corpus: Path,
    target: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
    plain_stop: list[list[int]],
    stops: list[list[int]],
) -> list[Check]:
    """Train the drafter ``flags`` describe, export it, serve it with vLLM and compare
    vLLM's output and acceptance with plain greedy and the trainer's verifier."""
    tag = drafter_tag(name)
    no_stops: list[list[int]] = [[] for _ in prompts]
    run_dir, export, summary, rss = train_and_export(args, work, phases, name, tag, flags, corpus,
                                                     target)  # fmt: skip

    report = work / f"vllm-weights-{tag}.json"
    with phases(f"{name}: vLLM serves the target with the DFlash drafter"):
        with vllm_server(args.vllm_python, target, work / f"vllm-dflash-{tag}.log", export,
                         num_speculative_tokens=BLOCK - 1,
                         **probe_env(work, report)) as url:  # fmt: skip
            spec, reads = complete_counted(url, prompts, args.max_tokens)
            spec_stop, reads_stop = complete_counted(url, prompts, args.max_tokens, stops)
        counters = [reads[0], reads[-1]]  # the max_tokens pass
        checks = [check_weights(report, export, name)]

    with phases(f"{name}: the trainer's verifier on the same prompts"):
        verifier = Verifier(target, export)
        passes = []
        for label, out, greedy, ends, reads_ in (("max_tokens", spec, plain, no_stops, reads),
                                                 ("stop tokens", spec_stop, plain_stop, stops,
                                                  reads_stop)):  # fmt: skip
            rep, verified, steps = verifier.run(prompts, args.max_tokens, ends)
            odd = mismatches(verifier, prompts, args.max_tokens, ends, steps, reads_)
            passes.append((label, out, greedy, rep, verified, steps, reads_, odd))

    with phases(f"{name}: speculators converts the export and drafts with it"):
        # fp32: speculators' converter casts the target's embedding it adds to the export's
        # dtype, which bf16 would round
        full = work / f"drafter-{tag}-fp32"
        sh(*TRAIN, "export", str(run_dir), str(full), "--dtype", "fp32")
        checks.append(speculators_parity(args, work, tag, name, run_dir, full, target,
                                         prompts[0] + plain[0]))  # fmt: skip

    compared = [_compare_pass(*p) for p in passes]
    if name in SPECULATORS_SERVED:
        with phases(f"{name}: vLLM serves its --format speculators export"):
            checks.append(speculators_served(args, work, name, tag, run_dir, target, prompts,
                                             spec, counters))  # fmt: skip
    if name in ENGINE_SERVED:
        with phases(f"{name}: the eval engine (VllmEngine) serves it"):
            checks += engine_checks(args, work, name, tag, target, export, prompts, spec,
                                    counters[1].minus(counters[0]))  # fmt: skip
    return checks + _served_checks(args, name, flags, compared, stops, summary, rss)


def complete_counted(
    url: str, prompts: list[list[int]], max_tokens: int, stops: list[list[int]] | None = None
) -> tuple[list[list[int]], list[SpecCounters]]:
    """``complete``'s greedy completions, one request at a time, and vLLM's spec-decode
    counters read before the first and after each: ``reads[i + 1].minus(reads[i])`` is
    prompt ``i``'s."""
    reads, out = [read_counters(url)], []
    for k, p in enumerate(prompts):
        out += complete(url, [p], max_tokens, [stops[k]] if stops else None)
        reads.append(read_counters(url))
    return out, reads


@dataclass
class Pass:
    """One pass over the held-out prompts, vLLM's against the verifier's: the outputs and
    the acceptance, in words, whether each is equal, vLLM's tau and the verifier's report."""

    label: str
    outputs: str
    acceptance: str
    equal_outputs: bool
    equal_acceptance: bool
    tau_vllm: float
    rep: Any


@dataclass
class Mismatch:
    """A prompt whose vLLM counters are not the verifier's: vLLM's (steps, accepted,
    accepted by position), the verifier's, and the near-tie ``(gap, step, position)`` that,
    decided the other way, gives vLLM's counters exactly (None: no tie explains it)."""

    prompt: int
    theirs: tuple[int, int, dict[int, int]]
    ours: PromptSteps
    tie: tuple[float, int, int] | None


def mismatches(
    verifier: Verifier, prompts: list[list[int]], max_new: int, stops: list[list[int]],
    steps: list[PromptSteps], reads: list[SpecCounters],
) -> list[Mismatch]:  # fmt: skip
    """The prompts whose counters (``reads`` around each) differ from the verifier's
    ``steps``, each with the near-tie that explains it, if one does."""
    out = []
    for i, s in enumerate(steps):
        seen = reads[i + 1].minus(reads[i])
        theirs = (seen.drafts, seen.accepted, {p: v for p, v in enumerate(seen.per_position) if v})
        if theirs != s.counts():
            tie = verifier.explain(prompts[i], max_new, stops[i], s, theirs)
            out.append(Mismatch(i, theirs, s, tie))
    return out


def _compare_pass(
    label: str, served: list[list[int]], greedy: list[list[int]], rep: Any,
    verified: list[list[int]], steps: list[PromptSteps], reads: list[SpecCounters],
    odd: list[Mismatch],
) -> Pass:  # fmt: skip
    """vLLM's speculative output against plain greedy and the verifier's, and vLLM's
    spec-decode counters (read around each prompt) against the verifier's steps, prompt by
    prompt. A prompt's counters may differ only where a near-tie of the drafter's, decided
    the other way, gives vLLM's counters exactly (two fp32 implementations may break a tie
    apart), in at most ``max_tied(n)`` prompts."""
    n = len(served)
    same = [i for i, t in enumerate(served) if t == greedy[i] == verified[i]]
    differ = [i for i in range(n) if i not in same]
    outputs = f"{label}: {len(same)}/{n} prompts ({sum(map(len, served))} tokens)" + (
        f", differ: {differ[:10]}" if differ else ""
    )
    seen = reads[-1].minus(reads[0])
    ours = pooled_positions(steps)
    v_pos = {p: v for p, v in enumerate(seen.per_position) if v}
    ours_drafts, ours_acc = sum(s.drafts for s in steps), sum(s.accepted for s in steps)
    same_acc = len(odd) <= max_tied(n) and all(m.tie is not None for m in odd)
    tau_vllm = seen.tau if seen.drafts else 0.0
    acceptance = (
        (
            f"{label}: drafts {seen.drafts}/{ours_drafts}, accepted {seen.accepted}/{ours_acc}, "
            f"per position {'equal' if v_pos == ours else f'{v_pos} vs {ours}'}, "
            f"tau {tau_vllm:.3f}/{rep.tau_served:.3f} (z-lab's tau {rep.tau:.3f}, "
            f"tokens per step {rep.tau_committed:.3f})"
        )
        + "".join(f"; {_explained(m)}" for m in odd)
        + (f" (more than {max_tied(n)} of {n} prompts differ)" if len(odd) > max_tied(n) else "")
    )
    return Pass(label, outputs, acceptance, len(same) == n, same_acc, tau_vllm, rep)


def _explained(m: Mismatch) -> str:
    head = (
        f"prompt {m.prompt} differs (drafts {m.theirs[0]}/{m.ours.drafts}, accepted "
        f"{m.theirs[1]}/{m.ours.accepted})"
    )
    if m.tie is None:
        tried = ", ".join(f"{g:.1e}" for g, _, _ in m.ours.ties[:TIES_TRIED]) or "none"
        return f"{head}, no near-tie explains it (tried, gaps < {NEAR_TIE:g}: {tried})"
    gap, step, pos = m.tie
    return (
        f"{head}: a near-tie, the drafter's top two logits {gap:.1e} apart at step {step}, "
        f"draft {pos}; with its second choice there the verifier counts vLLM's exactly"
    )


def max_tied(n: int) -> int:
    """How many of ``n`` prompts may differ at a tie: one in eight, at least one."""
    return max(1, n // 8)


def _served_checks(
    args: argparse.Namespace, name: str, flags: list[str], passes: list[Pass],
    stops: list[list[int]], summary: dict[str, Any], rss: float,
) -> list[Check]:  # fmt: skip
    """The checks of the passes (outputs equal, acceptance equal, acceptance above 1) and
    the drafter's row of ``COMPARISON`` (the first pass's tau)."""
    stopped = sum(1 for s in stops if s)
    equal_out = all(p.equal_outputs for p in passes)
    equal_acc = all(p.equal_acceptance for p in passes)
    first = passes[0]
    label, tau_vllm, rep = first.label, first.tau_vllm, first.rep
    COMPARISON.append({
        "drafter": name, "flags": " ".join(flags) or "-", "vllm_tau": tau_vllm,
        "tau_served": rep.tau_served, "tau": rep.tau, "last_loss": summary["last_loss"],
        "step_s": summary["median_step_time_s"], "rss_peak_gb": rss,
    })  # fmt: skip
    return [
        Check(
            f"{name}: speculative == plain greedy == verifier", equal_out and stopped > 0,
            "; ".join(p.outputs for p in passes) + f"; {stopped} prompts end at their stop token",
        ),
        Check(
            f"{name}: vLLM acceptance == trainer's verifier", equal_acc,
            "vLLM/verifier (tau: 1 + accepted/drafts / tau_served) "
            + "; ".join(p.acceptance for p in passes),
        ),
        Check(
            f"{name}: acceptance above 1 (a meaningful comparison)", tau_vllm >= args.min_tau,
            f"{tau_vllm:.3f} >= {args.min_tau} ({label}; the verifier's z-lab tau {rep.tau:.3f}, "
            f"pooled {rep.tau_pooled:.3f}, served {rep.tau_served:.3f}, "
            f"committed {rep.tau_committed:.3f})",
        ),
    ]  # fmt: skip


def speculators_served(
    args: argparse.Namespace, work: Path, name: str, tag: str, run_dir: Path, target: Path,
    prompts: list[list[int]], spec: list[list[int]], counters: list[SpecCounters],
) -> Check:  # fmt: skip
    """vLLM serves the speculators-dialect export of the same drafter (bf16, as the DFlash
    one): its output and spec-decode counters equal the DFlash dialect's."""
    folder = work / f"drafter-{tag}-speculators-bf16"
    sh(*TRAIN, "export", str(run_dir), str(folder), "--format", "speculators")
    with vllm_server(args.vllm_python, target, work / f"vllm-speculators-{tag}.log", folder,
                     speculators=True, num_speculative_tokens=BLOCK - 1) as url:  # fmt: skip
        before = read_counters(url)
        out = complete(url, prompts, args.max_tokens)
        after = read_counters(url)
    theirs, ours = after.minus(before), counters[1].minus(counters[0])
    same = sum(1 for a, b in zip(out, spec, strict=True) if a == b)
    return Check(
        f"{name}: vLLM serves the --format speculators export alike",
        same == len(prompts) and (theirs.drafts, theirs.accepted) == (ours.drafts, ours.accepted),
        f"vllm serve SPECULATORS_FOLDER (the verifier from its config): {same}/{len(prompts)} "
        f"outputs equal the DFlash folder's; drafts {theirs.drafts}/{ours.drafts}, "
        f"accepted {theirs.accepted}/{ours.accepted}",
    )  # fmt: skip


def dflash2_checks(
    args: argparse.Namespace,
    work: Path,
    phases: Phases,
    corpus: Path,
    target: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
) -> list[Check]:
    """A DFlash2 drafter, trained and exported as the others. vLLM's CPU build refuses to
    serve it (``DFLASH2_REFUSAL``, quoted), so: vLLM's DFlash2 model class loads it and its
    convolutions, candidate logits and selector edges equal ours; speculators' DFlash2
    model loads it and its forward equals ours; our verifier (the selector's greedy walk,
    plain greedy verification) is lossless against vLLM's plain greedy output."""
    name, tag, checks = "DFlash2", "dflash2", []
    run_dir, export, summary, rss = train_and_export(
        args, work, phases, name, tag, DFLASH2_FLAGS, corpus, target
    )
    log = work / "vllm-dflash2-serve.log"
    with phases(f"{name}: vLLM's CPU build is asked to serve it"):
        try:
            with vllm_server(
                args.vllm_python, target, log, export, num_speculative_tokens=BLOCK - 1
            ):
                served = "vLLM served it (its CPU build now runs DFlash2: serve-check it fully)"
                checks.append(Check(f"{name}: vLLM's CPU build refuses it", False, served))
        except RuntimeError:
            said = DFLASH2_REFUSAL in log.read_text(errors="replace")
            checks.append(Check(
                f"{name}: vLLM's CPU build refuses it, for the known reason", said,
                f'"{DFLASH2_REFUSAL}" (its V2 runner, which serves DFlash2, needs Triton)'
                if said else f"vLLM failed otherwise: {tail(log, 8)}",
            ))  # fmt: skip
    full = work / f"drafter-{tag}-fp32"
    sh(*TRAIN, "export", str(run_dir), str(full), "--dtype", "fp32")
    with phases(f"{name}: vLLM's model class and speculators' model load it"):
        checks.append(vllm_dflash2_parity(args, work, name, full, target, prompts[0] + plain[0]))
        checks.append(speculators_parity(args, work, tag, name, run_dir, full, target,
                                         prompts[0] + plain[0]))  # fmt: skip
    with phases(f"{name}: the trainer's verifier (the selector's walk) on the same prompts"):
        rep, tokens, _ = Verifier(target, export).run(prompts, args.max_tokens,
                                                      [[] for _ in prompts])  # fmt: skip
    same = sum(1 for t, g in zip(tokens, plain, strict=True) if t == g)
    checks.append(Check(
        f"{name}: verifier output == vLLM's plain greedy", same == len(prompts),
        f"{same}/{len(prompts)} prompts; tau {rep.tau_served:.3f} served, {rep.tau:.3f} z-lab's",
    ))  # fmt: skip
    COMPARISON.append({
        "drafter": name, "flags": " ".join(DFLASH2_FLAGS), "vllm_tau": None,
        "tau_served": rep.tau_served, "tau": rep.tau, "last_loss": summary["last_loss"],
        "step_s": summary["median_step_time_s"], "rss_peak_gb": rss,
    })  # fmt: skip
    return checks
