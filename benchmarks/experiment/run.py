"""``python -m benchmarks.experiment OUT_DIR``: does the batching spec change how a drafter trains?

The tiny setup (random-weight 4-layer Qwen3 target, 1-layer drafter) is trained on the
*learnable* synthetic corpus, whose difficulty depends on length: samples shorter than the
median follow an easy order-1 Markov chain (~0.5 bit/token), longer ones a hard order-2
chain (~1.6 bit/token). A step's loss therefore depends on which lengths it holds, and the
way batches are made decides that. Three loader specs, everything else identical (corpus,
seed, token budget, grad_accum, steps, learning rate):

* ``sorted``: one global length sort, greedy batches frozen for every epoch, only their
  order shuffled (the original pipeline's flaw: ``composition=sorted``).
* ``shuffled``: length buckets re-shuffled every epoch, micro-batches in random order (the
  reference fix: ``order=shuffled``).
* ``stratified``: the same buckets, every optimizer step given its share of every length
  band (ours: ``order=stratified``).

Steps: (1) write a training corpus and a held-out corpus (another seed); (2) start one real
loader daemon subprocess; (3) run the trainer once per (spec, seed) as a subprocess of a
world of one with ``grad_accum`` micro-batches per step; (4) stop the daemon (SIGTERM);
(5) analyse (``benchmarks.experiment.analysis``) and write ``results.json``, ``results.md``
and PNG plots (``benchmarks.experiment.report``).

Runs that finished are reused when the command is repeated with the same settings (e.g. to
add a seed); a run cut short is continued with ``--resume``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scripts.daemon_process import DaemonProcess

log = logging.getLogger(__name__)

#: Loader ``--spec`` pairs of each compared spec (``{buckets}`` is filled in).
SPECS: dict[str, tuple[str, ...]] = {
    "sorted": ("composition=sorted",),
    "shuffled": ("buckets={buckets}", "order=shuffled"),
    "stratified": ("buckets={buckets}", "order=stratified"),
}
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """What the experiment trains on and how. Lengths and budgets are in tokens."""

    out_dir: Path
    samples: int = 4000
    heldout_samples: int = 512
    median_len: float = 160.0
    sigma: float = 0.8
    min_len: int = 32
    max_len: int = 1024
    corpus_seed: int = 1
    steps: int = 300
    seeds: tuple[int, ...] = (0,)
    specs: tuple[str, ...] = ("sorted", "shuffled", "stratified")
    buckets: str = "auto:16"
    token_budget: int = 2048
    grad_accum: int = 4
    block_size: int = 8
    anchors_per_doc: int = 8
    lr: float = 3e-3
    eval_anchors: int = 32
    threads: int = 1
    burn_in: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        unknown = [s for s in self.specs if s not in SPECS]
        if unknown or not self.specs:
            raise ValueError(f"specs must be a non-empty subset of {list(SPECS)}, got {unknown}")
        if len(set(self.specs)) != len(self.specs) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"repeated spec or seed: {self.specs}, {self.seeds}")
        if not self.seeds or min(self.seeds) < 0:
            raise ValueError(f"seeds must be integers >= 0, got {self.seeds}")
        if self.steps < 3:
            raise ValueError(
                f"steps must be >= 3 (spikiness needs step-to-step changes), got {self.steps}"
            )
        if self.samples < 1 or self.heldout_samples < 4:
            raise ValueError(
                f"need samples >= 1 and heldout_samples >= 4 (one per length band), got "
                f"{self.samples}, {self.heldout_samples}"
            )
        if self.token_budget < self.max_len:
            raise ValueError(
                f"token_budget {self.token_budget} must hold one row of max_len {self.max_len}"
            )
        if not 0 <= self.burn_in < 1:
            raise ValueError(f"burn_in is a fraction of the steps in [0, 1), got {self.burn_in}")
        if self.threads < 1 or self.eval_anchors < 1:
            raise ValueError(f"threads and eval_anchors must be >= 1: {self}")

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.out_dir.resolve()}/loader.sock"

    def synth(self, *, heldout: bool) -> Any:
        from loader_server.data.synth import SynthSpec

        return SynthSpec(
            num_samples=self.heldout_samples if heldout else self.samples,
            seed=self.corpus_seed + (1000 if heldout else 0),
            median_len=self.median_len,
            sigma=self.sigma,
            min_len=self.min_len,
            max_len=self.max_len,
            vocab_size=512,
            content="learnable",
        )

    def run_name(self, spec: str, seed: int) -> str:
        return f"{spec}-s{seed}"

    def fixed_part(self) -> dict[str, Any]:
        """Settings every run in one OUT_DIR must share (seeds and specs may grow)."""
        d = asdict(self)
        for k in ("out_dir", "seeds", "specs", "threads"):
            d.pop(k)
        return d


def train_command(cfg: ExperimentConfig, spec: str, seed: int) -> list[str]:
    """The ``trainer.cli train`` command line of one run (identical across specs but for
    the ``--spec`` pairs and the job name)."""
    name = cfg.run_name(spec, seed)
    cmd = [
        sys.executable, "-m", "trainer.cli", "train",
        "--endpoint", cfg.endpoint, "--job", f"exp-{name}",
        "--run-dir", str(cfg.out_dir / "runs" / name),
        "--steps", str(cfg.steps), "--grad-accum", str(cfg.grad_accum),
        "--token-budget", str(cfg.token_budget), "--max-seq-len", str(cfg.max_len),
        "--block-size", str(cfg.block_size), "--anchors-per-doc", str(cfg.anchors_per_doc),
        "--lr", str(cfg.lr), "--seed", str(seed), "--tiny-vocab", "512",
        "--num-eval-prompts", "0", "--no-progress", "--resume",
    ]  # fmt: skip
    for pair in SPECS[spec]:
        cmd += ["--spec", pair.format(buckets=cfg.buckets)]
    return cmd


def _check_out_dir(cfg: ExperimentConfig) -> None:
    """Refuse to mix runs made with other settings into one OUT_DIR."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / "experiment.json"
    fixed = cfg.fixed_part()
    if path.is_file():
        old = json.loads(path.read_text())
        if old != fixed:
            diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != fixed.get(k))
            raise ValueError(
                f"{cfg.out_dir} holds an experiment with other settings ({', '.join(diff)}); "
                "choose a new OUT_DIR or repeat the same settings"
            )
    else:
        path.write_text(json.dumps(fixed, indent=2) + "\n")


def write_corpora(cfg: ExperimentConfig) -> tuple[Path, Path]:
    """The training and held-out corpora (written once; deterministic from the settings)."""
    from loader_server.data.synth import write_corpus

    paths = cfg.out_dir / "train.arrow", cfg.out_dir / "heldout.arrow"
    for path, heldout in zip(paths, (False, True), strict=True):
        if not path.is_file():
            write_corpus(path, cfg.synth(heldout=heldout))
    return paths


@contextmanager
def loader_daemon(dataset: Path, endpoint: str, log_path: Path) -> Iterator[DaemonProcess]:
    """A real ``loader_server serve`` subprocess, ready when this yields; SIGTERM (then
    SIGKILL) on exit."""
    from scripts.daemon_process import DaemonProcess

    log_path.parent.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(dataset, endpoint, log_path=log_path, ready_timeout_s=READY_TIMEOUT_S)
    try:
        yield daemon
    finally:
        daemon.stop(timeout_s=STOP_TIMEOUT_S)


def run_finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "summary.json"
    return path.is_file() and json.loads(path.read_text()).get("steps") == steps


def train_run(cfg: ExperimentConfig, spec: str, seed: int) -> float | None:
    """Train one (spec, seed) run to completion; returns its seconds, or None when the run
    had finished earlier and is reused."""
    name = cfg.run_name(spec, seed)
    run_dir = cfg.out_dir / "runs" / name
    if run_finished(run_dir, cfg.steps):
        log.info("%s: finished earlier, reused", name)
        return None
    log_path = cfg.out_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    log.info("%s: training %d steps (log %s)", name, cfg.steps, log_path)
    with open(log_path, "ab") as out:
        res = subprocess.run(
            train_command(cfg, spec, seed),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=120 + 20 * cfg.steps,
        )
    if res.returncode != 0 or not run_finished(run_dir, cfg.steps):
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run {name} failed (exit {res.returncode}); log tail:\n{tail}")
    seconds = time.perf_counter() - t0
    log.info("%s: done in %.0f s", name, seconds)
    return seconds


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Everything: corpora, daemon, runs, analysis, ``results.json``/``.md`` and plots."""
    from benchmarks.experiment.analysis import analyse
    from benchmarks.experiment.report import write_report

    t0 = time.perf_counter()
    _check_out_dir(cfg)
    train_path, heldout_path = write_corpora(cfg)
    train_s: dict[str, float | None] = {}
    with loader_daemon(train_path, cfg.endpoint, cfg.out_dir / "logs" / "daemon.log"):
        for seed in cfg.seeds:
            for spec in cfg.specs:
                train_s[cfg.run_name(spec, seed)] = train_run(cfg, spec, seed)
    results = analyse(cfg, train_path, heldout_path)
    results["train_s"] = {k: v for k, v in train_s.items() if v is not None}
    results["reused_runs"] = [k for k, v in train_s.items() if v is None]
    results["elapsed_s"] = time.perf_counter() - t0
    results["files"] = [str(p) for p in write_report(results, cfg.out_dir)]
    (cfg.out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
