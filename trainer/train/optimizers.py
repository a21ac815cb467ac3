"""The drafter's optimizer (``--optimizer``; the schedule of its rate is
``trainer.train.clock``'s).

* ``adamw``: AdamW on every weight (betas 0.9, 0.95; ``--weight-decay``).
* ``muon``: Muon (``torch.optim.Muon``: momentum 0.95, Nesterov, each update of a weight
  matrix orthogonalized by 5 Newton-Schulz steps) on the drafter's 2-D weights, AdamW as
  above on the rest (norms, biases, DFlash2's kernels and its selector's codebooks, which
  are tables: a step touches a few rows), as speculators' DFlash recipe trains
  (its issue #979). Muon's update is scaled to AdamW's RMS (``match_rms_adamw``, Moonlight's
  rule: ``0.2 sqrt(max(rows, cols))``), so one ``--lr`` serves both. The default since
  2026-12-07, at 1e-2 (``trainer.sections.RATES``; docs/EXPERIMENT.md, Part 8). Its
  Newton-Schulz steps run in bfloat16 (torch's), so two runs whose gradients differ by
  float rounding (a step cut otherwise) drift apart faster than under AdamW.

``MuonAdamW`` is one ``torch.optim.Optimizer`` over both: one LR schedule sets both
groups' rates, one state dict holds both states (a checkpoint of it resumes only under
``--optimizer muon``, and an AdamW one only under ``adamw``: ``restore`` says which).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)
MUON_MOMENTUM = 0.95


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``matrices`` (2-D), AdamW on ``rest``: the inner optimizers share this one's
    parameter groups (the schedule's rates reach them) and state (its state dict is
    theirs)."""

    def __init__(
        self, matrices: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], *,
        lr: float, weight_decay: float,
    ) -> None:  # fmt: skip
        if not matrices:
            raise ValueError("--optimizer muon: the drafter has no 2-D weight")
        self._muon = torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, momentum=MUON_MOMENTUM,
            adjust_lr_fn="match_rms_adamw",
        )  # fmt: skip
        inner: list[torch.optim.Optimizer] = [self._muon]
        if rest:
            self._adamw = torch.optim.AdamW(rest, lr=lr, betas=BETAS, weight_decay=weight_decay)
            inner.append(self._adamw)
        self._inner = inner
        groups = [g for opt in inner for g in opt.param_groups]
        super().__init__(groups, {"lr": lr})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after a load,
        which makes both anew)."""
        at = 0
        for opt in self._inner:
            n = len(opt.param_groups)
            opt.param_groups = self.param_groups[at : at + n]
            opt.state = self.state
            at += n

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for opt in self._inner:
            opt.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


#: Parameters that are tables rather than maps (DFlash2's selector codebooks, ``[vocab,
#: rank]``: a step touches a few rows), which stay with AdamW as embeddings do.
TABLES = ("codebook", "embed")


def make_optimizer(
    kind: str, params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float,
    weight_decay: float,
) -> torch.optim.Optimizer:  # fmt: skip
    """The drafter's optimizer ``kind`` (``OPTIMIZERS``) over its named trainable ``params``."""
    trainable = [(n, p) for n, p in params if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW(
            [p for _, p in trainable], lr=lr, betas=BETAS, weight_decay=weight_decay
        )
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r}: one of {', '.join(OPTIMIZERS)}")
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"--optimizer muon needs torch.optim.Muon (torch 2.9 or later); this torch is "
            f"{torch.__version__}: upgrade it or use --optimizer adamw"
        )
    muon = [p.ndim == 2 and not any(t in n for t in TABLES) for n, p in trainable]
    matrices = [p for (_, p), m in zip(trainable, muon, strict=True) if m]
    rest = [p for (_, p), m in zip(trainable, muon, strict=True) if not m]
    return MuonAdamW(matrices, rest, lr=lr, weight_decay=weight_decay)


def optimizer_kind(state: dict[str, Any]) -> str:
    """Which optimizer a saved state dict is of: Muon's groups carry ``ns_steps``."""
    return "muon" if any("ns_steps" in g for g in state.get("param_groups", ())) else "adamw"
