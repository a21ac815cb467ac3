"""The training loop: one process per rank, micro-batches from the loader, exact resume.

Each optimizer step consumes ``grad_accum`` micro-batches whose ``micro`` index runs
0..grad_accum-1 for the same ``(epoch, step)``; the trainer checks that instead of counting
on its own, because mixing micro-step and optimizer-step counters is the classic resume
bug. Gradients are all-reduced only on the last micro-batch (``no_sync`` before it). After
the optimizer step the loader client's position is exactly "the next step's micro 0", which
is what a checkpoint stores; a document's anchors are a function of the seed, the epoch and
the sample (``trainer.model.blocks``), so a resumed run repeats the uninterrupted one.

The step's loss is normalized over the whole step, every micro-batch of every rank, so it
does not depend on how the loader cut the step (``trainer.train.objective``).

Timing: ``data_wait`` is the time blocked in ``next(loader)``; step time runs from the first
``next`` to the end of the optimizer step and excludes evaluation and checkpointing, which
are reported separately.

The loop's concerns live beside it, one module each: the config (``config``), resuming a
checkpoint (``resume``) and the spec the loader serves, shape changes included
(``served_spec``), the data clock and LR schedule (``clock``), evaluation
(``evaluation``), checkpoint cadence (``cadence``), loader failures (``loader_failure``),
a step's sums and record (``step``) and ``--profile-step`` (``profile``).

What stops a run (each a ``TrainingError``, one line for the user): ``max_nonfinite_steps``
steps in a row whose loss or gradients were NaN/inf on some rank (each such step is
skipped: no optimizer update; the decision is all-reduced, so every rank skips it);
``max_empty_steps`` steps in a row in which no rank trained a block (the spec leaves no
document a block; such a step is skipped too: with no weight it has no objective, and
AdamW's momentum and weight decay would still move the weights); a loader that stays away
past its timeout or refuses the session (a final checkpoint of the last completed step is
written first); and a write into the run folder that fails (no space, read-only).
``--resume`` verifies checkpoints and falls back to the newest complete one
(``trainer.train.resume``) and refuses another target.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from loader_server.faults import fault_point
from loader_server.wire.protocol import LoaderError
from trainer.model.attention import packed_attention, resolve_backend
from trainer.model.blocks import LossConfig, anchor_draw
from trainer.model.doc_view import DocView
from trainer.model.drafter import DFlashDrafter
from trainer.model.loss import draft_loss, zero_loss
from trainer.model.phases import phase
from trainer.model.target import Target
from trainer.progress import StepProgress
from trainer.sections import RunOptions
from trainer.train import checkpoint as ckpt
from trainer.train import hostmem, loader_failure, objective, resume, served_spec, stop
from trainer.train.batches import Batch, BatchSource
from trainer.train.cadence import Cadence
from trainer.train.clock import Clock, SavedClock, lr_factor, lr_scheduler, start_clock
from trainer.train.costlog import CostLog
from trainer.train.distributed import DistEnv
from trainer.train.evaluation import Evaluator
from trainer.train.guards import (
    WRITE_ERRNOS,
    LoaderFailedError,
    ServedSpecError,
    Stopper,
    Tally,
    TrainingError,
)
from trainer.train.loader_failure import Fetch
from trainer.train.metrics import MetricsWriter, metrics_path, read_metrics, summarize
from trainer.train.optimizers import make_optimizer
from trainer.train.profile import StepProfiler, trainer_flops
from trainer.train.step import Applied, StepResult, StepSums, autocast, step_record
from trainer.train.trackers import Trackers

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

#: How the step loop ended: its last step, a stop on request, or the loader ran out.
End = Literal["done", "stopped", "exhausted"]


class _LoaderDone(Exception):
    """The loader had no batch for the next step (it serves a fixed number of epochs)."""


class Trainer:
    """Owns the optimizer, the loop, evaluation, metrics and checkpoints of one rank."""

    def __init__(
        self,
        opts: RunOptions,
        *,
        target: Target,
        drafter: DFlashDrafter,
        source: BatchSource,
        env: DistEnv,
        eval_prompts: Sequence[torch.Tensor] = (),
        eval_sets: Mapping[str, Sequence[torch.Tensor]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        opts.check_length()
        self.opts, self.env = opts, env
        self.loss = LossConfig.from_options(opts, opts.block_size)
        self.target, self.drafter, self.source = target, drafter, source
        lr = opts.peak_lr()
        schedule = {"lr": lr, "lr_schedule": opts.lr_schedule, "warmup": opts.warmup}
        self.meta = {**(meta or {}), "schedule": schedule}  # checkpoints; a resume compares
        self.model = self._wrap(drafter)
        self.optimizer = make_optimizer(
            opts.optimizer, drafter.named_parameters(), lr=lr,
            weight_decay=opts.weight_decay,
        )  # fmt: skip
        self.attention = resolve_backend(opts.attention, env.device)
        self.evaluator = Evaluator(
            target, drafter, eval_prompts, env=env, max_new_tokens=opts.eval_new_tokens,
            every=opts.eval_every, sets=eval_sets, batch=opts.eval_batch,
        )  # fmt: skip
        self.cadence = Cadence(opts.ckpt_every)
        self.profiler = StepProfiler(opts.profile_step, opts.run_dir, env, opts.peak_tflops)
        self.metrics = MetricsWriter(metrics_path(opts.run_dir), enabled=env.is_main)
        self.trackers = Trackers(opts.report_to, opts.run_dir, env.is_main, opts.to_record())
        self.costs = CostLog(opts.run_dir, env.rank, opts.cost_samples, self.loss.anchor_rule,
                             env.device, packed_attention(self.attention))  # fmt: skip
        self.stopper = Stopper(
            max_nonfinite_steps=opts.max_nonfinite_steps, max_empty_steps=opts.max_empty_steps,
            lr=lr, block_size=self.loss.block_size,
        )  # fmt: skip
        self._init_position()

    def _init_position(self) -> None:
        """Where the run is; most of it known only once the loader answered (``_begin``)."""
        self.step = 0
        self.epoch = 0
        self.grad_accum = self.opts.grad_accum or 1  # the loader's spec decides (_begin)
        # Known once the loader has answered (steps per epoch) with --epochs: see _begin().
        self.total_steps: int | None = self.opts.steps
        self.total_micro: int | None = None  # the run's end on the clock
        self.clock = Clock(unit=self.env.world_size * self.grad_accum)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._restored: resume.Restored | None = None  # the checkpoint this run resumed
        self._pending: tuple[Batch, float] | None = None  # the batch peeked by _begin()
        # Where the step that failed began (loader state, RNG): a final checkpoint after a
        # loader failure in the middle of a step must hold the position before that step.
        self._step_start: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._last_batch = (0, 0, 0)  # (epoch, step, steps in its epoch) last trained
        self.tally = Tally()  # what the run has trained, over all its resumes

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
            loss_config=asdict(self.loss),
            meta={**self.meta, "trained": asdict(self.tally)},
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            clock=self.clock.to_dict(),
        )
        loader, rng = position or (self.source.state_dict(), ckpt.rng_state())
        path = ckpt.save_checkpoint(
            self.opts.run_dir, self.step, self.env, record=record,
            per_rank={"loader": loader, "rng": rng}, keep=self.opts.keep_checkpoints,
        )  # fmt: skip
        self.cadence.saved(self.step)
        return path

    def maybe_resume(self) -> bool:
        """Load the newest complete checkpoint of the run if ``resume`` is set and one
        exists (torn ones are skipped, and said so)."""
        found = ckpt.list_checkpoints(self.opts.run_dir) if self.opts.resume else []
        if not found:
            if self.opts.resume:
                log.info("no checkpoint in %s: starting fresh", self.opts.run_dir)
            return False
        checkpoint = resume.newest_complete(found, self.env, self.opts.run_dir)
        resume.check_compatible(
            checkpoint, drafter_config=self.drafter.config.to_dict(),
            loss_config=asdict(self.loss), meta=self.meta,
        )  # fmt: skip
        self._restored = restored = resume.restore(
            checkpoint, drafter=self.drafter, optimizer=self.optimizer, source=self.source,
            env=self.env, seed=self.opts.seed, grad_accum=self.grad_accum,
        )  # fmt: skip
        self.step, self.epoch = restored.step, restored.epoch
        self.tally = Tally.from_meta(checkpoint.record.meta, self.step)
        self.metrics.truncate_after(self.step)
        log.info("rank %d resumed from %s at step %d", self.env.rank, checkpoint.path, self.step)
        return True

    # ---- evaluation --------------------------------------------------------------------

    def evaluate(self) -> dict[str, float] | None:
        """tau over the held-out prompts and the evaluation sets, all ranks
        (``trainer.train.evaluation``)."""
        return self.evaluator.evaluate()

    # ---- the run -----------------------------------------------------------------------

    def run(self, accepted: Callable[[], None] | None = None) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming first if asked); returns the run summary.
        ``accepted`` is called once the run folder is known to take this run (a folder
        without checkpoints, or a resume whose checkpoint fits), before the first step."""
        cfg = self.opts
        if not cfg.resume and ckpt.latest_checkpoint(cfg.run_dir) is not None:
            raise ValueError(
                f"{cfg.run_dir} already has checkpoints: pass --resume to continue that run, "
                "or choose a new --run-dir"
            )
        resumed = self.maybe_resume()
        if accepted is not None:
            accepted()
        if not resumed:
            self._first_record()
        it = iter(self.source)
        try:
            started = self._begin(it)
        except LoaderError as e:
            self._close()
            raise self._loader_failed(e, None) from e
        if not started:
            self._close()
            return {"steps": self.step, "resumed": resumed, "note": "loader has no more batches"}
        self.cadence.begin(self.step, resumed=resumed)
        bar = self._progress()
        t_loop = time.perf_counter()
        try:
            end = self._steps(it, bar)
            if end != "done" and self.cadence.unsaved(self.step):
                self.save()
            if end == "stopped":
                log.info("rank %d: stopped at step %d on request", self.env.rank, self.step)
        except LoaderError as e:
            raise self._loader_failed(e, self.cadence.unsaved(self.step)) from e
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:
                raise
            raise ckpt.run_write_error(e, cfg.run_dir) from e
        finally:
            if bar is not None:
                bar.close()
            self._close()
        self.tally.check(self.loss.block_size, self.meta.get("loader_spec") or {})
        return self._summary(end, resumed, time.perf_counter() - t_loop)

    def _first_record(self) -> None:
        """A fresh run's step-0 record: the untrained drafter's tau."""
        if self.env.is_main:
            self.metrics.truncate_after(-1)
        rec: dict[str, Any] = {"step": 0}
        self.evaluator.add_to(rec)
        self.metrics.write(rec)
        self.trackers.log(0, rec)

    def _steps(self, it: Iterator[Batch], bar: StepProgress | None) -> End:
        """The step loop. ``--epochs``: to the last step of the last epoch (the loader's
        end), wherever the estimate put it; ``--steps``: to the data of that many steps."""
        total = cast(int, self.total_micro)  # _begin fixed it
        final = self.opts.epochs is None and self.clock.micro >= total
        while not final:
            if stop.agreed(self.env):  # SIGTERM on any rank: all stop before this step
                return "stopped"
            fault_point("step", self.step + 1)
            try:
                rec = self._record(self._train_or_profile(it))
            except _LoaderDone:  # the loader ended first (the step was not begun)
                log.info("rank %d: the loader has no more batches", self.env.rank)
                return "exhausted"
            final = self._last_epoch_done() or (
                self.opts.epochs is None and self.clock.micro >= total
            )
            if self.evaluator.due(self.step, final):
                self.evaluator.add_to(rec)
            self.tally.add(rec["blocks"])
            self.metrics.write(rec)  # before the checkpoint (trainer.train.cadence)
            self.trackers.log(self.step, rec)
            self.stopper.check(rec, self.step, self.meta.get("loader_spec") or {})
            if self.cadence.due(self.step, final):
                t0 = time.perf_counter()
                path = self.save()
                log.debug("checkpoint %s in %.3fs", path, time.perf_counter() - t0)
            if bar is not None:
                bar.update(self.step, rec)
        return "done"

    def _summary(self, end: End, resumed: bool, wall: float) -> dict[str, Any]:
        summary = (
            summarize(read_metrics(metrics_path(self.opts.run_dir))) if self.env.is_main else {}
        )
        summary.update(
            wall_steps_per_s=(self.step - self.cadence.first_step) / wall if wall > 0 else None,
            resumed=resumed,
            stopped=end == "stopped",
        )
        if end == "exhausted":
            summary["note"] = "the loader had no more batches"
        return summary

    def _close(self) -> None:
        self.metrics.close()
        self.trackers.close()
        self.costs.close()

    def _last_epoch_done(self) -> bool:
        """With ``--epochs E``: whether the step just trained was the last of epoch E-1.
        Epochs differ by a step or so (their plans are cut afresh), so E x the first
        epoch's steps only estimates the run; this is where it really ends."""
        epoch, step, per_epoch = self._last_batch
        last = self.opts.epochs
        return last is not None and epoch == last - 1 and step == per_epoch - 1

    def _loader_failed(self, e: LoaderError, unsaved: bool | None) -> LoaderFailedError:
        """The one-line error of a loader failure (``trainer.train.loader_failure``)."""
        return loader_failure.stop_error(
            e, step=self.step, endpoint=getattr(self.source, "endpoint", None),
            run_dir=self.opts.run_dir, unsaved=unsaved,
            save_final=lambda: self.save(self._step_start),
        )  # fmt: skip

    # ---- the first batch: the spec, the clock, the schedule ------------------------------

    def _begin(self, it: Iterator[Batch]) -> bool:
        """Peek the first batch (the loader reports its steps per epoch with it), adopt the
        served spec, fix the step count and build the LR schedule; False when the loader
        has nothing left."""
        t0 = time.perf_counter()
        batch, fetch = self._fetch(it)
        if fetch is Fetch.EXHAUSTED or batch is None:
            return False
        self._pending = (batch, time.perf_counter() - t0)
        self._adopt_loader_spec()
        self._build_schedule()
        resized = getattr(self.source, "resized", None)
        if resized and self.env.is_main:
            clock, total = self.clock, cast(int, self.total_micro)
            log.warning(
                "resumed step %d under another shape: %s; the LR schedule continues at %.1f "
                "of %d steps of the first shape (%.1f%% of training)", self.step, resized,
                clock.steps, self.total_steps, 100 * clock.micro / max(total, 1),
            )  # fmt: skip
        return True

    def _build_schedule(self) -> None:
        """The clock this run continues, its length in steps, and the LR schedule."""
        saved: SavedClock | None = self._restored.clock if self._restored else None
        self.clock = clock = start_clock(
            saved, step=self.step, shape=self.env.world_size * self.grad_accum,
            steps_per_epoch=int(self.source.steps_per_epoch or 0),
            legs=getattr(self.source, "legs", ()),
        )  # fmt: skip
        self.total_steps = total = self.opts.total_steps(clock.steps_per_epoch)
        self.total_micro = total * clock.unit
        warmup = self.opts.warmup_steps(total)
        factor = lr_factor(self.opts.lr_schedule, warmup, total)
        state = self._restored.scheduler_state if self._restored else None
        self.scheduler = lr_scheduler(self.optimizer, clock, factor, state)
        log.info(
            "rank %d: %d optimizer steps (%d warmup), starting at step %d",
            self.env.rank, total, warmup, self.step,
        )  # fmt: skip

    def _adopt_loader_spec(self) -> None:
        """Take ``grad_accum`` from the spec the loader actually serves, check it against
        the other ranks and the resumed checkpoint (``trainer.train.served_spec``), keep it
        with checkpoints."""
        spec = dict(self.source.effective_spec or {})
        self.grad_accum = served_spec.served_grad_accum(spec, self.opts.grad_accum)
        if not spec:
            return
        first = self._pending[0] if self._pending is not None else None
        where = served_spec.start_place(first, getattr(self.source, "legs", ()))
        served_spec.check_ranks_agree(spec, where, self.env)  # first: a collective
        saved = self._restored.loader_spec if self._restored else None
        served_spec.check_checkpoint_spec(spec, saved)
        served_spec.warn_other_anchor_rule(spec, self.loss, self.env)
        self.meta["loader_spec"] = spec
        served_spec.record_spec(spec, self.opts.run_dir, self.env)

    def _progress(self) -> StepProgress | None:
        """Rank 0's bar on a terminal, else its progress lines (``--log-every-s``)."""
        if not self.env.is_main or self.total_micro is None:
            return None
        per_step = self.env.world_size * self.grad_accum  # steps left, in this shape's steps
        left = -(-(self.total_micro - self.clock.micro) // per_step)
        return StepProgress(self.step + max(left, 0), self.step, bar=self.opts.progress,
                            every_s=self.opts.log_every_s)  # fmt: skip

    # ---- one step ----------------------------------------------------------------------

    def _train_or_profile(self, it: Iterator[Batch]) -> StepResult:
        """One step; the one ``--profile-step`` names runs under ``torch.profiler``."""
        block = self.loss.block_size
        return self.profiler.run(
            self.step + 1,
            lambda: self.train_step(it),
            lambda work: trainer_flops(work, self.target, self.drafter.config, block),
        )

    def _record(self, raw: StepResult) -> dict[str, Any]:
        return step_record(
            raw, self.env, step=self.step, epoch=self.epoch,
            normalization=self.loss.normalization,
        )  # fmt: skip

    def _micro_batches(self, it: Iterator[Batch]) -> Iterator[tuple[Batch, float]]:
        """The step's micro-batches with the time spent waiting for each."""
        first = None
        for m in range(self.grad_accum):
            batch, waited = self._next_batch(it, m)
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

    def _next_batch(self, it: Iterator[Batch], m: int) -> tuple[Batch, float]:
        """Micro-batch ``m`` of the step (the peeked one first) and the wait for it; every
        rank agrees on how the fetch ended before any collective (``loader_failure.agree``)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
        t0 = time.perf_counter()
        batch, fetch = self._fetch(it)
        if fetch is Fetch.EXHAUSTED:
            if m == 0:
                raise _LoaderDone from None
            raise ServedSpecError(
                f"the loader ended inside a step, after {m} of its {self.grad_accum} micro-batches"
            )
        assert batch is not None  # Fetch.GOT
        return batch, time.perf_counter() - t0

    def _fetch(self, it: Iterator[Batch]) -> tuple[Batch | None, Fetch]:
        """``next(it)`` and how it ended, as every rank agreed."""
        batch, error, fetch = None, None, Fetch.GOT
        try:
            batch = next(it)
        except StopIteration:
            fetch = Fetch.EXHAUSTED
        except LoaderError as e:
            error, fetch = e, Fetch.FAILED
        return batch, loader_failure.agree(fetch, self.env, error)

    def train_step(self, it: Iterator[Batch]) -> StepResult:
        """One optimizer step; returns this rank's sums."""
        t_start = time.perf_counter() - (self._pending[1] if self._pending else 0.0)
        sums, wait = self._step_gradients(it)
        grad_norm, lr, applied = self._optimizer_step(sums)
        self.step += 1
        self.costs.end_step()
        step_time = time.perf_counter() - t_start
        sums.step_time += step_time
        sums.wait += wait
        sums.wait_frac += wait / max(step_time, 1e-9)
        return StepResult(sums=sums, grad_norm=grad_norm, lr=lr, skipped=applied.skipped,
                          empty=applied.empty)  # fmt: skip

    def step_gradients(self, it: Iterator[Batch]) -> StepSums:
        """Forward and backward of the next step's micro-batches, the gradients normalized
        over the step (what the optimizer step clips and applies); this rank's sums."""
        return self._step_gradients(it)[0]

    def _step_gradients(self, it: Iterator[Batch]) -> tuple[StepSums, float]:
        """``step_gradients`` and the time this rank waited for its micro-batches."""
        wait = 0.0
        sums = StepSums.zeros(self.loss.block_size - 1, self.env.device)
        epoch_before = self.epoch
        # With several micro-batches the loader can fail after the first: keep where the
        # step began (the first step of a run saves nothing: its batch was peeked).
        # Under several ranks a peer's failure stops this rank after its own fetch of the
        # same micro-batch, so its client has moved too.
        start = None
        if (self.grad_accum > 1 or self.env.distributed) and self._pending is None:
            start = (self.source.state_dict(), ckpt.rng_state())
        self._step_start = None
        try:
            for batch, waited in self._micro_batches(it):
                self._micro_step(batch, sums)
                wait += waited
        except LoaderError:
            self.epoch, self._step_start = epoch_before, start
            raise
        if self.loss.normalization == "step":
            objective.normalize_gradients(self.drafter.parameters(), sums.divisor, self.env)
        return sums, wait

    def _optimizer_step(self, sums: StepSums) -> tuple[torch.Tensor, float, Applied]:
        """Clip, step (unless some rank's loss or gradients are not finite, or no rank's
        step has weight), advance the clock and the schedule; the gradient norm, the step's
        LR and why it did not apply."""
        if self.scheduler is None:
            raise RuntimeError("train_step() before the LR schedule exists (see run())")
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.drafter.parameters(), self.opts.grad_clip
            )
            lr = cast(float, self.scheduler.get_last_lr()[0])  # the float cfg.lr, scheduled
            applied = Applied.agree(grad_norm, sums, self.env)
            if not (applied.skipped or applied.empty):
                self.optimizer.step()
            self.clock.micro += self.env.world_size * self.grad_accum
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr, applied

    def _micro_step(self, batch: Batch, sums: StepSums) -> None:
        """Forward and backward of one micro-batch, its sums added to ``sums``."""
        cfg, dev = self.opts, self.env.device
        self.epoch = int(batch.epoch)
        self._last_batch = (int(batch.epoch), int(batch.step), int(batch.steps_per_epoch))
        self._check_vocabulary(batch)
        self.costs.start()
        # Used up before the next next(): the client reuses the slot after that.
        with phase("copy"):
            on_dev = batch.to(dev, non_blocking=True)
        draw = anchor_draw(self.loss, cfg.seed, self.env.rank, batch)
        last = batch.micro == self.grad_accum - 1
        sync = (
            contextlib.nullcontext()
            if last or not self.env.distributed
            else cast("DistributedDataParallel", self.model).no_sync()  # see _wrap
        )
        with sync:
            with autocast(dev):
                out = draft_loss(
                    self.target,
                    self.model,
                    on_dev,
                    self.loss,
                    draw,
                    chunk_size=cfg.loss_chunk,
                    attention=self.attention,
                    host_batch=batch,  # valid until the next next(): anchors planned there
                    on_chunks=self._fit_host_memory,
                )
                loss = objective.micro_loss(out, self.loss.normalization, self.grad_accum)
                if loss is None:  # no block: a zero loss that runs the drafter (DDP)
                    loss = zero_loss(self.target, self.model)
            with phase("backward"):
                loss.backward()
        self.costs.stop(batch, anchors=out.num_blocks, synced=last and self.env.distributed)
        sums.add(out)
        if self.profiler.active:  # what the step's FLOP count needs (a host sync: only here)
            work = self.profiler.work
            work.doc_lengths += DocView.of(batch).length.tolist()
            work.anchors += out.num_blocks
            work.slots += int(out.count.sum().item())

    def _fit_host_memory(self, num_chunks: int) -> None:
        """On CPU the allocator follows the drafter's chunk count (``trainer.train.hostmem``)."""
        if self.env.device.type == "cpu":
            hostmem.fit_chunks(num_chunks)

    def _check_vocabulary(self, batch: Batch) -> None:
        """A corpus tokenized for another model has ids the target cannot embed: one line
        naming the batch, the id and the samples, not an IndexError deep in the forward."""
        ids = batch.input_ids
        top = int(ids.max()) if ids.numel() else 0
        vocab = self.target.vocab_size
        if top >= vocab or (ids.numel() and int(ids.min()) < 0):
            bad = (ids >= vocab) | (ids < 0)
            rows = None if batch.packs else batch.sample_ids[bad.any(dim=1)]
            which = f"samples {rows[:5].tolist()}" if rows is not None else "this packed batch"
            raise TrainingError(
                f"epoch {batch.epoch} step {batch.step} micro {batch.micro}: token id "
                f"{top if top >= vocab else int(ids.min())} is outside the target's vocabulary "
                f"({vocab} ids; {which}): the corpus was tokenized for another model; "
                "tokenize it with the target's tokenizer, or train against the model it was "
                "tokenized for"
            )
