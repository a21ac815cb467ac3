"""Measures of the batching experiment (``benchmarks.experiment.run``): loss spikiness, the length
mix of every step, and held-out loss per length band.

* **Spikiness** of a training-loss series ``l_1..l_n`` (after a burn-in that skips the
  fast initial descent): ``diff_std`` = std of ``l_t - l_{t-1}``; ``max_jump`` = the
  largest single-step increase; ``spike_frac`` = the fraction of steps whose increase
  exceeds a threshold shared by all specs of a seed (twice the pooled ``diff_std``), so
  the fraction compares specs on one yardstick; ``resid_std`` = std of the loss around its
  centered rolling mean (noise with the trend removed).
* **Step mix**: the plan is a pure function of (lengths, spec, seed, epoch), so each logged
  step's samples are known exactly; ``hard_frac`` is the share of them at or above the
  corpus's difficulty split (the synth median length). The reconstruction is checked
  against the tokens each step logged. ``corr_resid_hard`` correlates it with the loss
  residual: the mechanism behind the spikes. ``all_hard_frac`` is the share of steps with
  no short (easy) sample at all.
* **Held-out loss per band**: the final checkpoint's drafter, the same weighted block CE
  as training (``trainer.model.loss.draft_loss``), on held-out samples grouped into 4 bands at
  the quartiles of their lengths. Batches and anchor generators are fixed, so every
  drafter is scored on exactly the same blocks (a paired comparison).
* **tau** (``--corpus text``): the trainer's verifier on the held-out prompts, at step 0 (the
  untrained drafter), every ``eval_every`` steps and at the end (``metrics.jsonl``).
* **Forgetting** (``--corpus text``): the held-out loss of the shortest band at every
  checkpoint (every ``ckpt_every`` steps). For each interval between two checkpoints,
  ``long_only`` is the share of its steps that held no sample below the split length, and
  ``delta`` the change of that loss over the interval. Forgetting shows as ``delta > 0``
  where ``long_only`` is high: ``forgetting_corr`` correlates the two, and
  ``delta_long``/``delta_mixed`` average ``delta`` over intervals with ``long_only`` at least
  ``LONG_RUN`` and below it.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

NUM_BANDS = 4
ROLLING_WINDOW = 21
EVAL_TOKEN_BUDGET = 8192
EVAL_SEED = 20240611
#: An interval of steps counts as a long-only run when at least this share of its steps
#: held no short sample.
LONG_RUN = 0.5


def rolling_mean(x: np.ndarray, window: int = ROLLING_WINDOW) -> np.ndarray:
    """Centered moving average; windows shrink at the ends (no padding bias)."""
    x = np.asarray(x, dtype=np.float64)
    half = window // 2
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, x.size)
    return (c[hi] - c[lo]) / (hi - lo)


def spikiness(losses: Sequence[float], *, threshold: float | None = None) -> dict[str, Any]:
    """Spikiness of one loss series (see the module docstring); ``spike_frac`` only when a
    ``threshold`` (an increase in loss units) is given. Fewer than 3 losses (a short run
    whose steps held no anchor) measure nothing: every value is None, as for a missing
    measure, and summaries and paired differences leave the run out."""
    x = np.asarray(losses, dtype=np.float64)
    if x.ndim != 1 or not np.isfinite(x).all():
        raise ValueError(f"need a series of finite losses, got {losses!r}")
    if x.size < 3:
        keys = ["diff_std", "max_jump", "resid_std"] + ["spike_frac"] * (threshold is not None)
        return {"num_steps": int(x.size), **dict.fromkeys(keys)}
    d = np.diff(x)
    out: dict[str, Any] = {
        "num_steps": int(x.size),
        "diff_std": float(d.std(ddof=1)),
        "max_jump": float(d.max()),
        "resid_std": float((x - rolling_mean(x)).std(ddof=1)),
    }
    if threshold is not None:
        out["spike_frac"] = float((d > threshold).mean())
    return out


def pooled_diff_std(series: Sequence[Sequence[float]]) -> float | None:
    """Std of the step-to-step changes of several series taken together (None for fewer
    than two changes)."""
    d = np.concatenate(
        [np.diff(np.asarray(s, np.float64)) for s in series if len(s) > 1] or [np.empty(0)]
    )
    return float(d.std(ddof=1)) if d.size > 1 else None


# ---- runs ---------------------------------------------------------------------------------


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(config.json, training records)``; records are the optimizer steps 1..n."""
    from trainer.train.metrics import metrics_path, read_metrics

    config = json.loads((run_dir / "config.json").read_text())
    served = run_dir / "loader_spec.json"  # the spec the daemon served (trainer writes it)
    if served.is_file():
        config["loader_spec"] = json.loads(served.read_text())
    records = [r for r in read_metrics(metrics_path(run_dir)) if r["step"] >= 1]
    if [r["step"] for r in records] != list(range(1, len(records) + 1)):
        raise ValueError(f"{run_dir}: metrics.jsonl does not hold steps 1..n once each")
    return config, records


def effective_spec(config: dict[str, Any]) -> Any:
    """The BatchSpec the daemon planned this run with (as served, else its defaults + the
    trainer's fields)."""
    from loader_server.wire.spec import BatchSpec

    spec = config.get("loader_spec") or config["requested_loader_spec"]
    return BatchSpec.from_dict({**spec, "world_size": config["world_size"]})


def step_hard_frac(
    records: list[dict[str, Any]], spec: Any, lengths: np.ndarray, split_len: float
) -> np.ndarray:
    """Per logged step, the share of its samples with length >= ``split_len`` (rank 0 of a
    world of one), from the deterministic plan; checks the plan's tokens against the log."""
    from loader_server.planning.planner import plan_epoch

    if spec.world_size != 1:
        raise ValueError("the step mix is reconstructed for a world of one")
    eff = np.minimum(lengths, spec.max_seq_len)
    plans: dict[int, Any] = {}
    within: dict[int, int] = {}
    out = np.empty(len(records))
    for i, rec in enumerate(records):
        e = int(rec["epoch"])
        plan = plans.setdefault(e, plan_epoch(lengths, spec, epoch=e))
        s = within.get(e, 0)
        within[e] = s + 1
        ids = np.concatenate([plan.micro(s, 0, m) for m in range(spec.grad_accum)])
        if int(eff[ids].sum()) != rec["tokens"]:
            raise RuntimeError(
                f"step {rec['step']}: the plan gives {int(eff[ids].sum())} tokens, the run "
                f"logged {rec['tokens']}: the reconstructed spec is not the daemon's"
            )
        out[i] = float((lengths[ids] >= split_len).mean())
    return out


def plan_quality(spec: Any, lengths: np.ndarray) -> dict[str, float]:
    """Padding efficiency, composition repeat (epoch 0 -> 1) and step mix distance."""
    from loader_server.planning import metrics
    from loader_server.planning.planner import plan_epoch

    s = metrics.summarize(plan_epoch(lengths, spec, epoch=0), plan_epoch(lengths, spec, epoch=1))
    keys = ("padding_efficiency", "composition_repeat", "step_mix_distance", "num_steps")
    return {k: s[k] for k in keys}


def loss_series(records: list[dict[str, Any]], burn_in: float) -> tuple[np.ndarray, np.ndarray]:
    """``(indices into records, losses)`` after the burn-in, steps with no loss left out."""
    skip = int(burn_in * len(records))
    idx = np.array([i for i in range(skip, len(records)) if records[i]["loss"] is not None])
    return idx, np.array([records[i]["loss"] for i in idx], dtype=np.float64)


# ---- held-out loss ------------------------------------------------------------------------


def length_bands(lengths: np.ndarray, num_bands: int = NUM_BANDS) -> np.ndarray:
    """Band of every sample: 0..num_bands-1, cut at the quantiles of ``lengths``."""
    edges = np.quantile(lengths, np.arange(1, num_bands) / num_bands)
    return np.searchsorted(edges, lengths, side="left")


def heldout_batches(path: Path, band: np.ndarray, token_budget: int = EVAL_TOKEN_BUDGET):
    """Padded batches of one band each (length-sorted, ``rows x longest <= token_budget``)."""
    from loader_server.data.dataset import open_dataset
    from trainer.train.batches import pad_batch

    ds = open_dataset(path)
    out = []
    for b in range(int(band.max()) + 1):
        ids = np.flatnonzero(band == b)
        ids = ids[np.argsort(ds.lengths[ids], kind="stable")]
        rows: list[int] = []
        for i in [*ids.tolist(), None]:
            if i is not None and (len(rows) + 1) * int(ds.lengths[i]) <= token_budget:
                rows.append(i)
                continue
            if rows:
                samples = [(ds.input_ids(r).tolist(), ds.loss_mask(r).tolist()) for r in rows]
                out.append((b, pad_batch(samples)))
            rows = [] if i is None else [i]
    return out


def frozen_features(target: Any) -> Any:
    """``target`` whose ``train_features`` are computed once per input tensor and then
    reused: the held-out batches are fixed and the target is frozen, so every drafter and
    checkpoint scored on them needs the same features (``heldout_loss`` on each of a run's
    checkpoints ran the target's forward again each time). The same weights, no copy."""
    from trainer.model.target import Target

    class FrozenFeatures(Target):
        def __init__(self) -> None:
            super().__init__(target.model, target.layer_ids)
            self._memo: dict[tuple[int, int, str], tuple[Any, Any, Any]] = {}

        def train_features(self, input_ids: Any, position_ids: Any = None,
                           attention: str = "sdpa") -> Any:  # fmt: skip
            key = (id(input_ids), id(position_ids), attention)
            hit = self._memo.get(key)
            if hit is not None and hit[0] is input_ids and hit[1] is position_ids:
                return hit[2]  # the same tensors (kept alive here, so no id is reused)
            feats = super().train_features(input_ids, position_ids, attention)
            self._memo[key] = (input_ids, position_ids, feats)
            return feats

    return FrozenFeatures()


def heldout_loss(target: Any, drafter: Any, batches: list, loss_cfg: Any) -> dict[str, Any]:
    """Weighted block CE and accuracy per band and overall, on fixed anchors."""
    import torch

    from trainer.model.loss import draft_loss

    num_bands = max(b for b, _ in batches) + 1
    sums = np.zeros((num_bands, 4))  # weighted CE, weight, hits, slots
    drafter.eval()
    with torch.no_grad():
        for i, (b, batch) in enumerate(batches):
            gen = torch.Generator().manual_seed(EVAL_SEED + i)
            out = draft_loss(target, drafter, batch, loss_cfg, gen)
            sums[b] += [
                float(out.weighted_ce_sum),
                float(out.weight_sum),
                float(out.correct.sum()),
                float(out.count.sum()),
            ]
    tot = sums.sum(0)
    return {
        "loss": [float(s[0] / s[1]) for s in sums],
        "acc": [float(s[2] / s[3]) for s in sums],
        "loss_all": float(tot[0] / tot[1]),
        "acc_all": float(tot[2] / tot[3]),
    }


def load_drafter(path: Path) -> tuple[Any, Any]:
    """The drafter of checkpoint ``path`` and that checkpoint's record."""
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.train import checkpoint as ckpt
    from trainer.train.distributed import local_env

    saved, _ = ckpt.load_checkpoint(path, local_env())
    drafter = DFlashDrafter(DrafterConfig(**saved.drafter_config))
    drafter.load_state_dict(saved.drafter)
    return drafter, saved


def load_final_drafter(run_dir: Path) -> tuple[Any, Any]:
    """The drafter of the run's newest checkpoint and that checkpoint's record."""
    from trainer.train import checkpoint as ckpt

    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint")
    return load_drafter(path)


# ---- everything ---------------------------------------------------------------------------


def _stats(values: list[float | None]) -> dict[str, Any]:
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def split_length(cfg: Any, lengths: np.ndarray) -> float:
    """The length that splits short from long: the synthetic corpus's difficulty split (its
    median setting), the text corpus's median length."""
    return float(cfg.median_len) if cfg.corpus == "synthetic" else float(np.median(lengths))


def tau_series(run_dir: Path) -> dict[str, list[float]]:
    """The verifier's tau at every step it was measured (step 0: the untrained drafter):
    ``tau`` (z-lab's per-prompt mean, the published statistic) and ``tau_served`` (pooled
    over the served steps, the one vLLM's counters give)."""
    from trainer.train.metrics import metrics_path, read_metrics

    recs = [r for r in read_metrics(metrics_path(run_dir)) if "tau" in r]
    return {
        "step": [int(r["step"]) for r in recs],
        "tau": [float(r["tau"]) for r in recs],
        "tau_served": [float(r["tau_served"]) for r in recs],
    }


def forgetting(
    steps: Sequence[int], short_loss: Sequence[float], all_hard: np.ndarray
) -> dict[str, Any]:
    """Forgetting measures (module docstring) from the shortest band's held-out loss at
    checkpoint ``steps`` and, per optimizer step 1..n, whether it held no short sample."""
    s = np.asarray(steps, dtype=np.int64)
    loss = np.asarray(short_loss, dtype=np.float64)
    if s.size != loss.size or s.size < 2 or np.any(np.diff(s) <= 0) or s[0] < 0:
        raise ValueError(f"need >= 2 increasing checkpoint steps with a loss each, got {steps}")
    if s[-1] > all_hard.size:
        raise ValueError(f"checkpoint step {s[-1]} is past the {all_hard.size} logged steps")
    long_only = np.array([all_hard[a:b].mean() for a, b in itertools.pairwise(s)])
    delta = np.diff(loss)
    long_iv, mixed_iv = long_only >= LONG_RUN, long_only < LONG_RUN
    spread = long_only.std() > 0 and delta.std() > 0
    return {
        "steps": s.tolist(),
        "short_loss": loss.tolist(),
        "long_only": long_only.tolist(),
        "delta": delta.tolist(),
        "forgetting_corr": float(np.corrcoef(long_only, delta)[0, 1]) if spread else None,
        "long_intervals": int(long_iv.sum()),
        "delta_long": float(delta[long_iv].mean()) if long_iv.any() else None,
        "delta_mixed": float(delta[mixed_iv].mean()) if mixed_iv.any() else None,
        "rises_in_long": int((delta[long_iv] > 0).sum()),
    }


def _run_measures(cfg: Any, name: str, lengths: np.ndarray) -> dict[str, Any]:
    config, records = read_run(cfg.out_dir / "runs" / name)
    spec = effective_spec(config)
    idx, losses = loss_series(records, cfg.burn_in)
    all_frac = step_hard_frac(records, spec, lengths, split_length(cfg, lengths))
    hard = all_frac[idx]
    resid = losses - rolling_mean(losses)
    corr = float(np.corrcoef(hard, resid)[0, 1]) if hard.std() > 0 and resid.std() > 0 else None
    tail = losses[-max(1, len(losses) // 10) :]
    summary = json.loads((cfg.out_dir / "runs" / name / "summary.json").read_text())
    real = np.cumsum([int(r["tokens"]) for r in records])  # unpadded tokens trained
    return {
        "config": config,
        "plan": plan_quality(spec, lengths),
        "final_loss": float(tail.mean()),
        "real_tokens": int(real[-1]),
        "hard_frac_std": float(hard.std()),
        "all_hard_frac": float((hard == 1.0).mean()),
        "corr_resid_hard": corr,
        "median_steps_per_s": summary.get("median_steps_per_s"),
        "series": {
            "step": [records[i]["step"] for i in idx],
            "loss": losses.tolist(),
            "hard_frac": hard.tolist(),
            "real_tokens": real[idx].tolist(),
        },
        "all_hard": (all_frac == 1.0).tolist(),
    }


def analyse(
    cfg: Any,
    train_path: Path,
    heldout_path: Path,
    served: dict[str, Any] | None = None,
    humaneval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """All measures of every (spec, seed) run of ``cfg`` plus a per-spec summary;
    ``served``: vLLM's acceptance by run (``benchmarks.experiment.served``); ``humaneval``:
    HumanEval tau by run (``benchmarks.experiment.humaneval``)."""
    import torch

    from loader_server.data.dataset import open_dataset
    from trainer.model.target import target_from_options
    from trainer.run import build_drafter
    from trainer.sections import RunOptions

    torch.set_num_threads(cfg.threads)
    lengths = open_dataset(train_path).lengths
    held_lengths = open_dataset(heldout_path).lengths
    band = length_bands(held_lengths)
    batches = heldout_batches(heldout_path, band)
    split = split_length(cfg, lengths)
    runs: dict[str, dict[str, Any]] = {}
    for seed in cfg.seeds:
        names = [cfg.run_name(spec, seed) for spec in cfg.specs]
        for spec, name in zip(cfg.specs, names, strict=True):
            runs[name] = {"spec": spec, "seed": seed, **_run_measures(cfg, name, lengths)}
        pooled = pooled_diff_std([runs[n]["series"]["loss"] for n in names])
        threshold = None if pooled is None else 2 * pooled
        equal = min(runs[n]["real_tokens"] for n in names)  # what every run of the seed trained
        for n in names:
            runs[n]["spike_threshold"] = threshold
            runs[n]["spikiness"] = spikiness(runs[n]["series"]["loss"], threshold=threshold)
            runs[n]["at_equal_tokens"] = at_tokens(runs[n]["series"], equal)

    target, untrained = None, None
    for name, run in runs.items():
        drafter, saved = load_final_drafter(cfg.out_dir / "runs" / name)
        opts = RunOptions.read(cfg.out_dir / "runs" / name)
        layer_ids = list(saved.meta["layer_ids"])
        if target is None:  # every run has the same target options (one command line)
            target = frozen_features(target_from_options(opts, "cpu", layer_ids))
        if layer_ids != target.layer_ids:
            raise ValueError(f"{name}: target layers {layer_ids} differ from {target.layer_ids}")
        loss_cfg = _eval_loss_config(saved.loss_config, cfg.eval_anchors)
        run["heldout"] = heldout_loss(target, drafter, batches, loss_cfg)
        if untrained is None:  # the same init as every run of this seed (trainer.run)
            fresh = build_drafter(target, replace(opts, seed=run["seed"]), "cpu")
            untrained = heldout_loss(target, fresh, batches, loss_cfg)
        log.info("%s: held-out loss %.4f", name, run["heldout"]["loss_all"])
        if cfg.corpus == "text":
            run_dir = cfg.out_dir / "runs" / name
            run["tau"] = tau_series(run_dir)
            run["forgetting"] = _forgetting(run_dir, run, target, batches, loss_cfg)
            run["at_equal_tokens"]["heldout"] = _heldout_at(
                run_dir, run["at_equal_tokens"]["tokens"], target, batches, loss_cfg
            )
        if served and name in served:
            run["vllm"] = served[name]
        if humaneval and name in humaneval:
            run["humaneval"] = humaneval[name]
    corpus = _corpus_facts(lengths, held_lengths, band, split)
    if cfg.corpus == "text":
        from benchmarks.experiment.looping import looping

        loops = looping(cfg, heldout_path)
        corpus["heldout_replies_distinct_4grams"] = loops["target"]
        corpus["heldout_references_distinct_4grams"] = loops["reference"]
        corpus["heldout_looping_by_kind"] = loops["by_kind"]
    from benchmarks.experiment.run import CONTRASTS

    ref = reference_of(cfg.specs)
    return {
        "config": {**cfg.fixed_part(), "seeds": list(cfg.seeds), "specs": list(cfg.specs)},
        "corpus": corpus,
        "untrained": untrained,
        "runs": runs,
        "summary": {spec: _summarize_spec(runs, spec) for spec in cfg.specs},
        "reference": ref,
        "paired": {s: paired(runs, s, ref, cfg.seeds) for s in cfg.specs if s != ref},
        "contrasts": {
            f"{a} - {b}": paired(runs, a, b, cfg.seeds)
            for a, b in CONTRASTS
            if a in cfg.specs and b in cfg.specs
        },
    }


def reference_of(specs: Sequence[str]) -> str:
    """What the other specs are compared with: ``stratified``, the padded default before
    packed rows, when run."""
    return "stratified" if "stratified" in specs else specs[0]


def at_tokens(series: dict[str, list], tokens: int) -> dict[str, Any]:
    """The run at ``tokens`` unpadded tokens trained (the least any run of its seed
    trained): its step there and its training loss, the rolling mean at that step (so a
    spec that packs more real tokens per step is compared at equal data, not equal steps)."""
    real = np.asarray(series["real_tokens"], dtype=np.int64)
    if real.size == 0:  # no step of the run had a loss
        return {"tokens": int(tokens), "step": None, "train_loss": None}
    i = max(int(np.searchsorted(real, tokens, side="right")) - 1, 0)
    return {
        "tokens": int(tokens),
        "step": int(series["step"][i]),
        "train_loss": float(rolling_mean(np.asarray(series["loss"]))[i]),
    }


def paired(runs: dict[str, dict[str, Any]], spec: str, ref: str, seeds: Sequence[int]) -> dict:
    """Per-seed paired differences ``spec - ref`` of each measure, with bootstrap 95%
    intervals (``benchmarks.experiment.stats``); a measure some run lacks is left out."""
    from benchmarks.experiment.stats import paired_mean, paired_tau

    by = {(r["spec"], r["seed"]): r for r in runs.values()}
    pairs = [(by[spec, s], by[ref, s]) for s in seeds]
    measures: dict[str, Any] = {
        "heldout_all": lambda r: r["heldout"]["loss_all"],
        **{f"heldout_band{b}": (lambda r, b=b: r["heldout"]["loss"][b])
           for b in range(len(pairs[0][0]["heldout"]["loss"]))},
        "diff_std": lambda r: r["spikiness"]["diff_std"],
        "final_loss": lambda r: r["final_loss"],
        "train_loss_at_equal_tokens": lambda r: r["at_equal_tokens"]["train_loss"],
        "heldout_all_at_equal_tokens": lambda r: r["at_equal_tokens"]["heldout"]["loss_all"],
        "tau_final": lambda r: r["tau"]["tau"][-1],
        "vllm_tau": lambda r: r["vllm"]["tau"],
        "humaneval_tau": lambda r: r["humaneval"]["tau"],
    }  # fmt: skip
    out: dict[str, Any] = {}
    for name, get in measures.items():
        try:
            diffs = [float(get(a)) - float(get(b)) for a, b in pairs]
        except (KeyError, IndexError, TypeError):
            continue
        out[name] = paired_mean(diffs)
    try:  # vLLM on every held-out prompt: prompts resampled too
        counts = [[np.asarray(r["vllm"]["heldout"]["per_prompt"]) for r in pair] for pair in pairs]
    except KeyError:
        return out
    out["vllm_tau_heldout"] = paired_tau([a for a, _ in counts], [b for _, b in counts])
    return out


def _heldout_at(
    run_dir: Path, tokens: int, target: Any, batches: list, loss_cfg: Any
) -> dict[str, Any] | None:
    """Held-out loss of the newest checkpoint at or below ``tokens`` real tokens trained
    (checkpoints every ``ckpt_every`` steps), and its step; None if none is."""
    from trainer.train import checkpoint as ckpt
    from trainer.train.metrics import metrics_path, read_metrics

    real = {r["step"]: r["tokens"] for r in read_metrics(metrics_path(run_dir)) if r["step"] >= 1}
    done = np.cumsum([real[s] for s in sorted(real)])
    best = None
    for path in ckpt.list_checkpoints(run_dir):
        step = int(path.name.split("-")[-1])
        if 0 < step <= done.size and done[step - 1] <= tokens:
            best = (step, path)
    if best is None:
        return None
    drafter, _ = load_drafter(best[1])
    return {"step": best[0], "tokens": int(done[best[0] - 1]),
            **heldout_loss(target, drafter, batches, loss_cfg)}  # fmt: skip


def _forgetting(
    run_dir: Path, run: dict[str, Any], target: Any, batches: list, loss_cfg: Any
) -> dict[str, Any]:
    """The shortest band's held-out loss at every checkpoint of the run (and at step 0, the
    untrained drafter of its seed), then ``forgetting``."""
    from trainer.train import checkpoint as ckpt

    short = [(b, batch) for b, batch in batches if b == 0]
    steps, losses = [], []
    for path in ckpt.list_checkpoints(run_dir):
        drafter, saved = load_drafter(path)
        steps.append(saved.step)
        losses.append(heldout_loss(target, drafter, short, loss_cfg)["loss"][0])
    return forgetting(steps, losses, np.asarray(run["all_hard"], dtype=np.float64))


def _eval_loss_config(saved: dict[str, Any], anchors_per_doc: int) -> Any:
    """One measure for every run, whatever it trained: the position-decay weights of
    Parts 1-3 (``MEASURE_GAMMA``, whatever the run's weighting or gamma), every document's
    ``anchors_per_doc`` anchors drawn from each batch's fixed generator."""
    from trainer.model.blocks import LossConfig

    keep = ("block_size", "selector_alpha")
    return LossConfig(**{k: saved[k] for k in keep}, anchors_per_doc=anchors_per_doc,
                      tokens_per_anchor=1, anchor_draw="micro-batch", weighting="decay",
                      gamma=MEASURE_GAMMA)  # fmt: skip


#: The held-out measure's position decay (the trainer's default gamma before Part 4).
MEASURE_GAMMA = 7.0


def _corpus_facts(
    lengths: np.ndarray, held: np.ndarray, band: np.ndarray, split_len: float
) -> dict[str, Any]:
    def facts(x: np.ndarray) -> dict[str, Any]:
        return {
            "samples": int(x.size),
            "tokens": int(x.sum(dtype=np.int64)),
            "median_len": float(np.median(x)),
            "max_len": int(x.max()),
            "hard_frac": float((x >= split_len).mean()),
        }

    bands = [
        {
            "band": b,
            "min_len": int(held[band == b].min()),
            "max_len": int(held[band == b].max()),
            "samples": int((band == b).sum()),
            "hard_frac": float((held[band == b] >= split_len).mean()),
        }
        for b in range(int(band.max()) + 1)
    ]
    return {"train": facts(lengths), "heldout": facts(held), "split_len": split_len, "bands": bands}


def _summarize_spec(runs: dict[str, dict[str, Any]], spec: str) -> dict[str, Any]:
    mine = [r for r in runs.values() if r["spec"] == spec]
    keys = dict.fromkeys(k for r in mine for k in r["spikiness"])  # spike_frac: some seeds
    out: dict[str, Any] = {k: _stats([r["spikiness"].get(k) for r in mine]) for k in keys}
    out.pop("num_steps")
    for k in ("final_loss", "hard_frac_std", "all_hard_frac", "corr_resid_hard"):
        out[k] = _stats([r[k] for r in mine])
    for k in ("padding_efficiency", "composition_repeat", "step_mix_distance"):
        out[k] = _stats([r["plan"][k] for r in mine])
    out["heldout_all"] = _stats([r["heldout"]["loss_all"] for r in mine])
    out["real_tokens"] = _stats([r["real_tokens"] for r in mine])
    out["train_loss_at_equal_tokens"] = _stats([r["at_equal_tokens"]["train_loss"] for r in mine])
    nb = len(mine[0]["heldout"]["loss"])
    out["heldout_band"] = [_stats([r["heldout"]["loss"][b] for r in mine]) for b in range(nb)]
    out["heldout_acc_all"] = _stats([r["heldout"]["acc_all"] for r in mine])
    if "tau" in mine[0]:
        out["tau_final"] = _stats([r["tau"]["tau"][-1] if r["tau"]["tau"] else None for r in mine])
        out["tau_start"] = _stats([r["tau"]["tau"][0] if r["tau"]["tau"] else None for r in mine])
        for k in ("forgetting_corr", "delta_long", "delta_mixed", "long_intervals"):
            out[k] = _stats([r["forgetting"][k] for r in mine])
        served = [r["tau"]["tau_served"][-1] if r["tau"]["tau_served"] else None for r in mine]
        out["tau_served_final"] = _stats(served)
    if all("vllm" in r for r in mine):
        out["vllm_tau"] = _stats([r["vllm"]["tau"] for r in mine])
        out["vllm_tau_heldout"] = _stats([r["vllm"]["heldout"]["tau"] for r in mine])
    if all("humaneval" in r for r in mine):
        out["humaneval_tau"] = _stats([r["humaneval"]["tau"] for r in mine])
    return out
