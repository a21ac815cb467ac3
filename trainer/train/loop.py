"""The training loop: one process per rank, micro-batches from the loader, exact resume.

Each optimizer step consumes ``grad_accum`` micro-batches whose ``micro`` index runs
0..grad_accum-1 for the same ``(epoch, step)``; the trainer checks that instead of counting
on its own, because mixing micro-step and optimizer-step counters is the classic resume
bug. Gradients are all-reduced only on the last micro-batch (``no_sync`` before it). After
the optimizer step the loader client's position is exactly "the next step's micro 0", which
is what a checkpoint stores; anchors are drawn from a generator keyed on
``(seed, rank, epoch, step, micro)``, so a resumed run repeats the uninterrupted one.

Timing: ``data_wait`` is the time blocked in ``next(loader)``; step time runs from the first
``next`` to the end of the optimizer step and excludes evaluation and checkpointing, which
are reported separately.

What stops a run (each a ``TrainingError``, one line for the user): ``max_nonfinite_steps``
steps in a row whose loss or gradients were NaN/inf on some rank (each such step is
skipped: no optimizer update; the decision is all-reduced, so every rank skips it);
``max_empty_steps`` steps in a row in which no rank trained a block (the spec leaves no
document a block); a loader that stays away past its timeout or refuses the session (a
final checkpoint of the last completed step is written first); and a write into the run
folder that fails (no space, read-only). ``--resume`` verifies checkpoints and falls back
to the newest complete one (``trainer.train.checkpoint``) and refuses another target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from loader_server.planning.cost import ANCHOR_RULE
from loader_server.wire.protocol import (
    LoaderError,
    LoaderRequestError,
    LoaderUnavailableError,
    ProtocolError,
)
from trainer.model.attention import BACKENDS, resolve_backend
from trainer.model.blocks import LossConfig, anchor_generator
from trainer.model.docs import DocView
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.loss import DEFAULT_CHUNK_SIZE, draft_loss, zero_loss
from trainer.model.phases import phase
from trainer.model.target import Target
from trainer.model.verifier import DrafterProposer, TauReport, eos_ids, evaluate_tau
from trainer.progress import progress_bar
from trainer.train import checkpoint as ckpt
from trainer.train import hostmem, profile, stop
from trainer.train.batches import Batch, BatchSource
from trainer.train.costlog import CostLog
from trainer.train.distributed import DistEnv, all_reduce
from trainer.train.guards import (
    WRITE_ERRNOS,
    LoaderFailedError,
    ServedSpecError,
    Stopper,
    TrainingError,
    check_target,
)
from trainer.train.metrics import MetricsWriter, metrics_path, read_metrics, summarize
from trainer.train.step import StepPeaks, StepResult, StepSums

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel
    from tqdm import tqdm

log = logging.getLogger(__name__)

# Drafter config fields newer than some checkpoints, with the value those checkpoints mean
# (every field added since the first has a default: no sliding layers, DFlash v1).
_DRAFTER_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(DrafterConfig) if f.default is not MISSING
}
#: The spec fields of a job's shape: a checkpoint resumes under another (the rest of the
#: epoch is planned for it, ``loader_server.planning.elastic``).
SHAPE = ("world_size", "grad_accum")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What the loop does. ``steps`` or ``epochs`` (times the loader's steps per epoch) sets
    the length; ``warmup`` < 1 is a fraction of it, >= 1 a number of steps."""

    run_dir: Path
    loss: LossConfig = field(default_factory=LossConfig)
    steps: int | None = None
    epochs: int | None = None
    grad_accum: int | None = None  # None: the loader's spec decides
    loss_chunk: int = DEFAULT_CHUNK_SIZE  # supervised slots per LM-head chunk (0: unchunked)
    attention: str = "auto"  # drafter attention kernel (trainer.model.attention)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0  # 0: only before the first and after the last step
    eval_new_tokens: int = 64
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3
    resume: bool = False
    progress: bool = True
    cost_samples: int = 2000  # micro-batches per rank timed for calibration (trainer.train.costlog)
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row (0: never)
    max_empty_steps: int = 10  # stop after this many steps in a row without a block (0: never)
    profile_step: int = 0  # profile this step (trainer.train.profile; 0: off)
    peak_tflops: float | None = None  # the chip's bf16 peak for MFU (None: by device name)

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of --steps and --epochs")
        for name in ("steps", "epochs"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name} must be >= 1, got {v}")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 (0: unchunked), got {self.loss_chunk}")
        if self.attention not in BACKENDS:
            raise ValueError(f"attention must be one of {BACKENDS}, got {self.attention!r}")
        if not (self.lr > 0 and self.warmup >= 0 and self.grad_clip > 0):
            raise ValueError(f"bad lr/warmup/grad_clip: {self.lr}, {self.warmup}, {self.grad_clip}")
        if self.cost_samples < 0:
            raise ValueError(f"cost_samples must be >= 0 (0: off), got {self.cost_samples}")
        if self.eval_every < 0 or self.ckpt_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("eval_every and ckpt_every must be >= 0, keep_checkpoints >= 1")
        if self.max_nonfinite_steps < 0 or self.max_empty_steps < 0:
            raise ValueError("max_nonfinite_steps and max_empty_steps must be >= 0 (0: never stop)")

    def total_steps(self, steps_per_epoch: int | None) -> int:
        if self.steps is not None:
            return self.steps
        if not steps_per_epoch:
            raise ValueError("--epochs needs the loader's steps per epoch, which it did not report")
        if self.epochs is None:  # __post_init__: exactly one of steps and epochs
            raise ValueError("give exactly one of steps and epochs")
        return self.epochs * steps_per_epoch

    def warmup_steps(self, total: int) -> int:
        return round(self.warmup * total) if self.warmup < 1 else int(self.warmup)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.0) -> Callable[[float], float]:
    """LR multiplier: linear ramp over ``warmup`` steps, then cosine down to ``min_ratio``
    (``step`` may be fractional: ``Clock.steps``)."""

    def factor(step: float) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class _LoaderDone(Exception):
    """The loader had no batch for the next step (it serves a fixed number of epochs)."""


@dataclass
class Clock:
    """How far training is, for the LR schedule and the end of a run: micro-batches consumed
    over all ranks (``micro``), in steps of the shape the run started with (``unit``
    micro-batches each: world size x grad_accum). A run that keeps its shape has
    ``steps == step``, so its schedule is the plain step schedule; one resumed on other
    ranks continues from the data consumed (each micro-batch is one token budget), so its
    LR does not jump. ``steps_per_epoch`` is the first shape's, which turns ``--epochs``
    into steps."""

    micro: int = 0
    unit: int = 1
    steps_per_epoch: int = 0

    @property
    def steps(self) -> float:
        return self.micro / self.unit

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Clock:
        clock = cls(**{k: int(d[k]) for k in ("micro", "unit", "steps_per_epoch")})
        if clock.micro < 0 or clock.unit < 1 or clock.steps_per_epoch < 0:
            raise ValueError(f"bad LR clock in the checkpoint: {d}")
        return clock


class Trainer:
    """Owns the optimizer, the loop, evaluation, metrics and checkpoints of one rank."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        target: Target,
        drafter: DFlashDrafter,
        source: BatchSource,
        env: DistEnv,
        eval_prompts: Sequence[torch.Tensor] = (),
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.env = cfg, env
        self.target, self.drafter, self.source = target, drafter, source
        self.eval_prompts = list(eval_prompts)[env.rank :: env.world_size]
        self.meta = dict(meta or {})
        self.model = self._wrap(drafter)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        # Known only once the loader has answered (steps per epoch) with --epochs: see run().
        self.total_steps: int | None = cfg.steps
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._scheduler_state: dict[str, Any] | None = None
        self.clock = Clock(unit=env.world_size * (cfg.grad_accum or 1))  # set in _start()
        self.total_micro: int | None = None  # the run's end on the clock (set in _start())
        # The resumed checkpoint's clock, or what rebuilds one (its world size and spec's
        # grad_accum) for a checkpoint written before clocks; None for a fresh run.
        self._saved_clock: tuple[dict[str, Any] | None, int, int] | None = None
        self._pending: tuple[Batch, float] | None = None  # the batch peeked by run()
        self.step = 0
        self.epoch = 0
        self.metrics = MetricsWriter(metrics_path(cfg.run_dir), enabled=env.is_main)
        rule = (cfg.loss.block_size, cfg.loss.anchors_per_doc, cfg.loss.max_anchors)
        self.costs = CostLog(cfg.run_dir, env.rank, cfg.cost_samples, rule, env.device)
        self.attention = resolve_backend(cfg.attention, env.device)
        generation = getattr(target.model, "generation_config", None)
        self._eos = tuple(dict.fromkeys(eos_ids(target.config) + eos_ids(generation)))
        self._checkpoint_spec: dict[str, Any] | None = None  # the spec a resumed run had
        # Known once the loader has answered (its spec decides when the user did not).
        self.grad_accum = cfg.grad_accum or 1
        self.stopper = Stopper(
            max_nonfinite_steps=cfg.max_nonfinite_steps, max_empty_steps=cfg.max_empty_steps,
            lr=cfg.lr, block_size=cfg.loss.block_size,
        )  # fmt: skip
        # Where the step that failed began (loader state, RNG): a final checkpoint after a
        # loader failure in the middle of a step must hold the position before that step.
        self._step_start: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._last_batch = (0, 0, 0)  # (epoch, step, steps in its epoch) last trained
        self._work = profile.StepWork([], 0, 0)  # this step's documents and anchors
        self._profiling = False  # the step runs under torch.profiler (--profile-step)

    def _fit_host_memory(self, num_chunks: int) -> None:
        """On CPU the allocator follows the drafter's chunk count (``trainer.train.hostmem``)."""
        if self.env.device.type == "cpu":
            hostmem.fit_chunks(num_chunks)

    def _autocast(self) -> torch.autocast:
        """bf16 autocast on CUDA; a no-op context on CPU."""
        return torch.autocast("cuda", torch.bfloat16, enabled=self.env.device.type == "cuda")

    def _wrap(self, drafter: DFlashDrafter) -> torch.nn.Module:
        if not self.env.distributed:
            return drafter
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DDP(drafter, device_ids=ids)

    # ---- checkpoints -------------------------------------------------------------------

    def save(self, position: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
        """Checkpoint the last completed step; ``position`` (loader state, RNG states)
        replaces the live ones when the loader has moved into a step that did not finish."""
        if self.scheduler is None:
            raise RuntimeError("save() before the LR schedule exists (see run())")
        record = ckpt.CheckpointRecord(
            step=self.step,
            epoch=self.epoch,
            drafter=self.drafter.state_dict(),
            drafter_config=self.drafter.config.to_dict(),
            loss_config=asdict(self.cfg.loss),
            meta=self.meta,
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            clock=self.clock.to_dict(),
        )
        loader, rng = position or (self.source.state_dict(), ckpt.rng_state())
        per_rank = {"loader": loader, "rng": rng}
        return ckpt.save_checkpoint(
            self.cfg.run_dir,
            self.step,
            self.env,
            record=record,
            per_rank=per_rank,
            keep=self.cfg.keep_checkpoints,
        )

    def maybe_resume(self) -> bool:
        """Load the newest complete checkpoint of the run if ``resume`` is set and one
        exists (torn ones are skipped, and said so)."""
        found = ckpt.list_checkpoints(self.cfg.run_dir) if self.cfg.resume else []
        if not found:
            if self.cfg.resume:
                log.info("no checkpoint in %s: starting fresh", self.cfg.run_dir)
            return False
        path, saved, mine = self._newest_complete(found)
        current = self.drafter.config.to_dict()
        # Fields a checkpoint predates have their defaults (no sliding layers).
        theirs = {**_DRAFTER_DEFAULTS, **saved.drafter_config}
        if theirs["layer_types"] is not None:
            theirs["layer_types"] = tuple(theirs["layer_types"])
        differ = sorted(k for k in {*current, *theirs} if current.get(k) != theirs.get(k))
        if differ:
            raise ValueError(
                f"{path}: drafter config differs from this run's in "
                + ", ".join(f"{k} ({theirs.get(k)!r} vs {current.get(k)!r})" for k in differ)
            )
        if saved.loss_config != asdict(self.cfg.loss):
            raise ValueError(f"{path}: loss config {saved.loss_config} differs from this run's")
        check_target(path, saved.meta, self.meta)
        self.drafter.load_state_dict(saved.drafter)
        if saved.optimizer is None or saved.scheduler is None:
            raise ValueError(f"{path}: the checkpoint holds no optimizer or scheduler state")
        self.optimizer.load_state_dict(saved.optimizer)
        self._scheduler_state = saved.scheduler
        self.step, self.epoch = saved.step, saved.epoch
        spec_ga = (saved.meta.get("loader_spec") or {}).get("grad_accum", self.grad_accum)
        self._saved_clock = (saved.clock, saved.world_size, int(spec_ga))
        self._checkpoint_spec = saved.meta.get("loader_spec")
        self._ask_saved_anchor_rule()
        self.source.load_state_dict(mine["loader"])
        if mine["rng"] is not None:
            ckpt.set_rng_state(mine["rng"])
        else:  # a rank the checkpoint did not have: seeded from the run, never at random
            ckpt.seed_rng(self.cfg.seed, self.env.rank, self.step)
        self.metrics.truncate_after(self.step)
        log.info("rank %d resumed from %s at step %d", self.env.rank, path, self.step)
        return True

    def _ask_saved_anchor_rule(self) -> None:
        """Checkpoints from before the trainer sent its anchor rule recorded the daemon's
        (16, 512, 2048). Without a slot cost (``cost_slot`` 0) those fields do not enter
        the plan: ask for the saved ones, so the saved position resumes in the same plan."""
        saved = self._checkpoint_spec or {}
        asked = getattr(self.source, "spec", None)
        if not isinstance(asked, dict) or saved.get("cost_slot"):
            return
        old = {k: saved[k] for k in ANCHOR_RULE if k in saved and asked.get(k) != saved[k]}
        if old:
            log.warning(
                "the checkpoint's loader spec records anchor rule %s (saved before the trainer "
                "sent its own); with no slot cost it does not change the plan, so it is kept "
                "for this run", old,
            )  # fmt: skip
            self.source.spec = {**asked, **old}  # type: ignore[attr-defined]

    def _newest_complete(
        self, found: Sequence[Path]
    ) -> tuple[Path, ckpt.CheckpointRecord, dict[str, Any]]:
        """The newest checkpoint every rank verified and loaded; torn ones are skipped with
        a warning. Rank 0 checks the digests, the others the sizes; the ranks agree on
        each candidate (one all-reduce), so all resume from the same one."""
        skipped: list[str] = []
        for path in reversed(found):
            why, loaded, fatal = None, None, None
            try:
                ckpt.verify_checkpoint(path, digests=self.env.is_main)
                loaded = ckpt.load_checkpoint(path, self.env)
            except ckpt.TornCheckpointError as e:
                why = str(e)
            except ValueError as e:  # not torn but refused (world size, version): stop
                fatal = e
            code = 2.0 if fatal is not None else 0.0 if why is None else 1.0
            agreed = all_reduce(torch.tensor([code], device=self.env.device), self.env, op="max")
            if agreed.item() == 2:
                raise fatal or TrainingError(f"{path}: another rank refused this checkpoint")
            if agreed.item() == 0 and loaded is not None:
                if skipped:
                    log.warning(
                        "rank %d: resuming from %s, the newest complete checkpoint (skipped: %s)",
                        self.env.rank, path.name, "; ".join(skipped),
                    )  # fmt: skip
                return path, *loaded
            why = why or "another rank could not read its part"
            log.warning("rank %d: skipping checkpoint %s: %s", self.env.rank, path, why)
            skipped.append(f"{path.name}: {why}")
        raise ckpt.TornCheckpointError(
            f"--resume: no complete checkpoint in {ckpt.checkpoint_dir(self.cfg.run_dir)} "
            f"({'; '.join(skipped)}); start a new --run-dir"
        )

    # ---- evaluation --------------------------------------------------------------------

    def evaluate(self) -> dict[str, float] | None:
        """tau over this rank's share of the held-out prompts, combined over ranks: ``tau``
        (mean over prompts of each prompt's committed tokens per step, as published) and
        ``tau_pooled`` (committed tokens over all steps)."""
        if not self.eval_prompts and not self.env.distributed:
            return None
        proposer = DrafterProposer(self.target, self.drafter)
        with torch.no_grad(), self._autocast():
            rep = evaluate_tau(
                self.target,
                proposer,
                self.eval_prompts,
                block_size=self.cfg.loss.block_size,
                max_new_tokens=self.cfg.eval_new_tokens,
                eos_token_ids=self._eos,
            )
        t = torch.tensor(rep.sums(), dtype=torch.float64, device=self.env.device)
        total = TauReport.from_sums(all_reduce(t, self.env).tolist())
        if total.steps <= 0 or total.prompts <= 0:
            return None
        return total.metrics()

    # ---- training ----------------------------------------------------------------------

    def _micro_batches(self, it: Iterator[Batch]) -> Iterator[tuple[Batch, float]]:
        """The step's micro-batches with the time spent waiting for each."""
        first = None
        for m in range(self.grad_accum):
            if self._pending is not None:
                (batch, waited), self._pending = self._pending, None
            else:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    if m == 0:
                        raise _LoaderDone from None
                    raise ServedSpecError(
                        f"the loader ended inside a step, after {m} of its {self.grad_accum} "
                        "micro-batches"
                    ) from None
                waited = time.perf_counter() - t0
            if batch.micro != m:
                raise ServedSpecError(
                    f"loader served micro {batch.micro} of step {batch.step}, trainer expected "
                    f"micro {m}: --grad-accum must match the loader spec's grad_accum"
                )
            if first is None:
                first = (batch.epoch, batch.step)
            elif (batch.epoch, batch.step) != first:
                raise ServedSpecError(
                    f"micro-batches of one step span {first} and {batch.epoch, batch.step}"
                )
            yield batch, waited

    def train_step(self, it: Iterator[Batch]) -> StepResult:
        """One optimizer step; returns this rank's sums."""
        cfg, b = self.cfg, self.cfg.loss.block_size
        dev = self.env.device
        t_start = time.perf_counter() - (self._pending[1] if self._pending else 0.0)
        wait = 0.0
        sums = StepSums.zeros(b - 1, dev)
        epoch_before = self.epoch
        # With several micro-batches the loader can fail after the first: keep where the
        # step began (the first step of a run saves nothing: its batch was peeked).
        start = None
        if self.grad_accum > 1 and self._pending is None:
            start = (self.source.state_dict(), ckpt.rng_state())
        self._step_start = None
        try:
            for batch, waited in self._micro_batches(it):
                self._micro_step(batch, sums)
                wait += waited
        except LoaderError:
            self.epoch, self._step_start = epoch_before, start
            raise
        if self.scheduler is None:
            raise RuntimeError("train_step() before the LR schedule exists (see run())")
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            lr = cast(float, self.scheduler.get_last_lr()[0])  # the float cfg.lr, scheduled
            finite = self._all_finite(grad_norm, sums.ce)
            if finite:
                self.optimizer.step()
            self.clock.micro += self.env.world_size * self.grad_accum
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.costs.end_step()
        step_time = time.perf_counter() - t_start
        sums.step_time += step_time
        sums.wait += wait
        sums.wait_frac += wait / max(step_time, 1e-9)
        return StepResult(sums=sums, grad_norm=grad_norm, lr=lr, skipped=not finite)

    def _micro_step(self, batch: Batch, sums: StepSums) -> None:
        """Forward and backward of one micro-batch, its sums added to ``sums``."""
        cfg, dev = self.cfg, self.env.device
        self.epoch = int(batch.epoch)
        self._last_batch = (int(batch.epoch), int(batch.step), int(batch.steps_per_epoch))
        self._check_vocabulary(batch)
        self.costs.start()
        # Used up before the next next(): the client reuses the slot after that.
        with phase("copy"):
            on_dev = batch.to(dev, non_blocking=True)
        gen = anchor_generator(
            cfg.seed, self.env.rank, batch.epoch, batch.step, batch.micro, batch.leg
        )
        last = batch.micro == self.grad_accum - 1
        sync = (
            contextlib.nullcontext()
            if last or not self.env.distributed
            else cast("DistributedDataParallel", self.model).no_sync()  # see _wrap
        )
        with sync:
            with self._autocast():
                out = draft_loss(
                    self.target,
                    self.model,
                    on_dev,
                    cfg.loss,
                    gen,
                    chunk_size=cfg.loss_chunk,
                    attention=self.attention,
                    host_batch=batch,  # valid until the next next(): anchors planned there
                    on_chunks=self._fit_host_memory,
                )
                loss = out.loss if out.loss is not None else zero_loss(self.target, self.model)
            with phase("backward"):
                (loss / self.grad_accum).backward()
        self.costs.stop(batch, anchors=out.num_blocks, synced=last and self.env.distributed)
        sums.add(out)
        if self._profiling:  # what the step's FLOP count needs (a host sync: only here)
            work = self._work
            work.doc_lengths += DocView.of(batch).length.tolist()
            work.anchors += out.num_blocks
            work.slots += int(out.count.sum().item())

    def _check_vocabulary(self, batch: Batch) -> None:
        """A corpus tokenized for another model has ids the target cannot embed: one line
        naming the batch, the id and the samples, not an IndexError deep in the forward."""
        ids = batch.input_ids
        top = int(ids.max()) if ids.numel() else 0
        vocab = self.target.vocab_size
        if top >= vocab or (ids.numel() and int(ids.min()) < 0):
            bad = (ids >= vocab) | (ids < 0)
            rows = batch.sample_ids[bad.any(dim=1)] if batch.layout == "padded" else None
            which = f"samples {rows[:5].tolist()}" if rows is not None else "this packed batch"
            raise TrainingError(
                f"epoch {batch.epoch} step {batch.step} micro {batch.micro}: token id "
                f"{top if top >= vocab else int(ids.min())} is outside the target's vocabulary "
                f"({vocab} ids; {which}): the corpus was tokenized for another model; "
                "tokenize it with the target's tokenizer, or train against the model it was "
                "tokenized for"
            )

    def _all_finite(self, grad_norm: torch.Tensor, ce: torch.Tensor) -> bool:
        """Whether every rank's loss and the (all-reduced, so common) gradient norm are
        finite: one decision for all ranks (a max all-reduce under DDP)."""
        bad = (~torch.isfinite(grad_norm)) | (~torch.isfinite(ce))
        flag = bad.to(torch.float64).reshape(1)
        return bool(all_reduce(flag, self.env, op="max").item() == 0)

    def _record(self, raw: StepResult) -> dict[str, Any]:
        """Combine the ranks' sums (one sum and one max all-reduce) into a metrics record."""
        mine, n, offsets = raw.sums, self.env.world_size, self.cfg.loss.block_size - 1
        total = StepSums.from_tensor(all_reduce(mine.to_tensor(), self.env).cpu(), offsets)
        peaks = StepPeaks(
            float(mine.step_time), float(mine.wait_frac), *_memory_peaks_gb(self.env.device)
        )
        mx = StepPeaks.from_tensor(all_reduce(peaks.to_tensor(self.env.device), self.env, op="max"))
        ce, weight = float(total.ce), float(total.weight)
        tokens, blocks = float(total.tokens), float(total.blocks)
        correct, count = total.correct, total.count
        loss, grad_norm = ce / weight if weight > 0 else None, float(raw.grad_norm)
        rec = {
            "step": self.step,
            "epoch": self.epoch,
            "loss": _finite_or_none(loss) if raw.skipped else loss,
            "acc": float(correct.sum() / count.sum()) if count.sum() > 0 else None,
            "acc_k": [round(float(c / max(k, 1)), 5) for c, k in zip(correct, count, strict=True)],
            "lr": raw.lr,
            "grad_norm": _finite_or_none(grad_norm) if raw.skipped else grad_norm,
            "tokens": int(tokens),
            "blocks": int(blocks),
            "anchors_per_micro": blocks / max(float(total.micro), 1),
            "anchors_capped": int(total.capped),
            "step_time_s": float(total.step_time / n),  # the mean over ranks
            "tokens_per_s": tokens / mx.step_time,
            "anchors_per_s": blocks / mx.step_time,
            "data_wait_s": float(total.wait / n),
            "data_wait_frac": float(total.wait_frac / n),
            "data_wait_frac_max": mx.wait_frac,
            "rss_peak_gb": round(mx.rss_gb, 3),  # max over ranks, since the process began
            "gpu_mem_peak_gb": round(mx.gpu_mem_gb, 3),  # max over ranks (0 on CPU)
            "time": time.time(),
        }
        if raw.skipped:  # only then: the records of a healthy run are unchanged
            rec["skipped_nonfinite"] = 1
        return rec

    def _eval_record(self, rec: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        taus = self.evaluate()
        if taus is not None:
            rec.update(taus, eval_s=time.perf_counter() - t0)

    def run(self) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming first if asked); returns the run summary."""
        cfg = self.cfg
        if not cfg.resume and ckpt.latest_checkpoint(cfg.run_dir) is not None:
            raise ValueError(
                f"{cfg.run_dir} already has checkpoints: pass --resume to continue that run, "
                "or choose a new --run-dir"
            )
        resumed = self.maybe_resume()
        if not resumed and self.env.is_main:
            self.metrics.truncate_after(-1)
        if not resumed:
            rec: dict[str, Any] = {"step": 0}
            self._eval_record(rec)
            self.metrics.write(rec)
        it = iter(self.source)
        try:
            started = self._start(it)
        except LoaderError as e:
            self.metrics.close()
            self.costs.close()
            raise self._loader_failed(e, None) from e
        if not started:
            return {"steps": self.step, "resumed": resumed, "note": "loader has no more batches"}
        total = self.total_micro
        if total is None:  # _start fixed it
            raise RuntimeError("the step count is unknown after the first batch")
        bar = self._progress()
        t_loop, first_step = time.perf_counter(), self.step
        saved_at, stopped, final, exhausted = first_step if resumed else None, False, False, False
        try:
            # --epochs: to the last step of the last epoch (the loader's end), wherever the
            # estimate put it; --steps: to the data of that many steps.
            while (cfg.epochs is not None or self.clock.micro < total) and not final:
                if stop.agreed(self.env):  # SIGTERM on any rank: all stop before this step
                    stopped = True
                    break
                try:
                    rec = self._record(self._train_or_profile(it))
                except _LoaderDone:  # the loader ended first (the step was not begun)
                    log.info("rank %d: the loader has no more batches", self.env.rank)
                    exhausted = True
                    break
                final = self._last_epoch_done() or (
                    cfg.epochs is None and self.clock.micro >= total
                )
                if final or (cfg.eval_every and self.step % cfg.eval_every == 0):
                    self._eval_record(rec)
                # The record goes out before the checkpoint: a kill in between replays the
                # step, and the resume cuts the file back to the checkpoint's step.
                self.metrics.write(rec)
                self.stopper.check(rec, self.step, self.meta.get("loader_spec") or {})
                if final or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                    t0 = time.perf_counter()
                    path = self.save()
                    saved_at = self.step
                    log.debug("checkpoint %s in %.3fs", path, time.perf_counter() - t0)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(_postfix(rec), refresh=False)
            # Before the first step of this run the loader has already handed out the
            # peeked batch, so there is nothing newer to save than what was resumed.
            if (stopped or exhausted) and self.step != first_step and saved_at != self.step:
                self.save()
            if stopped:
                log.info("rank %d: stopped at step %d on request", self.env.rank, self.step)
        except LoaderError as e:
            unsaved = self.step != first_step and saved_at != self.step
            raise self._loader_failed(e, unsaved) from e
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:
                raise
            where = f"into the run folder {cfg.run_dir}"
            msg = ckpt.write_error_message(e, where, None, path=cfg.run_dir)
            raise ckpt.RunWriteError(msg) from e
        finally:
            if bar is not None:
                bar.close()
            self.metrics.close()
            self.costs.close()
        wall = time.perf_counter() - t_loop
        summary = summarize(read_metrics(metrics_path(cfg.run_dir))) if self.env.is_main else {}
        summary.update(
            wall_steps_per_s=(self.step - first_step) / wall if wall > 0 else None,
            resumed=resumed,
            stopped=stopped,
        )
        if exhausted:
            summary["note"] = "the loader had no more batches"
        return summary

    def _train_or_profile(self, it: Iterator[Batch]) -> StepResult:
        """One step; the one ``--profile-step`` names under ``torch.profiler``, its phases,
        FLOPs and MFU written to ``RUN_DIR/profile.json`` (rank 0)."""
        self._work = profile.StepWork([], 0, 0)
        if self.step + 1 != self.cfg.profile_step:
            return self.train_step(it)
        cuda = self.env.device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.env.device)
        self._profiling = True
        try:
            with torch.profiler.profile(activities=acts) as prof:
                raw = self.train_step(it)
                if cuda:
                    torch.cuda.synchronize(self.env.device)
        finally:
            self._profiling = False
        if self.env.is_main:
            self._write_profile(prof, float(raw.sums.step_time))
        return raw

    def _write_profile(self, prof: Any, step_s: float) -> None:
        core = self.drafter
        dcfg = core.config
        drafter = profile.ModelShape(
            dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_heads * dcfg.head_dim,
            dcfg.num_kv_heads * dcfg.head_dim, dcfg.num_layers,
        )  # fmt: skip
        target = profile.ModelShape.of(self.target.config, max(self.target.layer_ids) + 1)
        flops = profile.step_flops(
            self._work, target, drafter, features=len(self.target.layer_ids),
            block=self.cfg.loss.block_size, vocab=self.target.vocab_size,
        )  # fmt: skip
        dev = self.env.device
        times = profile.phase_times(prof.key_averages(), dev.type == "cuda")
        peak = profile.peak_tflops(dev, self.cfg.peak_tflops)
        rec = profile.report(times, step_s, flops, peak, dev)
        rec.update(step=self.step, rank=self.env.rank, world_size=self.env.world_size)
        path = self.cfg.run_dir / "profile.json"
        profile.write(path, rec)
        log.info(
            "profiled step %d: %.3f s, %.1f TFLOP/s%s; %s", self.step, step_s,
            rec["tflops_per_s"], f", MFU {rec['mfu']:.1%}" if rec["mfu"] else "", path,
        )  # fmt: skip

    def _last_epoch_done(self) -> bool:
        """With ``--epochs E``: whether the step just trained was the last of epoch E-1.
        Epochs differ by a step or so (their plans are cut afresh), so E x the first
        epoch's steps only estimates the run; this is where it really ends."""
        epoch, step, per_epoch = self._last_batch
        last = self.cfg.epochs
        return last is not None and epoch == last - 1 and step == per_epoch - 1

    def _loader_failed(self, e: LoaderError, unsaved: bool | None) -> LoaderFailedError:
        """The one-line error of a loader failure; first the final checkpoint of the last
        completed step when it is not saved yet (``unsaved``; None: before the first step)."""
        endpoint = getattr(self.source, "endpoint", None)
        if isinstance(e, LoaderUnavailableError):
            what = str(e)
        elif isinstance(e, LoaderRequestError):
            what = f"the loader refused: {e}"
        elif isinstance(e, ProtocolError):
            what = f"the loader's answer is not understood: {e}"
        else:
            what = f"loader error: {e}"
        if endpoint is not None and str(endpoint) not in what:
            what = f"{endpoint}: {what}"
        if unsaved is None:
            return LoaderFailedError(f"training could not start: {what}")
        latest = ckpt.latest_checkpoint(self.cfg.run_dir)
        if unsaved:
            try:
                latest = self.save(self._step_start)
            except ckpt.CheckpointError as err:
                return LoaderFailedError(
                    f"training stopped after step {self.step}: {what}; and the final "
                    f"checkpoint failed: {err}"
                )
            note = f"saved checkpoint {latest.name} (the last completed step)"
        elif latest is not None:
            note = f"checkpoint {latest.name} holds the last completed step"
        else:
            note = "no step was completed"
        fix = "start the daemon again" if isinstance(e, LoaderUnavailableError) else "fix that"
        resume = f"{fix}, then rerun the same command with --resume"
        return LoaderFailedError(
            f"training stopped after step {self.step}: {what}; {note}: {resume}"
        )

    def _start(self, it: Iterator[Batch]) -> bool:
        """Peek the first batch (the loader reports its steps per epoch with it), fix the
        step count and build the LR schedule; False when the loader has nothing left."""
        t0 = time.perf_counter()
        try:
            self._pending = (next(it), time.perf_counter() - t0)
        except StopIteration:
            return False
        self._adopt_loader_spec()
        self.clock = clock = self._start_clock()
        self.total_steps = self.cfg.total_steps(clock.steps_per_epoch)
        self.total_micro = self.total_steps * clock.unit
        warmup = self.cfg.warmup_steps(self.total_steps)
        factor = warmup_cosine(warmup, self.total_steps, self.cfg.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda _: factor(clock.steps)
        )
        if self._scheduler_state is not None:
            self.scheduler.load_state_dict(self._scheduler_state)
            # Building the scheduler stepped it once (step 0's LR); put back the saved LR.
            for group, lr in zip(
                self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = lr
        log.info(
            "rank %d: %d optimizer steps (%d warmup), starting at step %d",
            self.env.rank,
            self.total_steps,
            warmup,
            self.step,
        )
        resized = getattr(self.source, "resized", None)
        if resized and self.env.is_main:
            log.warning(
                "resumed step %d under another shape: %s; the LR schedule continues at %.1f "
                "of %d steps of the first shape (%.1f%% of training)", self.step, resized,
                clock.steps, self.total_steps, 100 * clock.micro / max(self.total_micro, 1),
            )  # fmt: skip
        return True

    def _start_clock(self) -> Clock:
        """The clock this run continues: the checkpoint's, one rebuilt for a checkpoint
        written before clocks (its shape from its loader spec), or a new one."""
        shape = self.env.world_size * self.grad_accum
        per_epoch = int(self.source.steps_per_epoch or 0)
        if self._saved_clock is None:
            return Clock(0, shape, per_epoch)
        clock, world, grad_accum = self._saved_clock
        if clock is not None:
            return Clock.from_dict(clock)
        unit = world * grad_accum
        if unit != shape:
            # The first shape's epoch, in micro-batches: what the legs of this epoch served
            # plus the rest the loader now plans for this shape (``per_epoch`` is its steps).
            legs = getattr(self.source, "legs", ())
            served = sum(leg[0] * leg[1] * leg[2] for leg in legs)
            per_epoch = round((served + per_epoch * shape) / unit)
        return Clock(self.step * unit, unit, per_epoch)

    def _adopt_loader_spec(self) -> None:
        """Take ``grad_accum`` from the spec the loader actually serves (the daemon's
        configured one where the user set nothing), check that every rank and the resumed
        checkpoint were served the same spec, log it and keep it with checkpoints."""
        spec = dict(self.source.effective_spec or {})
        served = int(spec.get("grad_accum", self.cfg.grad_accum or 1))
        if self.cfg.grad_accum is not None and served != self.cfg.grad_accum:
            raise ServedSpecError(
                f"the loader serves grad_accum {served}, the trainer was told {self.cfg.grad_accum}"
            )
        self.grad_accum = served
        if not spec:
            return
        self._check_ranks_agree(spec)  # first: a collective every rank reaches
        saved = self._checkpoint_spec
        diff = {
            k: (saved.get(k), spec.get(k))
            for k in sorted(set(spec) | set(saved or {}))
            if k not in SHAPE and saved is not None and saved.get(k) != spec.get(k)
        }
        if diff:
            raise ServedSpecError(
                f"the loader now serves another batch spec than the checkpoint was trained on "
                f"(field: (checkpoint, served)): {diff}; resuming would replay the saved position "
                "in a different plan. Set those fields on the trainer (--spec KEY=VALUE) or "
                "restore the daemon's [spec]"
            )
        loss = self.cfg.loss
        rule = {
            "block_size": loss.block_size,
            "anchors_per_doc": loss.anchors_per_doc,
            "max_anchors": loss.max_anchors,
        }
        planned = {k: spec.get(k, v) for k, v in rule.items()}
        if spec.get("cost_slot") and planned != rule and self.env.is_main:
            log.warning(
                "the loader's cost model counts block slots with anchor rule %s, this trainer "
                "draws %s: its plans balance a cost this trainer does not pay (pass "
                "--spec KEY=VALUE or calibrate with this trainer's settings)", planned, rule
            )  # fmt: skip
        self.meta["loader_spec"] = spec
        log.info("rank %d: loader spec %s", self.env.rank, json.dumps(spec, sort_keys=True))
        if self.env.is_main:
            self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
            path = self.cfg.run_dir / "loader_spec.json"
            path.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")

    def _check_ranks_agree(self, spec: dict[str, Any]) -> None:
        """Every rank must be served one spec (one daemon per node: their configs could
        differ, and ranks with different grad_accum would hang in the all-reduce)."""
        if not self.env.distributed:
            return
        first = self._pending[0] if self._pending is not None else None
        where = {  # the plan this rank starts in: its position and the epoch's shape changes
            "epoch": None if first is None else int(first.epoch),
            "step": None if first is None else int(first.step),
            "leg": None if first is None else int(first.leg),
            "legs": [list(x) for x in getattr(self.source, "legs", ())],
        }
        keys = [_digest(spec), _digest(where)]
        t = torch.tensor([*keys, *(-k for k in keys)], dtype=torch.float64, device=self.env.device)
        hi_spec, hi_where, neg_lo_spec, neg_lo_where = all_reduce(t, self.env, op="max").tolist()
        if hi_spec != -neg_lo_spec:
            raise ServedSpecError(
                f"ranks were served different batch specs (rank {self.env.rank}: "
                f"{json.dumps(spec, sort_keys=True)}); give every node's daemon the same [spec]"
            )
        if hi_where != -neg_lo_where:
            raise ServedSpecError(
                f"ranks start at different places of the plan (rank {self.env.rank}: "
                f"{json.dumps(where)}): they resumed from different checkpoints or loader "
                "states; every rank must resume from the same checkpoint"
            )

    def _progress(self) -> tqdm[Any] | None:
        if not (self.cfg.progress and self.env.is_main) or self.total_micro is None:
            return None
        per_step = self.env.world_size * self.grad_accum  # steps left, in this shape's steps
        left = -(-(self.total_micro - self.clock.micro) // per_step)
        return progress_bar(self.step + max(left, 0), "train", initial=self.step)


def _digest(obj: Any) -> float:
    """48 bits of a JSON value's hash, exact in float64 (all-reduced to compare ranks)."""
    digest = hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=6)
    return float(int.from_bytes(digest.digest(), "little"))


def _memory_peaks_gb(device: torch.device) -> tuple[float, float]:
    """Peak resident memory of this process and peak CUDA memory allocated, in GiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return rss, gpu


def _finite_or_none(x: float | None) -> float | None:
    """``x``, or None for NaN and inf (JSON has no such numbers)."""
    return x if x is not None and math.isfinite(x) else None


def _postfix(rec: dict[str, Any]) -> dict[str, str]:
    out = {"loss": f"{rec['loss']:.3f}" if rec["loss"] is not None else "-"}
    if "tau" in rec:
        out["tau"] = f"{rec['tau']:.2f}"
    out["tok/s"] = f"{rec['tokens_per_s']:.0f}"
    out["wait"] = f"{100 * rec['data_wait_frac']:.1f}%"
    return out
