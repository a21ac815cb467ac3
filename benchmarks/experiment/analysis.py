"""The batching experiment's runs read back and scored (``benchmarks.experiment.run``): each
run's config and training records, the step mix reconstructed from its plan, the held-out
loss of its checkpoints' drafters, tau, and ``analyse``, which gathers every measure of every
run into the results dict. The measures are defined, and computed from the numbers, in
``benchmarks.experiment.measures``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.experiment.arms import CONTRASTS

# Callers (the experiment's tests) import some of these measures from here too.
from benchmarks.experiment.measures import (
    acceptance_by_position,
    at_tokens,
    corpus_facts,
    forgetting,
    length_bands,
    paired,
    pooled_diff_std,
    reference_of,
    rolling_mean,
    spikiness,
    split_length,
    summarize_spec,
    weight_change,
)

log = logging.getLogger(__name__)

EVAL_TOKEN_BUDGET = 8192
EVAL_SEED = 20240611
#: The held-out measure's position decay (the trainer's default gamma before Part 4).
MEASURE_GAMMA = 7.0


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
                float(out.divisor),
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
    from trainer.train.checkpoint import load_checkpoint
    from trainer.train.distributed import local_env

    saved, _ = load_checkpoint(path, local_env())
    drafter = DFlashDrafter(DrafterConfig(**saved.drafter_config))
    drafter.load_state_dict(saved.drafter)
    return drafter, saved


def load_final_drafter(run_dir: Path) -> tuple[Any, Any]:
    """The drafter of the run's newest checkpoint and that checkpoint's record."""
    from trainer.train.checkpoint import latest_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint")
    return load_drafter(path)


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


# ---- everything ---------------------------------------------------------------------------


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

    torch.set_num_threads(cfg.threads)
    lengths = open_dataset(train_path).lengths
    held_lengths = open_dataset(heldout_path).lengths
    band = length_bands(held_lengths)
    batches = heldout_batches(heldout_path, band)
    split = split_length(cfg, lengths)
    runs = _training_measures(cfg, lengths)
    untrained = _score_drafters(cfg, runs, batches)
    for name, run in runs.items():
        if served and name in served:
            run["vllm"] = served[name]
            for counts in (run["vllm"], run["vllm"]["heldout"]):
                counts["by_position"] = acceptance_by_position(
                    counts["drafts"], counts["per_pos"], cfg.block_size - 1
                )
        if humaneval and name in humaneval:
            run["humaneval"] = humaneval[name]
    corpus = _corpus(cfg, heldout_path, corpus_facts(lengths, held_lengths, band, split))
    return {
        "config": {**cfg.fixed_part(), "seeds": list(cfg.seeds), "specs": list(cfg.specs)},
        "corpus": corpus,
        "untrained": untrained,
        "runs": runs,
        **_comparisons(cfg, runs),
    }


def _run_measures(cfg: Any, name: str, lengths: np.ndarray) -> dict[str, Any]:
    """The measures of one run's training: its plan, losses and step mix."""
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


def _training_measures(cfg: Any, lengths: np.ndarray) -> dict[str, dict[str, Any]]:
    """Every run's training measures (``_run_measures``), then those shared by a seed."""
    runs: dict[str, dict[str, Any]] = {}
    for seed in cfg.seeds:
        names = [cfg.run_name(spec, seed) for spec in cfg.specs]
        for spec, name in zip(cfg.specs, names, strict=True):
            runs[name] = {"spec": spec, "seed": seed, **_run_measures(cfg, name, lengths)}
        _measure_seed([runs[n] for n in names])
    return runs


def _measure_seed(mine: list[dict[str, Any]]) -> None:
    """Spikiness of one seed's runs on one yardstick (twice their pooled ``diff_std``), and
    each run at the real tokens every run of the seed trained."""
    pooled = pooled_diff_std([r["series"]["loss"] for r in mine])
    threshold = None if pooled is None else 2 * pooled
    equal = min(r["real_tokens"] for r in mine)  # what every run of the seed trained
    for r in mine:
        r["spike_threshold"] = threshold
        r["spikiness"] = spikiness(r["series"]["loss"], threshold=threshold)
        r["at_equal_tokens"] = at_tokens(r["series"], equal)


def _score_drafters(
    cfg: Any, runs: dict[str, dict[str, Any]], batches: list
) -> dict[str, Any] | None:
    """Every run's final drafter scored on the held-out batches (text: also tau, forgetting
    and the held-out loss at equal tokens); returns the untrained drafter's score."""
    from trainer.model.target import target_from_options
    from trainer.run import build_drafter
    from trainer.sections import RunOptions

    target, untrained = None, None
    for name, run in runs.items():
        run_dir = cfg.out_dir / "runs" / name
        drafter, saved = load_final_drafter(run_dir)
        opts = RunOptions.read(run_dir)
        layer_ids = list(saved.meta["layer_ids"])
        if target is None:  # every run has the same target options (one command line)
            target = frozen_features(target_from_options(opts, "cpu", layer_ids))
        if layer_ids != target.layer_ids:
            raise ValueError(f"{name}: target layers {layer_ids} differ from {target.layer_ids}")
        loss_cfg = _eval_loss_config(saved.loss_config, cfg.eval_anchors)
        run["heldout"] = heldout_loss(target, drafter, batches, loss_cfg)
        if untrained is None and run["spec"] == reference_of(cfg.specs):
            # the reference's start (an arm may train another depth): trainer.run's seeding
            fresh = build_drafter(target, replace(opts, seed=run["seed"]), "cpu")
            untrained = heldout_loss(target, fresh, batches, loss_cfg)
        log.info("%s: held-out loss %.4f", name, run["heldout"]["loss_all"])
        if cfg.corpus == "text":
            run["tau"] = tau_series(run_dir)
            run["forgetting"] = _forgetting(run_dir, run, target, batches, loss_cfg)
            run["weights"] = _weights_moved(run_dir)
            run["at_equal_tokens"]["heldout"] = _heldout_at(
                run_dir, run["at_equal_tokens"]["tokens"], target, batches, loss_cfg
            )
    return untrained


def _corpus(cfg: Any, heldout_path: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """The corpus ``facts``, and for text how much the held-out replies loop
    (``benchmarks.experiment.looping``)."""
    if cfg.corpus == "text":
        from benchmarks.experiment.looping import looping

        loops = looping(cfg, heldout_path)
        facts["heldout_replies_distinct_4grams"] = loops["target"]
        facts["heldout_references_distinct_4grams"] = loops["reference"]
        facts["heldout_looping_by_kind"] = loops["by_kind"]
    return facts


def _comparisons(cfg: Any, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The per-spec summary, the reference and the paired differences: every spec minus the
    reference, and the arms' contrasts (``arms.CONTRASTS``) whose specs both ran."""
    ref = reference_of(cfg.specs)
    return {
        "summary": {spec: summarize_spec(runs, spec) for spec in cfg.specs},
        "reference": ref,
        "paired": {s: paired(runs, s, ref, cfg.seeds) for s in cfg.specs if s != ref},
        "contrasts": {
            f"{a} - {b}": paired(runs, a, b, cfg.seeds)
            for a, b in CONTRASTS
            if a in cfg.specs and b in cfg.specs
        },
    }


def _heldout_at(
    run_dir: Path, tokens: int, target: Any, batches: list, loss_cfg: Any
) -> dict[str, Any] | None:
    """Held-out loss of the newest checkpoint at or below ``tokens`` real tokens trained
    (checkpoints every ``ckpt_every`` steps), and its step; None if none is."""
    from trainer.train.checkpoint import list_checkpoints
    from trainer.train.metrics import metrics_path, read_metrics

    real = {r["step"]: r["tokens"] for r in read_metrics(metrics_path(run_dir)) if r["step"] >= 1}
    done = np.cumsum([real[s] for s in sorted(real)])
    best = None
    for path in list_checkpoints(run_dir):
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
    from trainer.train.checkpoint import list_checkpoints

    short = [(b, batch) for b, batch in batches if b == 0]
    steps, losses = [], []
    for path in list_checkpoints(run_dir):
        drafter, saved = load_drafter(path)
        steps.append(saved.step)
        losses.append(heldout_loss(target, drafter, short, loss_cfg)["loss"][0])
    return forgetting(steps, losses, np.asarray(run["all_hard"], dtype=np.float64))


def _weights_moved(run_dir: Path) -> dict[str, Any]:
    """``weight_change`` of the drafter's matrices from the run's first checkpoint to its
    last: how far each optimizer moved them, and along how many directions."""
    from trainer.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    first, last = (load_drafter(found[i])[0].state_dict() for i in (0, -1))
    out = weight_change(
        {k: v.double().numpy() for k, v in first.items()},
        {k: v.double().numpy() for k, v in last.items()},
    )
    out["steps"] = [int(found[i].name.split("-")[-1]) for i in (0, -1)]
    return out


def _eval_loss_config(saved: dict[str, Any], anchors_per_doc: int) -> Any:
    """One measure for every run, whatever it trained: the position-decay weights of
    Parts 1-3 (``MEASURE_GAMMA``, whatever the run's weighting or gamma), every document's
    ``anchors_per_doc`` anchors drawn from each batch's fixed generator."""
    from trainer.model.blocks import LossConfig

    keep = ("block_size", "selector_alpha")
    return LossConfig(**{k: saved[k] for k in keep}, anchors_per_doc=anchors_per_doc,
                      tokens_per_anchor=1, anchor_draw="micro-batch", weighting="decay",
                      gamma=MEASURE_GAMMA)  # fmt: skip
