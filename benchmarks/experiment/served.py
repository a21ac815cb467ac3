"""vLLM's acceptance length for every drafter of a ``--corpus text`` experiment.

Each run's final checkpoint is exported (``dflash-train export --dtype fp32``) and served
by vLLM's OpenAI server (the CPU build that ``make serve-check`` installs, fp32) as the
DFlash speculator of the experiment's learned target. The held-out tau prompts (the ones
the trainer's verifier measured, same count, same ``eval_new_tokens``) are completed
greedily one at a time, and vLLM's spec-decode counters (``/metrics``) give its mean
acceptance length ``1 + accepted / drafts``. Serve-check shows that this equals the
verifier's ``tau_served`` on the same prompts; here the two are reported side by side
(``served_vs_verifier``) for every run, so any difference on a learned target shows.

A second pass serves every held-out sample's prompt (``HELDOUT_NEW_TOKENS`` tokens each):
more prompts and longer generations than the verifier's periodic measure, so the drafters'
served acceptance is compared with less measurement noise (``heldout``). The counters are
read after every prompt of that pass, so each prompt's drafts and accepted tokens are kept
(``per_prompt``): the paired comparison resamples prompts as well as seeds.

Results are kept in ``OUT_DIR/vllm/<run>.json`` and reused when the experiment is repeated,
only where they are of the same thing: each result (and each export) records a key of what
it depends on (``measure_key``: the run's final checkpoint by its manifest's digests, the
target, the prompts and the token counts), and one of another key is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Tokens generated per prompt in the pass over every held-out prompt.
HELDOUT_NEW_TOKENS = 64


def acceptance(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """vLLM's acceptance over the requests between two reads of its counters
    (``trainer.eval.engine.spec_counters``): drafts, accepted tokens, accepted per draft
    position, and the mean acceptance length ``1 + accepted / drafts``."""
    drafts = round(after["drafts"] - before["drafts"])
    accepted = round(after["accepted"] - before["accepted"])
    if drafts <= 0:
        raise ValueError(f"vLLM counted no drafts ({before} -> {after}): was a drafter served?")
    per_pos = {
        int(p): round(v - before["per_pos"].get(p, 0.0)) for p, v in after["per_pos"].items()
    }
    return {
        "drafts": drafts,
        "accepted": accepted,
        "per_pos": {p: n for p, n in sorted(per_pos.items()) if n},
        "tau": 1.0 + accepted / drafts,
    }


def checkpoint_key(run_dir: Path) -> str:
    """The run's newest checkpoint: its name and its manifest (every file's digest)."""
    from trainer.train.checkpoint import checkpoint_dir, list_checkpoints, manifest_path

    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(run_dir)}")
    manifest = manifest_path(found[-1])
    body = manifest.read_bytes() if manifest.is_file() else b""
    return f"{found[-1].name}:{hashlib.blake2b(body, digest_size=8).hexdigest()}"


def measure_key(
    run_dir: Path, target: Path, prompts: list[list[int]], heldout: list[list[int]],
    max_tokens: int,
) -> str:  # fmt: skip
    """16 hex digits of everything a run's vLLM measure depends on."""
    info = target / "target.json"
    doc = {
        "checkpoint": checkpoint_key(run_dir),
        "target": [str(target), info.read_text() if info.is_file() else None],
        "prompts": prompts, "max_tokens": max_tokens,
        "heldout": heldout, "heldout_max_tokens": HELDOUT_NEW_TOKENS,
    }  # fmt: skip
    text = json.dumps(doc, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


def export_final(run_dir: Path, out: Path) -> Path:
    """The run's newest checkpoint as an fp32 DFlash folder (made again when the run's
    newest checkpoint is not the one it was made of)."""
    key, stamp = checkpoint_key(run_dir), out.with_name(out.name + ".checkpoint")
    if (out / "config.json").is_file() and stamp.is_file() and stamp.read_text() == key:
        return out
    cmd = [sys.executable, "-m", "trainer.cli", "export", str(run_dir), str(out),
           "--dtype", "fp32", "--force"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"export of {run_dir} failed:\n{res.stdout}{res.stderr}"[-3000:])
    stamp.write_text(key)
    return out


def serve_run(
    cfg: Any, name: str, vllm_python: str, prompts: list[list[int]], heldout: list[list[int]]
) -> dict[str, Any]:
    """vLLM's acceptance for one run (cached in ``OUT_DIR/vllm/<name>.json``): on the tau
    ``prompts`` as the verifier measured them, and on every ``heldout`` prompt."""
    from trainer.vllm.api import complete
    from trainer.vllm.metrics import spec_counters
    from trainer.vllm.process import vllm_server

    out = cfg.out_dir / "vllm" / f"{name}.json"
    run_dir = cfg.out_dir / "runs" / name
    key = measure_key(run_dir, cfg.target_dir(), prompts, heldout, cfg.eval_new_tokens)
    if out.is_file():  # reused when measured of the same checkpoint, target and prompts
        old = json.loads(out.read_text())
        if old.get("key") == key:
            return dict(old)
        log.info("%s: its vLLM measure is of another checkpoint or prompts: measured again", name)
    out.parent.mkdir(parents=True, exist_ok=True)
    export = export_final(run_dir, cfg.out_dir / "exports" / name)
    t0 = time.perf_counter()
    with vllm_server(
        vllm_python, cfg.target_dir(), cfg.out_dir / "logs" / f"vllm-{name}.log", export,
        num_speculative_tokens=cfg.block_size - 1,
    ) as url:  # fmt: skip
        counters = [spec_counters(url)]
        tokens = complete(url, prompts, cfg.eval_new_tokens)
        counters.append(spec_counters(url))
        held, per_prompt = [], []
        for prompt in heldout:  # the counters read after each: per-prompt (drafts, accepted)
            held += complete(url, [prompt], HELDOUT_NEW_TOKENS)
            counters.append(spec_counters(url))
            per_prompt.append(
                [round(counters[-1][k] - counters[-2][k]) for k in ("drafts", "accepted")]
            )
    res = {
        **acceptance(counters[0], counters[1]),
        "key": key,
        "prompts": len(prompts),
        "max_tokens": cfg.eval_new_tokens,
        "output_tokens": sum(map(len, tokens)),
        "heldout": {
            **acceptance(counters[1], counters[-1]),
            "prompts": len(heldout),
            "max_tokens": HELDOUT_NEW_TOKENS,
            "output_tokens": sum(map(len, held)),
            "per_prompt": per_prompt,  # for the paired bootstrap (benchmarks.experiment.stats)
        },
        "seconds": time.perf_counter() - t0,
    }
    out.write_text(json.dumps(res, indent=2) + "\n")
    held = res["heldout"]
    log.info("%s: vLLM tau %.3f (%d drafts), on all held-out prompts %.3f (%d drafts)",
             name, res["tau"], res["drafts"], held["tau"], held["drafts"])  # fmt: skip
    return res


def check_interpreter(vllm_python: str) -> None:
    """Refuse, before anything trains, an interpreter that is missing or has no vLLM."""
    hint = (
        "`bash scripts/checks/serve_check.sh --venv-only` makes vLLM's CPU virtualenv "
        "(docs/SERVING.md)"
    )
    if not Path(vllm_python).is_file():
        raise FileNotFoundError(f"--vllm-python {vllm_python}: no such interpreter; {hint}")
    res = subprocess.run([vllm_python, "-c", "import vllm.entrypoints.openai.api_server"],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        why = res.stderr.strip()[-300:]
        raise RuntimeError(f"--vllm-python {vllm_python}: vLLM does not import ({why}); {hint}")


def serve_runs(cfg: Any, names: list[str], vllm_python: str) -> dict[str, dict[str, Any]]:
    """vLLM's acceptance for every run in ``names``, one server at a time."""
    from loader_server.data.dataset import open_dataset
    from trainer.data.regen import heldout_prompts, load_prompts

    prompts = [p.tolist() for p in load_prompts(cfg.data_dir / "tau.jsonl")][: cfg.text.tau]
    ds = open_dataset(cfg.data_dir / "heldout")
    src = cfg.data_dir / "prompts-heldout.jsonl"
    heldout = [p.prompt for p in heldout_prompts(ds, src, range(len(ds)))]
    return {name: serve_run(cfg, name, vllm_python, prompts, heldout) for name in names}
