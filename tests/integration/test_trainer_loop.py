"""The single-process training loop on hand-built batches: learning, checkpoints, resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from drafters import in_process

from trainer.cli import main
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import Target
from trainer.model.verifier import greedy_generate
from trainer.run import resolve_mask_token
from trainer.sections import RunOptions
from trainer.train import checkpoint as ckpt
from trainer.train.batches import ListSource, pack_batch, pad_batch
from trainer.train.distributed import DistEnv, local_env
from trainer.train.loop import Trainer
from trainer.train.metrics import metrics_path, read_metrics

B = 8


@pytest.fixture(scope="module")
def samples(target) -> list[tuple[list[int], list[int]]]:
    """Prompts with the target's own greedy responses (what `regen` produces)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(24):
        prompt = torch.randint(0, 512, (8,), generator=g)
        response = greedy_generate(target, prompt, 40)
        out.append((torch.cat([prompt, response]).tolist(), [0] * 8 + [1] * 40))
    return out


def make_drafter(target: Target, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511
    )
    torch.manual_seed(seed)
    return DFlashDrafter(cfg)


def make_trainer(
    target, source, run_dir: Path, drafter_seed: int = 0,
    loss: LossConfig | None = None, **kw: Any,
) -> Trainer:  # fmt: skip
    loss = loss or LossConfig(block_size=B, anchors_per_doc=6)
    cfg = in_process(run_dir, loss, **{"steps": 10, "lr": 3e-3, "warmup": 2,
                                       "eval_new_tokens": 16, **kw})  # fmt: skip
    prompts = [torch.tensor(s[0][:8]) for s in source_samples(source)[:2]]
    return Trainer(
        cfg,
        target=target,
        drafter=make_drafter(target, drafter_seed),
        source=source,
        env=local_env(),
        eval_prompts=prompts,
    )


def source_samples(source: ListSource) -> list[tuple[list[int], list[int]]]:
    first = source._micro_batches[0][0]
    return [(first.input_ids[r].tolist(), []) for r in range(first.input_ids.shape[0])]


class Killed(Exception):
    pass


class KilledSource(ListSource):
    """Dies (like kill -9) when asked for micro-batch number ``die_at``."""

    def __init__(self, *args, die_at: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.die_at = die_at

    def __iter__(self):
        for batch in super().__iter__():
            if self.position > self.die_at:
                raise Killed
            yield batch


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(metrics_path(run_dir)) if "loss" in r}


def test_loss_decreases_and_tau_is_reported(target, samples, tmp_path, caplog):
    src = ListSource(samples, rows=4)
    # log_every_s: no terminal here, so progress lines (every step at this rate)
    tr = make_trainer(target, src, tmp_path, steps=30, eval_every=15, log_every_s=1e-9)
    caplog.set_level(logging.INFO, logger="dflash-train")
    embedding = target.embed_tokens.weight.clone()
    summary = tr.run()
    # The MASK slot is the target's frozen row 511: no drafter parameter, target untouched.
    assert not any("mask" in name for name in tr.drafter.state_dict())
    assert torch.equal(target.embed_tokens.weight, embedding)
    x = tr.drafter.block_inputs(target.embed_tokens, torch.tensor([5]))
    assert torch.equal(x[1:], embedding[511].expand(B - 1, -1))
    recs = read_metrics(metrics_path(tmp_path))
    by_step = {r["step"]: r for r in recs}
    assert sorted(by_step) == list(range(31))
    assert "tau" in by_step[0] and "tau" in by_step[15] and "tau" in by_step[30]
    assert all(1.0 <= by_step[s]["tau_pooled"] <= B for s in (0, 15, 30))
    assert by_step[30]["anchors_per_micro"] == by_step[30]["blocks"] and by_step[30]["blocks"] > 0
    assert by_step[30]["anchors_capped"] == 0 and by_step[30]["rss_peak_gb"] > 0
    first = sum(by_step[s]["loss"] for s in range(1, 6)) / 5
    last = sum(by_step[s]["loss"] for s in range(26, 31)) / 5
    assert last < first - 0.5, (first, last)
    rec = by_step[30]
    assert len(rec["acc_k"]) == B - 1 and 0 <= rec["acc"] <= 1
    assert rec["tokens"] == 4 * 48 and rec["tokens_per_s"] > 0
    assert 0 <= rec["data_wait_frac"] < 1
    assert summary["last_loss"] == rec["loss"] and summary["steps"] == 30
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].startswith("step 1/30 (3.3%) loss ") and " ETA " in lines[0], lines[0]
    assert lines[-1].startswith("step 30/30 (100.0%)") and "tau" in lines[-1], lines[-1]
    assert "tokens/s" in lines[-1] and " ETA " not in lines[-1]


def test_resume_matches_uninterrupted_run(target, samples, tmp_path):
    kw = dict(steps=10, grad_accum=2, ckpt_every=4)
    whole = tmp_path / "whole"
    make_trainer(target, ListSource(samples, rows=3, grad_accum=2), whole, **kw).run()

    cut = tmp_path / "cut"
    dying = KilledSource(samples, rows=3, grad_accum=2, die_at=13)  # dies inside step 7
    with pytest.raises(Killed):
        make_trainer(target, dying, cut, **kw).run()
    assert [p.name for p in ckpt.list_checkpoints(cut)] == ["step-00000004"]
    assert max(losses(cut)) == 6  # steps 5 and 6 ran after the checkpoint

    # A fresh process: other initial weights, a new source; the checkpoint decides.
    resumed = make_trainer(
        target, ListSource(samples, rows=3, grad_accum=2), cut, drafter_seed=99, resume=True, **kw
    )
    summary = resumed.run()
    assert summary["resumed"] is True
    a, b = losses(whole), losses(cut)
    assert sorted(b) == list(range(1, 11))  # steps 5, 6 replaced, not duplicated
    for s in range(1, 11):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-6), s


def test_muon_with_a_linear_schedule_trains_and_resumes_exactly_under_its_own(
    target, samples, tmp_path
):
    """``--optimizer muon --lr-schedule linear`` (speculators' recipe): the loss falls, a run
    cut at its checkpoint resumes to the uninterrupted run's losses (both optimizers' states
    come back), and a resume under AdamW is refused, naming the flag that continues it."""
    kw = dict(steps=8, grad_accum=2, ckpt_every=4, optimizer="muon", lr_schedule="linear")
    whole = tmp_path / "whole"
    make_trainer(target, ListSource(samples, rows=3, grad_accum=2), whole, **kw).run()
    a = losses(whole)
    assert a[8] < a[1]
    cut = tmp_path / "cut"
    with pytest.raises(Killed):
        make_trainer(target, KilledSource(samples, rows=3, grad_accum=2, die_at=11), cut,
                     **kw).run()  # fmt: skip
    other = {**kw, "optimizer": "adamw"}
    with pytest.raises(ValueError, match=r"trained with --optimizer muon.*pass --optimizer muon"):
        make_trainer(target, ListSource(samples, rows=3, grad_accum=2), cut, resume=True,
                     **other).run()  # fmt: skip
    # Another rate or schedule: the scheduler would put the saved peak rate back while
    # config.json records the new one, so it is refused, naming the flags that continue it.
    for change, says in (
        ({"lr": 1e-3}, r"with --lr 0.003, this run asks for --lr 0.001: pass --lr 0.003 "),
        ({"lr_schedule": "cosine", "warmup": 0.5}, r"with --lr-schedule linear --warmup 2, this "
         r"run asks for --lr-schedule cosine --warmup 0.5: pass --lr-schedule linear --warmup 2"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            make_trainer(target, ListSource(samples, rows=3, grad_accum=2), cut, resume=True,
                         **{**kw, **change}).run()  # fmt: skip
    make_trainer(target, ListSource(samples, rows=3, grad_accum=2), cut, drafter_seed=99,
                 resume=True, **kw).run()  # fmt: skip
    b = losses(cut)
    for s in range(1, 9):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-6), s


def test_a_checkpoint_from_before_the_lr_clock_resumes_on_the_same_schedule(
    target, samples, tmp_path
):
    """A checkpoint without ``clock`` (written before it existed, so without a manifest
    entry for the edited file either) rebuilds it from its step and shape: the resumed
    steps' losses equal an uninterrupted run's."""
    kw = dict(steps=10, grad_accum=2, ckpt_every=4)
    whole = tmp_path / "whole"
    make_trainer(target, ListSource(samples, rows=3, grad_accum=2), whole, **kw).run()
    cut = tmp_path / "cut"
    with pytest.raises(Killed):
        dying = KilledSource(samples, rows=3, grad_accum=2, die_at=13)
        make_trainer(target, dying, cut, **kw).run()
    path = ckpt.list_checkpoints(cut)[-1]
    model = torch.load(path / "model.pt", weights_only=True)
    del model["clock"]
    torch.save(model, path / "model.pt")
    ckpt.manifest_path(path).unlink()  # as old checkpoints had none
    resumed = make_trainer(
        target, ListSource(samples, rows=3, grad_accum=2), cut, resume=True, **kw
    )
    resumed.run()
    a, b = losses(whole), losses(cut)
    assert sorted(b) == list(range(1, 11))
    for s in range(5, 11):
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-6), s


def test_checkpoint_contents_and_retention(target, samples, tmp_path):
    src = ListSource(samples, rows=4)
    tr = make_trainer(target, src, tmp_path, steps=6, ckpt_every=1, keep_checkpoints=2)
    tr.run()
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000005", "step-00000006"]
    assert not list(ckpt.checkpoint_dir(tmp_path).glob("*.tmp"))
    saved, mine = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), local_env())
    assert saved.step == mine["step"] == 6
    assert mine["loader"] == {"version": 1, "position": 6}
    assert saved.optimizer is not None and saved.scheduler is not None
    assert saved.loss_config == dataclasses.asdict(tr.loss)
    assert set(mine["rng"]) >= {"torch", "python"}
    for k, v in tr.drafter.state_dict().items():
        assert torch.equal(saved.drafter[k], v), k
    assert saved.world_size == 1 and saved.clock == {
        "micro": 6,
        "unit": 1,
        "steps_per_epoch": src.steps_per_epoch,
    }
    # On two ranks, rank 1 (which this checkpoint did not have) gets rank 0's loader state
    # and no RNG state (the trainer seeds it from the run).
    two = DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    _, theirs = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), two)
    assert theirs["loader"] == mine["loader"] and theirs["rng"] is None
    with pytest.raises(ValueError, match="already has checkpoints"):
        make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=6).run()


def test_micro_index_must_match_grad_accum(target, samples, tmp_path):
    tr = make_trainer(target, ListSource(samples, rows=4, grad_accum=1), tmp_path, grad_accum=2)
    with pytest.raises(RuntimeError, match="serves grad_accum 1, the trainer was told 2"):
        tr.run()


def test_grad_accum_comes_from_the_loader_when_unset(target, samples, tmp_path):
    tr = make_trainer(target, ListSource(samples, rows=3, grad_accum=2), tmp_path, steps=2)
    tr.run()
    assert tr.grad_accum == 2 and tr.source.position == 4  # 2 steps of 2 micro-batches
    assert json.loads((tmp_path / "loader_spec.json").read_text())["grad_accum"] == 2


def test_packed_batches_and_batches_without_blocks(target, samples, tmp_path):
    short = [(s[0][:12], s[1][:12]) for s in samples[:4]]  # too few supervised tokens
    mixed = short + samples[4:12]
    tr = make_trainer(target, ListSource(mixed, rows=4, layout="packed"), tmp_path, steps=3)
    tr.run()
    recs = {r["step"]: r for r in read_metrics(metrics_path(tmp_path)) if "loss" in r}
    assert recs[1]["loss"] is None and recs[1]["blocks"] == 0  # only short samples
    assert recs[2]["loss"] is not None and recs[2]["blocks"] > 0


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_empty_micro_batch_of_a_short_last_step_trains_the_rest(
    target, samples, tmp_path, layout
):
    # A short last step of an epoch may hand a rank a micro-batch of no sample ([0, 0], or
    # [1, 0] packed): the step trains on the others and the run goes on.
    src = ListSource(samples[:16], rows=4, grad_accum=2, layout=layout)
    make = pack_batch if layout == "packed" else pad_batch
    empty = make([], steps_per_epoch=src.steps_per_epoch)
    src._micro_batches[1] = (empty, 0, 1)
    tr = make_trainer(target, src, tmp_path, steps=2)
    tr.run()
    recs = {r["step"]: r for r in read_metrics(metrics_path(tmp_path)) if "loss" in r}
    assert empty.num_tokens == 0 and empty.input_ids.shape[-1] == 0
    assert recs[1]["blocks"] > 0 and math.isfinite(recs[1]["loss"])
    assert recs[2]["blocks"] > 0 and src.position == 4


def test_plot_command(target, samples, tmp_path):
    make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=3).run()
    res = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert res.exit_code == 0, res.output
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["acc_by_offset.png", "loss.png", "tau.png", "throughput.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 1000 for p in pngs)
    json.loads(metrics_path(tmp_path).read_text().splitlines()[0])


def test_epochs_set_the_length_from_the_loader(target, samples, tmp_path):
    src = ListSource(samples, rows=4, grad_accum=2, epochs=2)  # 24 samples: 3 steps/epoch
    tr = make_trainer(target, src, tmp_path, steps=None, epochs=2, grad_accum=2)
    summary = tr.run()
    assert tr.total_steps == 6 and summary["steps"] == 6
    recs = [r for r in read_metrics(metrics_path(tmp_path)) if "loss" in r]
    assert [r["epoch"] for r in recs] == [0, 0, 0, 1, 1, 1]


def _opts(**kw):
    return RunOptions(endpoint="unused", run_dir=Path("unused"), **kw)


def test_mask_token_resolution(target):
    assert resolve_mask_token(target, _opts()) == 511  # the tiny target's reserved id
    assert resolve_mask_token(target, _opts(mask_token_id=7)) == 7
    assert resolve_mask_token(target, _opts(learned_mask=True)) is None
    with pytest.raises(ValueError, match="outside the target's embedding"):
        resolve_mask_token(target, _opts(mask_token_id=512))
    with pytest.raises(ValueError, match="exclude each other"):
        resolve_mask_token(target, _opts(learned_mask=True, mask_token_id=3))
    plain = Target(target.model)
    plain.config = type(target.config).from_dict({**target.config.to_dict(), "mask_token_id": None})
    with pytest.raises(ValueError, match="names no mask token"):
        resolve_mask_token(plain, _opts())


def test_resume_refuses_a_different_served_spec(target, samples, tmp_path):
    make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=2).run()
    packed = ListSource(samples, rows=4, layout="packed")
    tr = make_trainer(target, packed, tmp_path, steps=4, resume=True)
    with pytest.raises(RuntimeError, match=r"another batch spec.*'layout': \('padded', 'packed'\)"):
        tr.run()


def test_the_objective_is_recorded_and_a_resume_under_another_is_refused(target, samples, tmp_path):
    """Checkpoints keep the objective that trained them (weighting, normalization, anchor
    draw): a resume under another names the fields and the flags that continue it; the
    export says which objective trained the drafter."""
    from trainer.hf.export import export_drafter

    dpace = LossConfig(block_size=B, anchors_per_doc=6, weighting="dpace")
    from trainer.options import TargetOptions
    from trainer.run import run_meta

    first = make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=2, loss=dpace)
    first.meta.update(run_meta(TargetOptions(), target))  # what dflash-train records
    first.run()
    old = LossConfig(
        block_size=B, anchors_per_doc=6, normalization="micro-batch", weighting="decay"
    )
    again = make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=4, resume=True,
                         loss=old)  # fmt: skip
    again.meta.update(run_meta(TargetOptions(), target))
    with pytest.raises(ValueError) as e:
        again.run()
    said = str(e.value)
    assert "loss config differs from this run's in " in said
    assert "weighting ('dpace' vs 'decay')" in said and "normalization ('step' vs" in said
    assert "pass --loss-normalization step --loss-weighting dpace" in said
    out = export_drafter(tmp_path, tmp_path / "export", dtype="fp32")
    info = json.loads((out / "dflash_export.json").read_text())["trained_with"]
    assert (info["weighting"], info["normalization"], info["anchor_draw"]) == (
        "dpace", "step", "document",
    )  # fmt: skip
    assert info["dpace_alpha"] == 0.5 and "gamma" not in info
    assert "trained with: weighting dpace" in (out / "README.md").read_text()


def test_resume_refuses_other_target_layers(target, samples, tmp_path):
    first = make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=2)
    first.meta["layer_ids"] = [0, 1]
    first.run()
    # Same number of layers (same drafter config), other ids: the features would differ.
    again = make_trainer(target, ListSource(samples, rows=4), tmp_path, steps=4, resume=True)
    again.meta["layer_ids"] = [1, 2]
    with pytest.raises(ValueError, match=r"layer_ids \[0, 1\] differs from this run's \[1, 2\]"):
        again.run()


def test_micro_batch_times_are_recorded_and_calibrate(target, samples, tmp_path):
    """After 2 warm-up steps every micro-batch's compute time is logged with its documents'
    lengths and the trainer's anchor rule, up to --cost-samples; calibrate fits them."""
    src = ListSource(samples, rows=3, grad_accum=2, epochs=3)
    make_trainer(target, src, tmp_path, steps=9, cost_samples=12, eval_new_tokens=4).run()
    lines = (tmp_path / "costs" / "rank0.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert len(recs) == 12  # steps 3..8 x 2 micro-batches, then the limit
    assert [(r["step"], r["micro"]) for r in recs[:2]] == [(2, 0), (2, 1)]
    assert all(r["time_s"] > 0 and r["rule"] == [B, 6, 32, 0] for r in recs)
    assert all(len(r["doc_lengths"]) == 3 and r["layout"] == "padded" for r in recs)
    assert all(not r["synced"] for r in recs)  # one process: no all-reduce to wait for
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path), "--no-plot"])
    assert result.exit_code == 0, result.output
    profile = json.loads((tmp_path / "cost_profile.json").read_text())
    assert profile["anchor_rule"] == {
        "block_size": B, "anchors_per_doc": 6, "tokens_per_anchor": 32, "max_anchors": 0
    }  # fmt: skip
    assert profile["fit"]["n_fit"] + profile["fit"]["n_holdout"] == 12


def test_a_loader_that_ends_first_ends_the_run_with_a_checkpoint(target, samples, tmp_path):
    """A source with fewer batches than the steps asked for (one epoch of 6 steps for 20):
    the run ends after its last batch, checkpointed, and says why; no traceback."""
    src = ListSource(samples, rows=4, epochs=1)
    tr = make_trainer(target, src, tmp_path, steps=20)
    summary = tr.run()
    assert summary["note"] == "the loader had no more batches" and not summary["stopped"]
    last = ckpt.latest_checkpoint(tmp_path)
    assert last is not None and last.name == f"step-{src.steps_per_epoch:08d}"


def test_profile_step_writes_phases_flops_and_mfu(target, samples, tmp_path):
    """--profile-step 3: RUN_DIR/profile.json holds every phase's host time (CPU) and share,
    the step's FLOPs by part and, with a peak given, the MFU they make."""
    import json

    from trainer.model.phases import PHASES

    src = ListSource(samples, rows=4)
    tr = make_trainer(target, src, tmp_path, steps=4, profile_step=3, peak_tflops=0.5)
    tr.run()
    rec = json.loads((tmp_path / "profile.json").read_text())
    assert rec["step"] == 3 and rec["device"] == "cpu"
    for name in ("target", "drafter", "head", "backward", "optimizer", "copy", "plan"):
        assert rec["phase_s"][name] > 0, name
    assert set(rec["phase_share"]) == {*PHASES, "other"}
    assert sum(rec["phase_share"].values()) == pytest.approx(1.0, abs=0.02)
    parts = rec["flops"]
    assert parts["total"] == pytest.approx(
        parts["target"] + parts["drafter"] + parts["head"], rel=1e-3
    )
    assert min(parts.values()) > 0
    tflops = parts["total"] / rec["step_s"] / 1e12
    assert rec["tflops_per_s"] == pytest.approx(tflops, rel=1e-2)
    assert rec["mfu"] == pytest.approx(tflops / 0.5, rel=1e-2)
