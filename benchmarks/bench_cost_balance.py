"""Cost-balanced against token-balanced plans, measured on the real trainer, in one run,
in packed rows (the default layout) and padded.

    .venv/bin/python benchmarks/bench_cost_balance.py [--grad-accum 1,4] [--steps 12]
        [--layouts packed,padded]

What it does, on this machine (CPU, one thread):

1. A tiny Qwen3 target with the real vocabulary (151,936 tokens: the LM head is the
   largest cost of a drafter block slot), a 1-layer DFlash drafter, block size 8, and a
   corpus of lognormal lengths (median 200, 16..1024 tokens). The spec: 4,096-token
   micro-batches (padded: of at most 64 rows), world size 8; the trainer's anchor rule:
   its per-document draw with 1 anchor per document and no cap, so a micro-batch's
   LM-head work follows its document count, not its tokens: a micro-batch of many short
   documents carries several times the anchors of one of a few long ones at the same
   token count. That is the case the cost model exists for, scaled down. On this CPU the
   trainer runs SDPA, a target forward per packed document (``packed_attention=
   "documents"``, recorded with the timings): each document also carries that forward's
   fixed cost, the model's ``documents`` term (here one anchor per document, so it is
   ``slots / 8`` and the fit gives it to either).
2. Calibration, for real: the trainer (``trainer.train.loop.Trainer``, one rank) trains on
   each layout's token-balanced plan, in that layout, with ``--cost-samples``; then
   ``dflash-train calibrate`` fits each layout's profile to its own run (hold-out error
   printed). How far a fit carries across layouts is printed too: each layout's fit
   predicting the other's micro-batches, and one fit of both runs judged per layout.
3. For each layout and ``--grad-accum`` (default 1 and 4), the token-balanced and the
   cost-balanced plan of the same corpus (``--baseline REV``: also the cost-balanced plan
   of commit REV's planner, padded, run by its own code: ``benchmarks/baseline.py``).
   ``--steps`` randomly chosen steps of each plan (8 ranks x grad_accum micro-batches
   each) are timed for real, forward + backward as the trainer runs them in the plan's
   layout, the plans interleaved step by step. Each step is timed twice over (all its
   micro-batches, then all again), and within a pass the ranks are interleaved (each
   rank's first micro-batch, then each one's second...): real ranks run at once, so the
   VM's drift over seconds must not fall on one rank. Timed rank after rank, it did: at
   grad_accum 4 a rank's micro-batches erred together (``rank_coupling`` 2.3-2.4, printed
   with every run). Per step, a rank's time is the sum of its micro-batches' (first)
   times.
4. Reported, side by side: measured rank imbalance (mean over steps of max/mean of the
   ranks' times), the noise floor (each micro-batch's two timings give its timing noise,
   ``(t1 - t2) / (t1 + t2) * sqrt(2)`` relative to the pair's mean, less its median (the
   second pass's warm-cache bias); 8 ranks of ``grad_accum`` such deviations drawn at
   random are 8 ranks with equal work: the mean of their max/mean over 20,000 draws is
   what noise alone makes of a perfect plan. A pass apart, not back to back: this VM's
   speed also drifts over a second or two (deviations from the model of micro-batches
   timed one after the other correlate, 0.37-0.41), which a measured step carries and a
   back-to-back pair cancelled, so the floor left it out; over minutes it drifts by
   several percent, as the ranks of one step would not), the simulated DDP epoch time
   (steps per epoch x mean per-step maximum), its ratio to the token-balanced plan's with
   a 90% bootstrap interval over the sampled steps, and the plan targets on the 902K
   reference shape with the cost model on at grad_accum 1 and 4.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from loader_server.data.synth import SynthSpec, synth_lengths
from loader_server.planning import metrics
from loader_server.planning.planner import EpochPlan, plan_epoch
from loader_server.wire.layouts import LAYOUTS
from loader_server.wire.spec import BatchSpec, profile_fields
from trainer.model.blocks import LossConfig, anchor_generator
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.loss import draft_loss
from trainer.model.target import Target, TinyTargetSpec, load_target
from trainer.ops.calibrate import calibrate_run, fit_nnls, load_samples, relative_errors
from trainer.sections import RunOptions
from trainer.train import hostmem
from trainer.train.batches import Batch, pack_batch, pad_batch
from trainer.train.distributed import local_env
from trainer.train.loop import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.baseline import plans_at

VOCAB = 151_936
BLOCK, PER_DOC = 8, 1
PROMPT = 4  # unsupervised tokens at the start of every sample


class Corpus:
    """Random token ids for lognormal lengths; the loss mask covers all but ``PROMPT``."""

    def __init__(self, samples: int, seed: int) -> None:
        shape = SynthSpec(
            num_samples=samples, median_len=200, sigma=0.8, min_len=16, max_len=1024, seed=seed
        )
        self.lengths = synth_lengths(shape)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, VOCAB - 1, int(self.offsets[-1]), dtype=np.int32)

    def batch(self, ids: np.ndarray, layout: str, **position: int) -> Batch:
        """The samples ``ids`` as the trainer receives them in ``layout``."""
        rows = []
        for i in ids.tolist():
            seq = self.tokens[self.offsets[i] : self.offsets[i + 1]].tolist()
            rows.append((seq, [0] * PROMPT + [1] * (len(seq) - PROMPT)))
        make = pack_batch if LAYOUTS[layout].packs else pad_batch
        return make(rows, sample_ids=ids.tolist(), **position)


class PlanSource:
    """The micro-batches of a plan, in (step, rank) order, as one rank's loader."""

    def __init__(self, corpus: Corpus, plan: EpochPlan) -> None:
        self.corpus, self.plan = corpus, plan
        self.steps_per_epoch = plan.num_micro
        self.effective_spec = {"grad_accum": 1, "layout": plan.spec.layout}
        self.position = 0

    def __iter__(self) -> Iterator[Batch]:
        while self.position < self.plan.num_micro:
            m = self.position
            ids = self.plan.sample_ids[self.plan.offsets[m] : self.plan.offsets[m + 1]]
            self.position += 1
            yield self.corpus.batch(ids, self.plan.spec.layout, epoch=0, step=m, micro=0)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def close(self) -> None:
        pass


def build_models(hidden: int) -> tuple[Target, DFlashDrafter]:
    torch.manual_seed(0)
    tiny = TinyTargetSpec(
        vocab_size=VOCAB, hidden_size=hidden, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=3 * hidden,
    )  # fmt: skip
    target = load_target("tiny", layer_ids=[0, 1, 3], device="cpu", dtype=torch.float32, tiny=tiny)
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=BLOCK, mask_token_id=VOCAB - 1
    )
    return target, DFlashDrafter(cfg)


def loss_config() -> LossConfig:
    """The rule this benchmark is measured under: the trainer's per-document draw with one
    anchor per document (``PER_DOC``), no cap, so a micro-batch's LM-head work follows its
    document count, not its tokens."""
    return LossConfig(block_size=BLOCK, anchors_per_doc=PER_DOC, tokens_per_anchor=1)


def record_costs(corpus: Corpus, plan: EpochPlan, target, drafter, micro: int, run_dir: Path):
    """Train on the plan's micro-batches (in its layout), recording ``micro`` of them."""
    cfg = RunOptions(
        endpoint="in-process", run_dir=run_dir, steps=micro + 2, lr=1e-4, warmup=0,
        no_progress=True, cost_samples=micro, eval_new_tokens=1, **loss_config().options(),
    )  # fmt: skip
    Trainer(
        cfg, target=target, drafter=drafter, source=PlanSource(corpus, plan), env=local_env()
    ).run()


def cross_layout(runs: list[Path]) -> dict[str, dict[str, float]]:
    """Fitted on one layout's micro-batches alone, the other layout's predicted: median and
    p90 relative error (does the model carry across layouts, or only fit one?)."""
    samples = load_samples(runs)
    out = {}
    for fit_on in samples.layouts:
        mine = samples.layout == fit_on
        coef = fit_nnls(samples.x[mine], samples.y[mine])
        err = relative_errors(samples.x[~mine], samples.y[~mine], coef)
        out[fit_on] = {
            "median_rel_err": float(np.median(err)),
            "p90_rel_err": float(np.quantile(err, 0.9)),
        }
    return out


def time_micro(corpus: Corpus, plan: EpochPlan, m: int, target, drafter) -> float:
    """Forward + backward of micro-batch ``m``, as the trainer runs it (seconds)."""
    ids = plan.sample_ids[plan.offsets[m] : plan.offsets[m + 1]]
    batch = corpus.batch(ids, plan.spec.layout, epoch=0, step=m, micro=0)
    gen = anchor_generator(0, 0, 0, m, 0)
    t0 = time.perf_counter()
    out = draft_loss(target, drafter, batch, loss_config(), gen, on_chunks=hostmem.fit_chunks)
    if out.loss is not None:
        out.loss.backward()
    elapsed = time.perf_counter() - t0
    drafter.zero_grad(set_to_none=True)
    return elapsed


def measure(plans: dict[str, EpochPlan], steps: int, corpus: Corpus, target, drafter, seed: int):
    """[plan] -> (times [2, steps, world, grad_accum]) for the sampled steps, each step's
    micro-batches timed in turn, then all of them again."""
    rng = np.random.default_rng(seed)
    spec = next(iter(plans.values())).spec
    world, accum = spec.world_size, spec.grad_accum
    chosen = {
        name: np.sort(rng.choice(p.num_steps, steps, replace=False)) for name, p in plans.items()
    }
    times = {name: np.zeros((2, steps, world, accum)) for name in plans}
    for _ in range(3):  # warm-up: allocator, first-call costs
        p = next(iter(plans.values()))
        time_micro(corpus, p, 0, target, drafter)
    for k in range(steps):
        for name, p in plans.items():  # interleaved: drift hits both plans alike
            for rep in range(2):  # the step twice: the pair differs by the noise within it
                for g, r in np.ndindex(accum, world):  # ranks interleaved (module docstring)
                    m = p.index(int(chosen[name][k]), r, g)
                    times[name][rep, k, r, g] = time_micro(corpus, p, m, target, drafter)
    return times, chosen


def noise_floor(times: dict[str, np.ndarray], seed: int, draws: int = 20_000) -> float:
    """Imbalance of 8 ranks with equal work (each ``grad_accum`` micro-batches), from the
    jitter of the twice-timed micro-batches."""
    pairs = np.concatenate([t.reshape(2, -1) for t in times.values()], axis=1)
    d = (pairs[0] - pairs[1]) / (pairs[0] + pairs[1])
    d = (d - np.median(d)) * np.sqrt(2.0)  # one timing's deviation from the pair's mean
    jitter = np.concatenate([d, -d])
    _, _, world, accum = next(iter(times.values())).shape
    sample = 1.0 + np.random.default_rng(seed).choice(jitter, (draws, world, accum))
    return imbalance(sample.mean(axis=2))


def epoch_ratio_interval(
    mine: np.ndarray, base: np.ndarray, seed: int, draws: int = 5000
) -> tuple[float, float]:
    """90% bootstrap interval of the ratio of two plans' mean per-step maxima (times the
    exact ratio of their steps per epoch, the ratio of their epoch times), the sampled
    steps of each plan resampled: how far the epoch-time column can be trusted."""
    rng = np.random.default_rng(seed)
    a, b = (t[0].sum(axis=2).max(axis=1) for t in (mine, base))  # [steps] per-step maxima
    ia = rng.integers(0, a.size, (draws, a.size))
    ib = rng.integers(0, b.size, (draws, b.size))
    ratio = a[ia].mean(axis=1) / b[ib].mean(axis=1)
    lo, hi = np.quantile(ratio, [0.05, 0.95])
    return float(lo), float(hi)


def modelled_grid(plan: EpochPlan, steps: np.ndarray, coef) -> np.ndarray:
    """[steps, world, grad_accum] modelled cost of the micro-batches of ``steps``."""
    costs = metrics.modelled_costs(plan, coef)
    world, accum = plan.spec.world_size, plan.spec.grad_accum
    out = np.empty((steps.size, world, accum))
    for k, step in enumerate(steps.tolist()):
        for r, g in np.ndindex(world, accum):
            out[k, r, g] = costs[plan.index(step, r, g)]
    return out


def rank_coupling(times: np.ndarray, modelled: np.ndarray) -> float:
    """How much a rank's micro-batches of one step err together: the variance over
    (step, rank) of the mean of their log(measured / modelled) deviations, the step's mean
    taken out, over what independent deviations of the same spread would give (1: as
    independent, what the noise floor assumes; above 1: a rank's micro-batches share
    timing drift, which the floor does not count). ``times``, ``modelled``: [steps, world,
    grad_accum]. NaN at grad_accum 1."""
    _, world, accum = times.shape
    if accum < 2:
        return float("nan")
    d = np.log(times / modelled)
    d = d - d.mean(axis=(1, 2), keepdims=True)
    rank_means = d.mean(axis=2)
    within = (d - rank_means[..., None]).var() * accum / (accum - 1)
    # independent: a rank's mean varies by within / accum, less the step's mean's share
    return float(rank_means.var() / (within / accum * (world - 1) / world))


def imbalance(t: np.ndarray) -> float:
    """Mean over steps of max/mean of the ranks' times (``t``: [steps, world])."""
    return float((t.max(axis=1) / t.mean(axis=1)).mean())


def reference_targets(baseline: str | None) -> dict[str, dict[str, Any]]:
    """Plan targets on the 902K reference shape, token-balanced and with the cost model of
    an 8B target on one H100 (coefficients of the order of its FLOP counts; shape-true,
    not measured here), at grad_accum 1 and 4; ``baseline``: also that commit's
    cost-balanced plans."""
    lengths = synth_lengths(SynthSpec(num_samples=902_000))
    h100: dict[str, Any] = {
        "cost_c0": 0.02,
        "cost_tok": 2.3e-5,
        "cost_attn": 4e-10,
        "cost_slot": 3.6e-6,
        "cost_doc": 0.0,
    }  # flex: one target forward per row, no cost per document
    model = np.array(list(h100.values()))
    out = {}
    for accum in (1, 4):
        base = BatchSpec(world_size=8, grad_accum=accum, layout="padded")
        cost_spec = dataclasses.replace(base, **h100)
        rows: list[tuple[str, BatchSpec, str | None]] = [("token-balanced", base, None)]
        if baseline is not None:
            rows.append((f"cost-balanced @{baseline}", cost_spec, baseline))
        rows += [
            ("cost-balanced", cost_spec, None),
            ("cost-balanced, packed", dataclasses.replace(cost_spec, layout="packed"), None),
        ]
        for name, spec, rev in rows:
            runs = [_evaluate(lengths, spec, model, rev) for _ in range(3)]
            r = runs[0]
            r["plan_s"] = min(x["plan_s"] for x in runs)
            r["plan_warm_s"] = min(x["plan_warm_s"] for x in runs)
            out[f"ga {accum}: {name}"] = r
    return out


def _evaluate(lengths: np.ndarray, spec: BatchSpec, model: np.ndarray, rev: str | None):
    """``metrics.evaluate`` by this checkout's planner, or by commit ``rev``'s."""
    if rev is None:
        return metrics.evaluate(lengths, spec, model=model)
    (plan, cold), (following, warm) = plans_at(rev, lengths, spec)
    return {**metrics.summarize(plan, following, model), "plan_s": cold, "plan_warm_s": warm}


def run_shape(
    corpus: Corpus,
    specs: dict[str, BatchSpec],
    baseline: str | None,
    steps: int,
    coef,
    seed: int,
    target,
    drafter,
) -> dict[str, Any]:
    """Plan, time and compare the plans of one grad_accum (``specs``: token and cost)."""
    plans = _plans(corpus, specs, baseline)
    accum = specs["cost"].grad_accum
    t0 = time.perf_counter()
    times, chosen = measure(plans, steps, corpus, target, drafter, seed)
    timed = 2 * steps * 8 * accum * len(plans)
    print(f"\ngrad_accum {accum}: timed {timed} micro-batches ({time.perf_counter() - t0:.0f} s)")
    floor = noise_floor(times, seed)
    rows = {name: _plan_row(p, times[name], chosen[name], coef) for name, p in plans.items()}
    print(
        f"world size 8 x grad_accum {accum}, {steps} sampled steps per plan, each timed twice; "
        f"noise floor {floor:.4f}"
    )
    _print_table(rows)
    _epoch_ratios(rows, times, seed)
    _print_gaps(rows, floor)
    return {
        "noise_floor": floor, "plans": rows,
        "times_s": {name: t.tolist() for name, t in times.items()},
    }  # fmt: skip


def _plans(
    corpus: Corpus, specs: dict[str, BatchSpec], baseline: str | None
) -> dict[str, EpochPlan]:
    """Epoch 0's token-balanced plan, ``baseline``'s cost-balanced one (when given) and
    ours."""
    plans = {"token-balanced": plan_epoch(corpus.lengths, specs["token"], epoch=0)}
    if baseline is not None:
        plans[f"cost @{baseline}"] = plans_at(baseline, corpus.lengths, specs["cost"], (0,))[0][0]
    plans["cost-balanced"] = plan_epoch(corpus.lengths, specs["cost"], epoch=0)
    return plans


def _plan_row(p: EpochPlan, times: np.ndarray, chosen: np.ndarray, coef) -> dict[str, Any]:
    """One plan's measures from its timed steps (``times``: [pass, steps, world, grad_accum]
    of the ``chosen`` steps)."""
    t = times.sum(axis=3)  # a rank's time: its micro-batches of the step
    per_step_max = t.max(axis=2).mean()
    return {
        "steps_per_epoch": p.num_steps,
        "micro_per_epoch": p.num_micro,
        "imbalance_measured": imbalance(t[0]),
        "imbalance_measured_again": imbalance(t[1]),
        "imbalance_modelled": metrics.rank_imbalance(p, metrics.modelled_costs(p, coef)),
        "mean_micro_s": float(t.mean()),
        "ddp_epoch_s": float(p.num_steps * per_step_max),
        "padding_efficiency": float(p.stats["padding_efficiency"]),
        "step_mix_distance": metrics.step_mix_distance(p),
        "rank_coupling": rank_coupling(times[0], modelled_grid(p, chosen, coef)),
    }


def _print_table(rows: dict[str, dict[str, Any]]) -> None:
    """The plans side by side, one line each."""
    titles = ("imb meas", "again", "imb model", "steps", "DDP epoch s", "x token", "eff", "mix")
    widths = (9, 7, 9, 6, 12, 8, 6, 6)
    width = max(len(n) for n in rows) + 1
    print(f"{'':<{width}} " + " ".join(f"{t:>{w}}" for t, w in zip(titles, widths, strict=True)))
    tok = rows["token-balanced"]
    for name, r in rows.items():
        print(
            f"{name:<{width}} {r['imbalance_measured']:>9.4f} "
            f"{r['imbalance_measured_again']:>7.4f} "
            f"{r['imbalance_modelled']:>9.4f} {r['steps_per_epoch']:>6} {r['ddp_epoch_s']:>12.1f} "
            f"{r['ddp_epoch_s'] / tok['ddp_epoch_s']:>8.3f} "
            f"{r['padding_efficiency']:>6.3f} {r['step_mix_distance']:>6.3f}"
        )


def _epoch_ratios(rows: dict[str, dict[str, Any]], times: dict[str, np.ndarray], seed: int) -> None:
    """Each cost plan's DDP epoch over the token-balanced plan's, with its 90% interval over
    the sampled steps: kept in its row and printed."""
    tok = rows["token-balanced"]
    for name, r in rows.items():
        if name != "token-balanced":
            k = r["steps_per_epoch"] / tok["steps_per_epoch"]
            lo, hi = (
                k * v for v in epoch_ratio_interval(times[name], times["token-balanced"], seed)
            )
            r["epoch_ratio"], r["epoch_ratio_90"] = r["ddp_epoch_s"] / tok["ddp_epoch_s"], [lo, hi]
            print(f"{name}: DDP epoch {r['epoch_ratio']:.3f}x token-balanced (90% interval "
                  f"over the sampled steps {lo:.3f}-{hi:.3f})")  # fmt: skip


def _print_gaps(rows: dict[str, dict[str, Any]], floor: float) -> None:
    """Each plan's rank coupling, and how far each cost plan's measured imbalance lies above
    the noise floor (the share of the token-balanced plan's gap it closed)."""
    coupling = ", ".join(f"{n} {r['rank_coupling']:.2f}" for n, r in rows.items())
    print(f"rank coupling (1: a rank's micro-batches err independently, as the floor assumes): "
          f"{coupling}")  # fmt: skip
    gap_tok = rows["token-balanced"]["imbalance_measured"] - floor
    for name, r in rows.items():
        if name == "token-balanced":
            continue
        gap = r["imbalance_measured"] - floor
        closed = 100 * (1 - gap / gap_tok) if gap_tok > 0 else float("nan")
        print(
            f"{name}: {gap:+.4f} above the floor (target <= 0.02), {closed:.0f}% of the "
            f"token-balanced gap ({gap_tok:+.4f}) closed"
        )


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(a) for a in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated integers", param_hint=flag) from None


def calibrate_layouts(corpus, tokens, layouts, target, drafter, calib, plot):
    """Record ``calib`` micro-batches of each layout's token-balanced plan (in that layout)
    and fit each layout's own profile; then say how far a fit carries across layouts: one
    layout's fit predicting the other's micro-batches, and one fit of both judged per
    layout. Returns ``{layout: (report, spec fields)}`` and the cross-layout errors."""
    fits, cross = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for layout in layouts:
            t0 = time.perf_counter()
            spec = dataclasses.replace(tokens, layout=layout)
            runs.append(Path(tmp) / layout)
            record_costs(corpus, plan_epoch(corpus.lengths, spec, epoch=0), target, drafter,
                         calib, runs[-1])  # fmt: skip
            report = calibrate_run(runs[-1], holdout=0.25)
            took = time.perf_counter() - t0
            print(f"calibration, {layout} ({took:.0f} s)\n{report.summary()}")
            fits[layout] = (report, profile_fields(report.profile))  # coefficients, rule, kernel
        drawn = fits[layouts[0]][0].plot
        if plot is not None and drawn is not None:
            shutil.copyfile(drawn, plot)
        if len(runs) > 1:
            cross = cross_layout(runs)
            for fit_on, err in cross.items():
                med, p90 = 100 * err["median_rel_err"], 100 * err["p90_rel_err"]
                print(f"fitted on {fit_on} alone, the other layout predicted: median "
                      f"{med:.1f}%, p90 {p90:.1f}%")  # fmt: skip
            joint = calibrate_run(runs, out=Path(tmp) / "joint.json", holdout=0.25, plot=False)
            print(f"one fit of both layouts:\n{joint.summary()}")
            cross["joint"] = joint.as_dict()
    return fits, cross


@click.command()
@click.option("--samples", type=int, default=20_000, show_default=True)
@click.option(
    "--calibrate", "calib", type=int, default=240, show_default=True,
    help="Micro-batches recorded per layout.",
)  # fmt: skip
@click.option(
    "--steps", type=int, default=12, show_default=True,
    help="Timed steps per plan, at every grad_accum (each step: 8 ranks x grad_accum "
    "micro-batches, each timed twice).",
)  # fmt: skip
@click.option(
    "--grad-accum", "accums", default="1,4", show_default=True,
    help="Micro-batches per rank, comma-separated: each is planned and timed in turn.",
)  # fmt: skip
@click.option(
    "--layouts", default="packed,padded", show_default=True,
    help="Layouts planned and timed (comma-separated); calibration fits them together.",
)  # fmt: skip
@click.option(
    "--baseline", default="", show_default=True,
    help="Also time the cost-balanced plans of this commit's planner (e.g. 157d561, the "
    "scheduler before exact splits and swaps; padded only: it predates packed rows).",
)  # fmt: skip
@click.option("--hidden", type=int, default=64, show_default=True, help="Tiny target width.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Keep calibrate's PNG here."
)
@click.option("--skip-reference", is_flag=True, help="Skip the 902K plan targets.")
def main(
    samples: int, calib: int, steps: int, accums: str, layouts: str, baseline: str,
    hidden: int, threads: int, seed: int, json_out: Path | None, plot: Path | None,
    skip_reference: bool,
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    grad_accums = _ints(accums, "--grad-accum")
    chosen = [x.strip() for x in layouts.split(",") if x.strip()]
    if not chosen or set(chosen) - set(LAYOUTS):
        raise click.BadParameter(f"{layouts!r}: of {', '.join(LAYOUTS)}", param_hint="--layouts")
    corpus = Corpus(samples, seed)
    tokens = BatchSpec(
        token_budget=4096, max_batch_size=64, max_seq_len=1024, world_size=8, seed=seed,
        block_size=BLOCK, anchors_per_doc=PER_DOC, tokens_per_anchor=1, max_anchors=0,
    )  # fmt: skip
    target, drafter = build_models(hidden)
    fits, cross = calibrate_layouts(corpus, tokens, chosen, target, drafter, calib, plot)
    result: dict[str, Any] = {"cross_layout": cross, "by_layout": {}}
    for layout in chosen:
        report, fitted = fits[layout]
        out = result["by_layout"][layout] = {
            "fit": report.as_dict(), "coefficients": report.coefficients,
            "packed_attention": fitted["packed_attention"],
        }  # fmt: skip
        for accum in grad_accums:
            token = dataclasses.replace(
                tokens, layout=layout, grad_accum=accum,
                packed_attention=fitted["packed_attention"],  # the token plans judged by it too
            )  # fmt: skip
            specs = {"token": token, "cost": dataclasses.replace(token, **fitted)}
            print(f"\n== {layout} rows, grad_accum {accum}")
            out[f"grad_accum {accum}"] = run_shape(
                corpus, specs, None if LAYOUTS[layout].packs else baseline or None, steps,
                np.asarray(specs["cost"].coefficients), seed, target, drafter,
            )  # fmt: skip
    if not skip_reference:
        ref = reference_targets(None)
        print("\nplan targets on the 902K reference shape (world size 8); cost imb: by the")
        print("8B/H100 model")
        print(metrics.format_table(ref))
        result["reference"] = {
            k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)} for k, v in ref.items()
        }
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
