"""The drafter's initialisation: every projection of ``fc`` and the decoder layers starts
from N(0, 0.02) (``--init-std``) whatever the width (PyTorch's default, ``1/sqrt(3
fan_in)``, would give 0.102 at width 32 and 0.0255 at 512), the norms at 1, and the same
seed gives the same weights (docs/TRAINER.md, "Initialisation")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.model.drafter import INIT_STD, DFlashDrafter, DrafterConfig


def config(width: int) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=width, intermediate_size=2 * width, num_heads=4, num_kv_heads=2,
        head_dim=width // 4, num_target_layers=3, num_layers=2, block_size=4, mask_token_id=5,
    )  # fmt: skip


@pytest.mark.parametrize("width", [32, 512])
def test_every_projection_starts_at_the_init_std(width: int) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(config(width))
    linears = [(n, m) for n, m in drafter.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 + 2 * 7  # fc, and q, k, v, o, gate, up, down per layer
    for name, m in linears:
        std = m.weight.std().item()  # 512 draws or more: within 10%
        assert abs(std - INIT_STD) < 0.1 * INIT_STD, (name, std)
        assert abs(m.weight.mean().item()) < 5 * INIT_STD / m.weight.numel() ** 0.5, name
    norms = [m for m in drafter.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(bool((m.weight == 1).all()) for m in norms)


@pytest.mark.parametrize("std", [0.0, 0.05])
def test_init_std_sets_the_start_and_0_keeps_pytorchs(std: float) -> None:
    """``--init-std``: another normal start, or 0 for PyTorch's default (uniform within
    ``1/sqrt(fan_in)``: std ``1/sqrt(3 fan_in)``), the start before 2026-12-06."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(config(256), init_std=std)
    for name, m in drafter.named_modules():
        if isinstance(m, nn.Linear):
            fan_in = m.weight.shape[1]
            want = std or (3 * fan_in) ** -0.5
            assert abs(m.weight.std().item() - want) < 0.1 * want, name
            if not std:
                assert m.weight.abs().max().item() <= fan_in**-0.5, name


def test_a_negative_std_is_refused_and_the_help_names_the_default() -> None:
    """(The flag's refusal: ``test_out_of_range_counts_are_refused_naming_the_flag``.)"""
    from dataclasses import fields

    from trainer.sections import DrafterSection

    with pytest.raises(ValueError, match="init_std must be >= 0"):
        DFlashDrafter(config(32), init_std=-0.1)
    (help_text,) = [f.metadata["help"] for f in fields(DrafterSection) if f.name == "init_std"]
    assert f"[{INIT_STD}," in help_text  # the help's default is the drafter's


def test_the_same_seed_gives_the_same_drafter() -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return DFlashDrafter(config(64)).state_dict()

    a, b, c = weights(3), weights(3), weights(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_adamw_moves_a_smaller_start_further_relative_to_its_size() -> None:
    """The mechanism behind the start (docs/TRAINER.md, "Initialisation"): AdamW's step is
    about the learning rate whatever a weight's scale, so the same steps change a 256-wide
    drafter's attention and MLP far more, relative to their start, from N(0, 0.02) than
    from PyTorch's default (std 0.036 there), which training then barely leaves."""
    from trainer.model.drafter import DraftBlocks

    cfg = config(256)
    torch.manual_seed(0)
    feats = torch.randn(1, 64, 3 * 256)
    ids = torch.randint(0, 32, (1, 64))
    embed = nn.Embedding(32, 256)
    anchors = [4, 20, 36, 50]
    blocks = DraftBlocks.one_document(feats, anchors, ids[0, anchors])

    def moved(default_start: bool) -> float:
        torch.manual_seed(1)
        drafter = DFlashDrafter(cfg, init_std=0.0 if default_start else None)
        start = drafter.layers[0].self_attn.q_proj.weight.detach().clone()
        opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, betas=(0.9, 0.95))
        for _ in range(20):
            opt.zero_grad()
            drafter(embed, blocks).pow(2).mean().backward()
            opt.step()
        now = drafter.layers[0].self_attn.q_proj.weight.detach()
        return float((now - start).norm() / start.norm())

    default, normal = moved(True), moved(False)
    assert 0.0 < default < normal
    assert normal / default > 1.4  # about the ratio of the starts' scales, 0.036 / 0.02
