"""Sliding-window drafters end to end: the real training loop trains one (sliding and full
layers), ``export`` writes the fields SGLang, vLLM and Transformers read, the exported
model computes the trainer's drafter and drafts losslessly with the same acceptance as our
verifier inside Transformers' DFlash ``generate``, ``--init-drafter`` reads the kinds and
the window back (and refuses what disagrees), and ``--resume`` names a changed window."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafters import edited, greedy_samples, run_opts, train_run, trained_drafter
from transformers import AutoModel

from trainer.hf.export import export_drafter, read_trained_drafter
from trainer.model.attention import FULL, LayerRule
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DraftBlocks, DrafterConfig
from trainer.model.verifier import DrafterProposer, greedy_generate, speculative_generate
from trainer.run import (
    build_drafter,
    init_from_folder,
    resolve_init_drafter,
)
from trainer.train.distributed import local_env

B, MASK, WINDOW = 4, 511, 6
KINDS = ("sliding_attention", "full_attention")


def config(target, **kw) -> DrafterConfig:
    return DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=2, block_size=B, mask_token_id=MASK,
        layer_types=KINDS, sliding_window=WINDOW, **kw,
    )  # fmt: skip


def train(target, samples, run_dir: Path, cfg: DrafterConfig, steps: int, resume=False):
    torch.manual_seed(0)
    loss = LossConfig(block_size=B, anchors_per_doc=8)
    return train_run(target, samples, run_dir, DFlashDrafter(cfg), loss, steps, resume=resume)


@pytest.fixture(scope="module")
def samples(target):
    return greedy_samples(target, MASK)


@pytest.fixture(scope="module")
def run_dir(target, samples, tmp_path_factory):
    return train(target, samples, tmp_path_factory.mktemp("swa-run"), config(target), 40)


@pytest.fixture(scope="module")
def trained(run_dir):
    return trained_drafter(run_dir)


@pytest.fixture(scope="module")
def folder(run_dir, tmp_path_factory):
    return export_drafter(run_dir, tmp_path_factory.mktemp("swa-export") / "d", dtype="fp32")


def load(folder: Path):
    model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    return model.eval()


def test_trained_drafter_keeps_its_layer_rules(trained):
    assert trained.config.layer_types == KINDS and trained.config.sliding_window == WINDOW
    assert [layer.rule for layer in trained.layers] == [LayerRule(WINDOW), FULL]


def test_export_writes_what_the_engines_read(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layer_types"] == list(KINDS)
    assert (cfg["sliding_window"], cfg["use_sliding_window"]) == (WINDOW, True)
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"]
    assert load(folder).config.sliding_window == WINDOW  # Transformers kept the window


@pytest.mark.parametrize("anchor", [3, 13, 20])
def test_exported_model_computes_the_trainer_drafter(folder, target, trained, anchor):
    ids = torch.randint(0, MASK, (26,), generator=torch.Generator().manual_seed(3))
    feats, _ = target.features(ids[None])
    blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
    noise = trained.block_inputs(target.embed_tokens, ids[anchor : anchor + 1])[None]
    model = load(folder)
    with torch.no_grad():
        ref = trained(target.embed_tokens, blocks)
        out = model(
            noise_embeds=noise, context_hidden_states=feats[:, :anchor],
            position_ids=torch.arange(anchor + B)[None],
        ).last_hidden_state[0]  # fmt: skip
        # The window matters here: the same weights as a full-attention drafter differ.
        full = DFlashDrafter(replace(trained.config, layer_types=None, sliding_window=None))
        full.load_state_dict(trained.state_dict())
        other = full(target.embed_tokens, blocks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    if anchor > WINDOW:
        assert not torch.allclose(other, ref, atol=1e-3)


def test_transformers_dflash_generate_is_lossless_with_our_acceptance(
    folder, target, trained, samples
):
    """Transformers' loop feeds the model through its cache (the context keys of earlier
    steps, the previous block cropped): the sliding layers' window must be counted in
    positions across it. Output = the target's greedy; per step, our verifier's lengths."""
    model = load(folder)
    seen: list[int] = []
    forward = model.forward

    def counting(*args, **kw):
        seen.append(kw["context_hidden_states"].shape[1])
        return forward(*args, **kw)

    model.forward = counting
    accepted = []
    prompts = [torch.tensor(s[0][:8]) for s in samples[:3]]
    for prompt in prompts:
        seen.clear()
        kw = dict(do_sample=False, max_new_tokens=32, min_new_tokens=32)
        spec = target.model.generate(
            prompt[None], assistant_model=model, speculation_type="dflash", **kw
        )
        assert torch.equal(spec[0, prompt.numel() :], greedy_generate(target, prompt, 32))
        ours = speculative_generate(
            target, DrafterProposer(target, trained), prompt, block_size=B, max_new_tokens=32
        )
        steps = seen[1:]
        assert steps == ours.acceptance_lengths[: len(steps)]
        accepted += steps
    assert max(accepted) > 1


def test_init_drafter_reads_the_rules_back(folder, target, trained, tmp_path):
    opts, spec = resolve_init_drafter(run_opts(init_drafter=folder))
    assert (opts.layer_types, opts.sliding_window) == (",".join(KINDS), WINDOW)
    run_target = target
    drafter = build_drafter(run_target, opts, torch.device("cpu"))
    assert drafter.config.layer_types == KINDS and drafter.config.sliding_window == WINDOW
    init_from_folder(drafter, spec, run_target, replace(opts, run_dir=tmp_path))
    for name, value in trained.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], value), name


def test_init_drafter_refuses_what_disagrees(folder, tmp_path):
    def error(src: Path, **opts) -> str:
        with pytest.raises(ValueError) as err:
            resolve_init_drafter(run_opts(init_drafter=src, **opts))
        return str(err.value)

    assert "--sliding-window 8 differs" in error(folder, sliding_window=8)
    assert "--layer-types full,full differs" in error(folder, layer_types="full,full")
    for name, change, needle in (
        ("causal", {"dflash_config": {"causal": True}}, "causal = True"),
        ("is_causal", {"is_causal": True}, "is_causal = True"),
        ("off", {"use_sliding_window": False}, "use_sliding_window False"),
        ("unsaid", {"use_sliding_window": None}, "use_sliding_window None"),
        ("two", {"dflash_config": {"swa_window_size": 9}}, "swa_window_size 9 != sliding_window 6"),
        ("nowindow", {"sliding_window": None}, "sliding_window is None"),
        ("short", {"layer_types": ["sliding_attention"]}, "1 entries for num_hidden_layers 2"),
        ("kind", {"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ):
        assert needle in error(edited(folder, tmp_path / name, **change)), name


def test_resume_names_a_changed_window(target, samples, run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    with pytest.raises(ValueError, match=r"sliding_window \(6 vs 9\)"):
        train(target, samples, copy, replace(config(target), sliding_window=9), 41, resume=True)


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"layer_types": "sliding,full"}, "has sliding layers: give --sliding-window N"),
        ({"layer_types": "full,full", "sliding_window": 4}, "has no sliding layer"),
        ({"layer_types": "sliding"}, "names 1 layers, the drafter has 2"),
        ({"layer_types": "sliding,local", "sliding_window": 4}, "'local' is not full or sliding"),
    ],
)
def test_bad_layer_options_are_refused_before_anything_runs(opts, message):
    with pytest.raises(ValueError, match=message):
        resolve_init_drafter(run_opts(drafter_layers=2, **opts))


def test_sliding_window_alone_makes_every_layer_sliding(target):
    opts, _ = resolve_init_drafter(run_opts(drafter_layers=2, sliding_window=5))
    drafter = build_drafter(target, opts, torch.device("cpu"))
    assert drafter.config.layer_types == ("sliding_attention",) * 2


def test_a_checkpoint_from_before_sliding_layers_resumes(target, samples, tmp_path):
    """Checkpoints written before ``layer_types``/``sliding_window`` existed hold neither:
    they are full-attention drafters, and resume as such."""
    from trainer.train import checkpoint as ckpt

    full = replace(config(target), layer_types=None, sliding_window=None)
    run = train(target, samples, tmp_path / "old", full, 2)
    path = ckpt.latest_checkpoint(run)
    saved, per_rank = ckpt.load_checkpoint(path, local_env())
    old = {
        k: v for k, v in saved.drafter_config.items() if k not in ("layer_types", "sliding_window")
    }
    shutil.rmtree(path)
    ckpt.save_checkpoint(
        run, saved.step, local_env(), record=replace(saved, drafter_config=old),
        per_rank={k: v for k, v in per_rank.items() if k in ("loader", "rng")},
    )  # fmt: skip
    train(target, samples, run, full, 3, resume=True)
    assert read_trained_drafter(run).step == 3


@pytest.fixture(scope="module")
def bidirectional(target, samples, tmp_path_factory):
    """A drafter whose sliding layers see their whole block (``is_causal: false``)."""
    run = tmp_path_factory.mktemp("swa-bi-run")
    train(target, samples, run, replace(config(target), sliding_causal=False), 12)
    out = export_drafter(run, tmp_path_factory.mktemp("swa-bi") / "d", dtype="fp32")
    return out, trained_drafter(run)


def test_a_bidirectional_sliding_drafter_round_trips(bidirectional, folder, target, tmp_path):
    bi, drafter = bidirectional
    cfg = json.loads((bi / "config.json").read_text())
    assert cfg["is_causal"] is False and cfg["layer_types"] == list(KINDS)
    assert drafter.layers[0].rule == LayerRule(WINDOW, causal=False)
    ids = torch.randint(0, MASK, (26,), generator=torch.Generator().manual_seed(4))
    feats, _ = target.features(ids[None])
    anchor = 15
    blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
    noise = drafter.block_inputs(target.embed_tokens, ids[anchor : anchor + 1])[None]
    with torch.no_grad():
        ref = drafter(target.embed_tokens, blocks)
        out = load(bi)(
            noise_embeds=noise, context_hidden_states=feats[:, :anchor],
            position_ids=torch.arange(anchor + B)[None],
        ).last_hidden_state[0]  # fmt: skip
        causal = DFlashDrafter(replace(drafter.config, sliding_causal=True))
        causal.load_state_dict(drafter.state_dict())
        other = causal(target.embed_tokens, blocks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(other, ref, atol=1e-3)
    opts, spec = resolve_init_drafter(run_opts(init_drafter=bi))
    assert opts.sliding_bidirectional
    rebuilt = build_drafter(target, opts, torch.device("cpu"))
    init_from_folder(rebuilt, spec, target, replace(opts, run_dir=tmp_path))
    assert rebuilt.config == drafter.config
    # The causal export with the flag: they disagree.
    with pytest.raises(ValueError, match="drop --sliding-bidirectional"):
        resolve_init_drafter(run_opts(init_drafter=folder, sliding_bidirectional=True))


def test_the_remote_code_refuses_gaps_in_a_sliding_layer_mask(folder):
    """Positions are counted from a row's left edge: padding inside a row would shift them,
    so a sliding layer refuses it (left padding is fine)."""
    model = load(folder)
    n, h = 9, model.config.hidden_size
    ctx = torch.randn(2, n, model.fc.in_features)
    noise = torch.randn(2, B, h)
    pos = torch.arange(n + B)[None].expand(2, -1)
    left = torch.ones(2, n + B, dtype=torch.long)
    left[1, :3] = 0
    with torch.no_grad():
        model(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos, attention_mask=left)
        gap = torch.ones(2, n + B, dtype=torch.long)
        gap[1, 4] = 0
        with pytest.raises(ValueError, match="left padding only"):
            model(
                noise_embeds=noise, context_hidden_states=ctx, position_ids=pos, attention_mask=gap
            )
