"""What every part of serve-check shares: the paths and commands, a check's result, the
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
    ) -> tuple[Any, list[list[int]], dict[int, int]]:
        """The TauReport over ``prompts`` (each also ending at its ``stops``), the output
        tokens, and the accepted drafts by position over the served steps (as vLLM's
        ``spec_decode_num_accepted_tokens_per_pos`` counts them)."""
        import torch

        from trainer.model.verifier import TauReport, speculative_generate

        rep, tokens, per_pos = TauReport(), [], {}
        for p, stop in zip(prompts, stops, strict=True):
            r = speculative_generate(
                self.target, self.proposer, torch.tensor(p), block_size=self.block,
                max_new_tokens=max_new, eos_token_ids=self.eos + tuple(stop),
            )  # fmt: skip
            rep.add(r)
            tokens.append(r.tokens.tolist())
            for length in r.acceptance_lengths[: r.served_steps]:
                for k in range(length - 1):
                    per_pos[k] = per_pos.get(k, 0) + 1
        return rep, tokens, per_pos
