"""The harness every part of serve-check runs in: the paths and commands, a check's result, the
phase timer, the command runner, the trainer's verifier with an exported drafter, and the
table of the drafters served."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TRAIN = [PY, "-m", "trainer.cli"]
BLOCK = 8  # drafter block size: B - 1 = 7 speculative tokens

#: One row per drafter served: its tau (vLLM's and the verifier's) and training costs.
COMPARISON: list[dict[str, Any]] = []


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class Phases:
    """Wall time of each phase, printed as it ends and in the closing table."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.times.append((name, dt))
            print(f"   {name}: {dt:.1f} s", flush=True)


def sh(*args: str, log: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command; its output goes to ``log`` (or is returned). Raises on failure with
    the output's end."""
    shown = " ".join(a.replace(PY, "python") for a in args)
    print(f"   $ {shown}", flush=True)
    out = subprocess.run(
        args, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    if log is not None:
        log.write_text(out.stdout)
    if out.returncode != 0:
        raise RuntimeError(f"`{shown}` exited with {out.returncode}:\n{out.stdout[-3000:]}")
    return out.stdout


#: The widest gap between the drafter's top two logits at which another fp32 implementation
#: of the same drafter may pick the other token: vLLM's target computes the drafter's
#: context features with its own kernels, and a near-tie can fall either way (measured: a
#: sliding-window drafter's one differing step had its top two 5.5e-4 apart). A flip moves
#: that step's acceptance and every later step of its prompt.
NEAR_TIE = 1e-2
#: The narrowest near-ties of a prompt that a replay tries flipping.
TIES_TRIED = 4


@dataclass(frozen=True)
class PromptSteps:
    """One prompt's served draft steps as vLLM's counters count them (steps, accepted
    drafts, accepted drafts by position), and its near-ties: ``(gap, step, position)`` of
    each draft position that decided a step (the accepted ones and the first rejected
    one) where the drafter's top two logits lie within ``NEAR_TIE``, narrowest first."""

    drafts: int
    accepted: int
    per_position: dict[int, int]
    ties: list[tuple[float, int, int]]

    def counts(self) -> tuple[int, int, dict[int, int]]:
        return self.drafts, self.accepted, self.per_position


class Verifier:
    """The trainer's verifier (``trainer.model.verifier``) with the exported drafter, its
    weights as the folder holds them, and the target's EOS ids as the trainer takes them."""

    def __init__(self, target_dir: Path, export: Path) -> None:
        import torch
        from transformers import GenerationConfig

        from trainer.hf.folder import config_from_folder, init_drafter, read_drafter_folder
        from trainer.model.drafter import DFlashDrafter
        from trainer.model.target import load_target
        from trainer.model.verifier import DrafterProposer, eos_ids

        torch.set_num_threads(2)
        folder = read_drafter_folder(export)
        target = load_target(str(target_dir), layer_ids=folder.target_layer_ids)
        cfg = config_from_folder(folder, target)
        drafter = DFlashDrafter(cfg)
        init_drafter(drafter, folder, target)
        drafter.eval()
        generation = GenerationConfig.from_pretrained(target_dir)
        self.eos = tuple(dict.fromkeys(eos_ids(target.config) + eos_ids(generation)))
        self.target, self.block = target, cfg.block_size
        self.proposer = DrafterProposer(target, drafter)

    def run(
        self, prompts: list[list[int]], max_new: int, stops: list[list[int]]
    ) -> tuple[Any, list[list[int]], list[PromptSteps]]:
        """The TauReport over ``prompts`` (each also ending at its ``stops``), the output
        tokens, and each prompt's served steps (``PromptSteps``)."""
        from trainer.model.verifier import TauReport

        rep, tokens, steps = TauReport(), [], []
        for p, stop in zip(prompts, stops, strict=True):
            r, s = self.generate(p, max_new, stop)
            rep.add(r)
            tokens.append(r.tokens.tolist())
            steps.append(s)
        return rep, tokens, steps

    def generate(
        self, prompt: list[int], max_new: int, stop: list[int], flip: tuple[int, int] | None = None
    ) -> tuple[Any, PromptSteps]:
        """One prompt's ``SpecResult`` and ``PromptSteps``; ``flip=(step, position)`` drafts
        the drafter's second choice there instead of its first (a near-tie decided the
        other way)."""
        import torch

        from trainer.model.verifier import speculative_generate

        recorder = _GapRecorder(self.proposer, flip)
        r = speculative_generate(
            self.target, recorder, torch.tensor(prompt), block_size=self.block,
            max_new_tokens=max_new, eos_token_ids=self.eos + tuple(stop),
        )  # fmt: skip
        served = r.acceptance_lengths[: r.served_steps]
        per_pos: dict[int, int] = {}
        for length in served:
            for k in range(length - 1):
                per_pos[k] = per_pos.get(k, 0) + 1
        # a step that accepted j drafts was decided at positions 0..j (j: the rejected one,
        # when there is one); the steps after the served ones are not compared
        ties = sorted(
            (gap, step, pos)
            for step, (gaps, n) in enumerate(zip(recorder.gaps, served, strict=False))
            for pos, gap in enumerate(gaps[:n])
            if gap < NEAR_TIE
        )
        return r, PromptSteps(len(served), sum(served) - len(served), per_pos, ties)

    def explain(
        self, prompt: list[int], max_new: int, stop: list[int], ours: PromptSteps,
        theirs: tuple[int, int, dict[int, int]],
    ) -> tuple[float, int, int] | None:  # fmt: skip
        """The near-tie of ``ours`` (narrowest first, ``TIES_TRIED`` of them) which, decided
        the other way, gives exactly the counts ``theirs`` (another engine's), or None."""
        for gap, step, pos in ours.ties[:TIES_TRIED]:
            if self.generate(prompt, max_new, stop, flip=(step, pos))[1].counts() == theirs:
                return gap, step, pos
        return None


def pooled_positions(steps: list[PromptSteps]) -> dict[int, int]:
    """Accepted drafts by position over all of ``steps``' prompts."""
    out: dict[int, int] = {}
    for s in steps:
        for k, n in s.per_position.items():
            out[k] = out.get(k, 0) + n
    return out


class _GapRecorder:
    """A proposer that drafts as ``inner`` (the trainer's ``DrafterProposer``) does, but
    its second choice at ``flip=(step, position)``, and keeps, for each DFlash draft, the
    gap between the drafter's top two logits at every draft position (DFlash2's selector
    walk: no gaps, ``inf``)."""

    def __init__(self, inner: Any, flip: tuple[int, int] | None = None) -> None:
        self.inner, self.flip = inner, flip
        self.gaps: list[list[float]] = []

    def propose(self, committed: Any, ctx: Any, num: int) -> Any:
        if self.inner.drafter.candidate_selector is not None:
            self.gaps.append([float("inf")] * num)
            return self.inner.propose(committed, ctx, num)
        # one forward: a DFlash drafter drafts its logits' argmax (``DrafterProposer``)
        logits = self.inner.logits(committed, ctx)
        drafts = logits.argmax(-1)
        top2 = logits.float().topk(2, dim=-1)
        self.gaps.append((top2.values[:, 0] - top2.values[:, 1]).tolist())
        if self.flip is not None and self.flip[0] == len(self.gaps) - 1:
            drafts[self.flip[1]] = top2.indices[self.flip[1], 1]
        return drafts
