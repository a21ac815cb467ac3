"""``dflash-train eval``'s work: drafters x sets x thinking modes, through our batched verifier
and (``engine="vllm"``) through vLLM serving the same target and drafter.

A drafter is an export folder of either dialect (``trainer.hf.folder``) or a run folder (its
newest complete checkpoint). The target is loaded once; each drafter reads the target layers
it was trained on. Every prompt is rendered with the target's chat template
(``trainer.eval.sets``); a set's later turns follow the target's own replies to the earlier
ones (at temperature 0 those are the same through either engine). Prompts whose tokens and
``max_new_tokens`` do not fit the target's positions are skipped, and counted.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.eval.sets import PromptSet, conversation, render
from trainer.eval.tau_counting import Protocols, summarize
from trainer.model.drafter import DFlashDrafter
from trainer.model.speculate import BatchedVerifier, Sampling
from trainer.model.target import Target, load_target
from trainer.model.verifier import SpecResult, eos_ids

log = logging.getLogger(__name__)

ENGINES = ("ours", "vllm", "both")


@dataclass(frozen=True)
class EvalSettings:
    """What every measurement of one ``eval`` run shares (the table states them)."""

    max_new_tokens: int = 2048
    sampling: Sampling = field(default_factory=Sampling)
    thinking: tuple[bool, ...] = (False,)
    batch_size: int = 16  # prompts per verification forward
    engine: str = "ours"
    vllm_python: Path | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine != "ours" and self.vllm_python is None:
            raise ValueError(f"--engine {self.engine} needs --vllm-python (vLLM's interpreter)")

    def to_json(self) -> dict[str, Any]:
        s = self.sampling
        return {
            "max_new_tokens": self.max_new_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed, "batch_size": self.batch_size,
            "engine": self.engine,
        }  # fmt: skip


@dataclass
class LoadedDrafter:
    """A drafter ready to evaluate: its label, where it came from, the target view it drafts
    for (its layers), and an export folder for an engine (made for a run folder)."""

    label: str
    source: Path
    drafter: DFlashDrafter
    target: Target
    export: Path | None

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size


@dataclass
class Measurement:
    """One drafter on one set in one thinking mode, by one engine."""

    drafter: str
    set: str
    thinking: bool
    engine: str
    prompts: int
    skipped: int
    block_size: int
    seconds: float
    stats: Protocols | None = None  # ours
    engine_tau: float | None = None  # vLLM's 1 + accepted / drafts
    engine_position_rates: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "stats"}
        out["stats"] = None if self.stats is None else self.stats.to_json()
        return out


def drafter_labels(paths: Sequence[Path]) -> list[str]:
    """A row label per drafter, unique: the folder names when they differ, else each path
    relative to the folders' common parent (``runs/A/drafter`` and ``runs/B/drafter``:
    ``A/drafter``, ``B/drafter``). ValueError for the same folder given twice."""
    resolved = [p.resolve() for p in paths]
    seen: dict[Path, Path] = {}
    for given, real in zip(paths, resolved, strict=True):
        if real in seen:
            raise ValueError(
                f"drafter {given} is given twice (also as {seen[real]}): each drafter is one "
                "row, measured once"
            )
        seen[real] = given
    names = [p.name for p in resolved]
    if len(set(names)) == len(names):
        return names
    parent = Path(os.path.commonpath([str(p) for p in resolved]))
    return [str(p.relative_to(parent)) for p in resolved]


def nothing_measured(ms: Sequence[Measurement], max_new_tokens: int) -> str | None:
    """Why an evaluation measured no prompt at all (None when it measured some)."""
    if any(m.prompts for m in ms):
        return None
    skipped = sum(m.skipped for m in ms)
    if skipped:
        return (
            f"no prompt was measured: all {skipped} were longer than the target's positions "
            f"allow with --max-new-tokens {max_new_tokens} and a block of "
            f"{max(m.block_size for m in ms)}; lower --max-new-tokens"
        )
    return "no prompt was measured: the sets hold none (--sets, --limit)"


def load_drafter(path: Path, base: Target, *, label: str | None = None) -> LoadedDrafter:
    """An export folder (either dialect) or a run folder's newest checkpoint, on ``base``'s
    model with the drafter's own target layers."""
    from trainer.hf.export import read_trained_drafter
    from trainer.hf.folder import config_from_folder, init_drafter, read_drafter_folder

    label = label or path.name
    if _is_run_folder(path):
        try:
            src = read_trained_drafter(path)
        except FileNotFoundError:  # no checkpoint at all
            raise ValueError(
                f"{path}: a training run with no checkpoint yet (stopped before its first): "
                "nothing to evaluate; resume it, or give an export folder"
            ) from None
        target = Target(base.model, src.layer_ids)
        drafter = DFlashDrafter(src.config)
        drafter.load_state_dict(src.weights)
        return LoadedDrafter(f"{label}@{src.step}", path, _on(drafter, base), target, None)
    folder = read_drafter_folder(path)
    target = Target(base.model, folder.target_layer_ids)
    drafter = DFlashDrafter(config_from_folder(folder, target))
    init_drafter(drafter, folder, target)
    return LoadedDrafter(label, path, _on(drafter, base), target, path)


def _is_run_folder(path: Path) -> bool:
    """A ``dflash-train train`` run folder (checkpoints, metrics or the spec it was served),
    not a drafter folder."""
    return any((path / name).exists() for name in ("checkpoints", "metrics.jsonl",
                                                   "loader_spec.json"))  # fmt: skip


def _on(drafter: DFlashDrafter, base: Target) -> DFlashDrafter:
    """The drafter in eval mode on the target's device, in its dtype."""
    weight = base.embed_tokens.weight
    return drafter.to(weight.device, weight.dtype).eval()


def load_base_target(
    path: Path, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[Target, Any, tuple[int, ...]]:
    """The target model (on ``device`` in ``dtype``), its tokenizer (with a chat template)
    and its EOS ids."""
    from transformers import AutoTokenizer, GenerationConfig

    target = load_target(str(path), device=device, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the target's tokenizer has no chat template to render with")
    eos = eos_ids(target.config)
    if (path / "generation_config.json").is_file():
        eos += eos_ids(GenerationConfig.from_pretrained(path))
    return target, tok, tuple(dict.fromkeys(eos))


#: ``generate(prompt ids, keys) -> outputs``: one turn of a set through one engine.
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]


def run_turns(
    pset: PromptSet, tokenizer: Any, thinking: bool, generate: Generate, max_prompt: int
) -> tuple[int, int]:
    """Every turn of every prompt of ``pset`` through ``generate``, later turns after the
    earlier replies; returns (prompts measured, prompts skipped as too long)."""
    replies: list[list[str]] = [[] for _ in pset.prompts]
    alive = list(range(len(pset.prompts)))
    skipped = 0
    turn = 0
    while alive:
        todo, ids = [], []
        for i in alive:
            p = pset.prompts[i]
            if len(p.turns) <= turn:
                continue
            tokens = render(tokenizer, conversation(p, turn, replies[i]), thinking=thinking)
            if len(tokens) > max_prompt:
                skipped += 1
                continue
            todo.append(i)
            ids.append(tokens)
        for i, out in zip(todo, generate(ids, [8 * i + turn for i in todo]), strict=True):
            replies[i].append(tokenizer.decode(out, skip_special_tokens=True))
        alive = todo
        turn += 1
    measured = sum(1 for r in replies if r)
    return measured, skipped


def ours(
    d: LoadedDrafter, settings: EvalSettings, eos: Sequence[int], sink: list[SpecResult]
) -> Generate:
    """Our batched verifier as a ``Generate``: prompts sorted by length into batches of
    ``batch_size``; every result is appended to ``sink``."""
    verifier = BatchedVerifier(d.target, d.drafter, max_new_tokens=settings.max_new_tokens,
                               eos_token_ids=eos, sampling=settings.sampling)  # fmt: skip

    def generate(ids: list[list[int]], keys: list[int]) -> list[list[int]]:
        order = sorted(range(len(ids)), key=lambda k: len(ids[k]))
        out: dict[int, SpecResult] = {}
        for lo in range(0, len(order), settings.batch_size):
            chunk = order[lo : lo + settings.batch_size]
            results = verifier.generate([torch.tensor(ids[k]) for k in chunk],
                                        keys=[keys[k] for k in chunk])  # fmt: skip
            out.update(zip(chunk, results, strict=True))
        sink.extend(out[k] for k in range(len(ids)))
        return [out[k].tokens.tolist() for k in range(len(ids))]

    return generate


def evaluate(
    drafters: Sequence[LoadedDrafter], sets: Sequence[PromptSet], tokenizer: Any,
    eos: Sequence[int], settings: EvalSettings, work: Path,
    progress: Callable[[str], None] = print, target_dir: Path | None = None,
    logs: Path | None = None,
) -> list[Measurement]:  # fmt: skip
    """Every drafter on every set in every thinking mode, by the engines asked for
    (``target_dir``: the target's folder, which an engine serves; ``logs``: where its
    server logs go, kept whatever happens; default ``work``)."""
    run = _Run(sets, tokenizer, tuple(eos), settings, progress)
    out: list[Measurement] = []
    for d in drafters:
        if settings.engine in ("ours", "both"):
            out.extend(run.ours(d, m) for m in run.cells(d, "ours"))
        if settings.engine in ("vllm", "both"):
            if target_dir is None:
                raise ValueError("an engine serves the target's folder: give target_dir")
            out.extend(run.engine_cells(d, work, target_dir, logs or work))
    return out


@dataclass(frozen=True)
class _Run:
    """What every measurement of an ``evaluate`` call shares."""

    sets: Sequence[PromptSet]
    tokenizer: Any
    eos: tuple[int, ...]
    settings: EvalSettings
    progress: Callable[[str], None]

    def cells(self, d: LoadedDrafter, engine: str) -> Iterator[Measurement]:
        for s in self.sets:
            for thinking in self.settings.thinking:
                yield Measurement(d.label, s.name, thinking, engine, 0, 0, d.block_size, 0.0)

    def ours(self, d: LoadedDrafter, m: Measurement) -> Measurement:
        """``m`` through our batched verifier: every protocol."""
        results: list[SpecResult] = []

        def finish(m: Measurement) -> None:
            m.stats = summarize(results, d.block_size, seed=self.settings.sampling.seed)

        return self._measure(d, m, ours(d, self.settings, self.eos, results), finish)

    def engine_cells(
        self, d: LoadedDrafter, work: Path, target_dir: Path, logs: Path
    ) -> list[Measurement]:
        """Every cell of ``d`` through one vLLM server of its own."""
        from trainer.eval.engine import VllmEngine

        settings = self.settings
        assert settings.vllm_python is not None
        with ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=work)))
            engine = stack.enter_context(VllmEngine(
                target=target_dir, drafter=d.export or _export_run(d, tmp),
                vllm_python=settings.vllm_python, num_speculative_tokens=d.block_size - 1,
                max_model_len=_max_positions(d.target), log=logs / f"vllm-{d.label}.log",
            ))  # fmt: skip
            return [self._engine_cell(engine, d, m) for m in self.cells(d, "vllm")]

    def _engine_cell(self, engine: Any, d: LoadedDrafter, m: Measurement) -> Measurement:
        """``m`` through vLLM: its served tau and slot rates, off its counters."""
        s, before = self.settings.sampling, engine.counters()

        def gen(ids: list[list[int]], keys: list[int]) -> list[list[int]]:
            # No per-request seed: vLLM's output with a DFlash drafter does not repeat by
            # seed anyway (docs/SERVING.md), and its CPU build fails a seeded request whose
            # prefill is chunked ("CPU Generator does not use offset"); its server is
            # seeded once.
            return list(engine.generate(
                ids, max_new_tokens=self.settings.max_new_tokens, temperature=s.temperature,
                top_p=s.top_p, top_k=s.top_k or -1, seed=None, stop_token_ids=list(self.eos),
            ))  # fmt: skip

        def finish(m: Measurement) -> None:
            delta = engine.counters().minus(before)
            m.engine_tau, m.engine_position_rates = delta.tau, tuple(delta.position_rates())

        return self._measure(d, m, gen, finish)

    def _measure(
        self, d: LoadedDrafter, m: Measurement, gen: Generate,
        finish: Callable[[Measurement], None],
    ) -> Measurement:  # fmt: skip
        """Every turn of ``m``'s set through ``gen``, then ``finish`` fills in the figures."""
        pset = next(s for s in self.sets if s.name == m.set)
        max_prompt = _max_positions(d.target) - self.settings.max_new_tokens - d.block_size
        t0 = time.perf_counter()
        m.prompts, m.skipped = run_turns(pset, self.tokenizer, m.thinking, gen, max_prompt)
        m.seconds = time.perf_counter() - t0
        if m.skipped:
            log.warning("%s: %d prompts skipped (longer than the target's positions allow)",
                        m.set, m.skipped)  # fmt: skip
        if m.prompts:
            finish(m)
        self.progress(_line(m))
        return m


def _line(m: Measurement) -> str:
    mode = "thinking" if m.thinking else "no thinking"
    head = f"{m.drafter} on {m.set} ({mode}, {m.engine}): {m.prompts} prompts"
    if m.stats is not None:
        s = m.stats
        lo, hi = s.tau_ci
        body = (f"tau {s.tau:.3f} [{lo:.3f}, {hi:.3f}], pooled {s.tau_pooled:.3f}, "
                f"served {s.tau_served:.3f}")  # fmt: skip
    elif m.engine_tau is not None:
        body = f"vLLM tau {m.engine_tau:.3f}"
    else:
        body = "nothing measured"
    return f"{head}; {body} ({m.seconds:.1f} s)"


def _export_run(d: LoadedDrafter, tmp: Path) -> Path:
    """A run folder's checkpoint exported for an engine to serve."""
    from trainer.hf.export import export_drafter

    return export_drafter(d.source, tmp / "drafter", dtype="fp32")


def _max_positions(target: Target) -> int:
    return int(getattr(target.config, "max_position_embeddings", 1 << 30))
