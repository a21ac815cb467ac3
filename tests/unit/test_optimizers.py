"""The drafter's optimizers (``trainer.train.optimizers``) and LR schedules
(``trainer.train.clock.lr_factor``)."""

from __future__ import annotations

import copy as copy_module

import pytest
import torch
from torch import nn

from trainer.train.clock import lr_factor, lr_scheduler, start_clock
from trainer.train.optimizers import MuonAdamW, make_optimizer, optimizer_kind


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4, bias=False))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_muon_takes_the_matrices_and_adamw_the_rest():
    model = _model()
    opt = make_optimizer("muon", model.named_parameters(), lr=1e-2, weight_decay=0.01)
    assert isinstance(opt, MuonAdamW) and optimizer_kind(opt.state_dict()) == "muon"
    muon, adamw = opt._inner
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert all(p.ndim != 2 for g in adamw.param_groups for p in g["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    plain = make_optimizer("adamw", model.named_parameters(), lr=1e-2, weight_decay=0.01)
    assert optimizer_kind(plain.state_dict()) == "adamw"
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        make_optimizer("sgd", model.named_parameters(), lr=1e-2, weight_decay=0.0)


def test_muon_orthogonalizes_a_matrix_s_update():
    """One Muon step from zero momentum moves a weight matrix by a scaled orthogonal
    factor: its singular values nearly equal (AdamW's are not)."""
    model = _model()
    opt = make_optimizer("muon", model.named_parameters(), lr=1e-2, weight_decay=0.0)
    before = model[0].weight.detach().clone()
    _step(model, opt, 1)
    sv = torch.linalg.svdvals(model[0].weight.detach() - before)
    assert float(sv.min() / sv.max()) > 0.5


def test_the_schedule_reaches_both_groups_and_the_state_comes_back_whole():
    model, twin = _model(), _model()
    opt = make_optimizer("muon", model.named_parameters(), lr=1e-2, weight_decay=0.01)
    clock = start_clock(None, step=0, shape=1, steps_per_epoch=0, legs=())
    sched = lr_scheduler(opt, clock, lr_factor("linear", 0, 4))
    for s in range(2):
        _step(model, opt, s)
        clock.micro += 1
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * 0.5] * 2)
    saved = copy_module.deepcopy(opt.state_dict())  # as a checkpoint holds it: not shared
    copy = make_optimizer("muon", twin.named_parameters(), lr=1e-2, weight_decay=0.01)
    twin.load_state_dict(model.state_dict())
    copy.load_state_dict(saved)
    for m, o in ((model, opt), (twin, copy)):
        _step(m, o, 7)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert copy._inner[0].state is copy.state  # the inner ones see the loaded state


def test_the_schedules_fall_after_the_warmup():
    for kind in ("cosine", "linear"):
        f = lr_factor(kind, 2, 12)
        assert f(0) == pytest.approx(1 / 3) and f(2) == pytest.approx(1.0)
        assert f(12) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor("linear", 2, 12)(7) == pytest.approx(0.5)
    assert lr_factor("cosine", 2, 12)(4.5) > lr_factor("linear", 2, 12)(4.5)
    with pytest.raises(ValueError, match="unknown LR schedule 'step'"):
        lr_factor("step", 0, 1)


def test_tables_stay_with_adamw():
    """A 2-D parameter that is a table (DFlash2's selector codebooks: a step touches a few
    rows) is AdamW's, as embeddings are; a 2-D map is Muon's."""

    class WithTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)
            self.predecessor_codebook = nn.Parameter(torch.zeros(32, 4))

    model = WithTable()
    opt = make_optimizer("muon", model.named_parameters(), lr=1e-2, weight_decay=0.0)
    muon, adamw = opt._inner
    assert [p.shape for g in muon.param_groups for p in g["params"]] == [(8, 8)]
    assert [p.shape for g in adamw.param_groups for p in g["params"]] == [(32, 4)]


def test_the_rate_is_the_optimizer_s_unless_given_and_older_runs_read_as_they_ran(tmp_path):
    """``--lr`` unset is the optimizer's own rate (``RATES``: Muon's sweep's best, AdamW's
    default of before 2026-12-07), so ``--optimizer adamw`` alone gives the trainer of then;
    a run's ``config.json`` written before ``--optimizer`` existed reads as AdamW at its
    recorded rate, not as today's default."""
    import json

    from trainer.options import RUN_FACTS
    from trainer.sections import RATES, RunOptions

    base = {"endpoint": "ipc:///x", "run_dir": tmp_path}
    assert RATES == {"muon": 1e-2, "adamw": 6e-4}
    assert RunOptions(**base).optimizer == "muon"
    assert RunOptions(**base).peak_lr() == 1e-2
    assert RunOptions(**base, optimizer="adamw").peak_lr() == 6e-4
    assert RunOptions(**base, optimizer="adamw", lr=3e-3).peak_lr() == 3e-3
    with pytest.raises(ValueError, match="--lr must be > 0"):
        RunOptions(**base, lr=0.0)
    old = RunOptions(**base, lr=6e-4).to_record()
    del old["optimizer"], old["lr_schedule"]  # both came later
    old.update(dict.fromkeys(RUN_FACTS))
    (tmp_path / "config.json").write_text(json.dumps(old))
    read = RunOptions.read(tmp_path)
    assert (read.optimizer, read.lr_schedule, read.peak_lr()) == ("adamw", "cosine", 6e-4)
