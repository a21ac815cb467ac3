"""DFlash2 drafters end to end: the real training loop trains one (with bidirectional
sliding layers and a soft cap, as z-lab's reference DFlash2 has), ``export`` writes a
``DFlash2DraftModel`` folder with the ``dflash_config`` vLLM and SGLang read, and
``--init-drafter`` reads it back into the same drafter (refusing what disagrees);
``--resume`` names a changed selector; DFlash2 flags need ``--drafter dflash2``; a
checkpoint from before DFlash2 existed still resumes."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafters import edited, greedy_samples, run_opts, train_run, trained_drafter

from trainer.hf.export import export_drafter, read_trained_drafter
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.verifier import DrafterProposer, greedy_generate, speculative_generate
from trainer.options import DFLASH2_DEFAULTS
from trainer.run import build_drafter, init_from_folder, resolve_init_drafter
from trainer.train import checkpoint as ckpt
from trainer.train.distributed import local_env

B, MASK, WINDOW = 4, 511, 6
KINDS = ("sliding_attention", "full_attention")
SHAPE = dict(selector_rank=8, selector_top_k=4, conv_group_size=32, final_logit_softcapping=30.0)


def config(target, **kw) -> DrafterConfig:
    return DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=2, block_size=B, mask_token_id=MASK,
        layer_types=KINDS, sliding_window=WINDOW, sliding_causal=False, variant="dflash2",
        **{**SHAPE, **kw},
    )  # fmt: skip


def train(target, samples, run_dir: Path, cfg: DrafterConfig, steps: int, resume=False, **loss):
    torch.manual_seed(0)
    lc = LossConfig(block_size=B, anchors_per_doc=8, **loss)
    return train_run(target, samples, run_dir, DFlashDrafter(cfg), lc, steps, resume=resume)


@pytest.fixture(scope="module")
def samples(target):
    return greedy_samples(target, MASK)


@pytest.fixture(scope="module")
def run_dir(target, samples, tmp_path_factory):
    return train(target, samples, tmp_path_factory.mktemp("d2-run"), config(target), 30)


@pytest.fixture(scope="module")
def trained(run_dir):
    return trained_drafter(run_dir)


@pytest.fixture(scope="module")
def folder(run_dir, tmp_path_factory):
    return export_drafter(run_dir, tmp_path_factory.mktemp("d2-export") / "d", dtype="fp32")


def test_export_is_a_dflash2_folder(folder, trained):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in cfg
    assert not (folder / "modeling_dflash.py").exists()  # Transformers' loop is v1's
    want = {**DFLASH2_DEFAULTS, **SHAPE}
    assert {k: cfg["dflash_config"][k] for k in want} == want
    assert cfg["is_causal"] is False and cfg["layer_types"] == list(KINDS)
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert names == set(trained.state_dict())
    # The names vLLM's DFlash2Qwen3ForCausalLM and speculators' DFlash2DraftModel load.
    served = {
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight",
    }  # fmt: skip
    assert served <= names


def test_init_drafter_reads_a_dflash2_folder_back(folder, target, trained, samples, tmp_path):
    opts, spec = resolve_init_drafter(run_opts(init_drafter=folder))
    assert opts.drafter == "dflash2" and opts.selector_rank == 8 and opts.conv_group_size == 32
    drafter = build_drafter(target, opts, torch.device("cpu"))
    assert drafter.config == trained.config
    init_from_folder(drafter, spec, target, replace(opts, run_dir=tmp_path))
    for name, value in trained.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], value), name
    prompt = torch.tensor(samples[0][0][:8])
    a = speculative_generate(target, DrafterProposer(target, drafter.eval()), prompt,
                             block_size=B, max_new_tokens=32)  # fmt: skip
    b = speculative_generate(target, DrafterProposer(target, trained), prompt,
                             block_size=B, max_new_tokens=32)  # fmt: skip
    assert a.acceptance_lengths == b.acceptance_lengths
    assert torch.equal(a.tokens, greedy_generate(target, prompt, 32))


def test_init_drafter_refuses_what_disagrees(folder, tmp_path):
    def error(src: Path, **opts) -> str:
        with pytest.raises(ValueError) as err:
            resolve_init_drafter(run_opts(init_drafter=src, **opts))
        return str(err.value)

    assert "--drafter dflash differs" in error(folder, drafter="dflash")
    assert "--selector-rank 4 differs" in error(folder, selector_rank=4)
    missing = edited(folder, tmp_path / "m", dflash_config={"conv_group_size": None})
    assert "needs dflash_config.conv_group_size" in error(missing)
    # The same keys in a DFlash (v1) folder change the math that architecture serves.
    v1 = edited(folder, tmp_path / "v1", architectures=["DFlashDraftModel"])
    assert "conv_kernel_size = 2 is not supported" in error(v1)
    other = edited(folder, tmp_path / "o", architectures=["LiLiCorrDraftModel"])
    assert "is none of ['DFlash2DraftModel', 'DFlashDraftModel']" in error(other)


@pytest.mark.parametrize("flag", ["selector_rank", "conv_kernel_size", "selector_alpha"])
def test_dflash2_flags_need_the_dflash2_drafter(flag):
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name} is a DFlash2 option: add --drafter dflash2"):
        resolve_init_drafter(run_opts(**{flag: 2}))


def test_resume_names_a_changed_selector(target, samples, run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    with pytest.raises(ValueError, match=r"selector_rank \(8 vs 16\)"):
        train(target, samples, copy, config(target, selector_rank=16), 31, resume=True)
    with pytest.raises(
        ValueError, match=r"loss config differs from this run's in .*selector_alpha \(.* vs 0.5\)"
    ):
        train(target, samples, copy, config(target), 31, resume=True, selector_alpha=0.5)


def test_a_checkpoint_from_before_dflash2_resumes(target, samples, tmp_path):
    """Checkpoints written before DFlash2 hold none of its drafter fields and no
    ``selector_alpha``: they are DFlash drafters, and resume as such."""
    v1 = DrafterConfig.from_target(
        target.config, num_target_layers=3, num_layers=1, block_size=B, mask_token_id=MASK
    )
    run = train(target, samples, tmp_path / "old", v1, 2)
    path = ckpt.latest_checkpoint(run)
    saved, per_rank = ckpt.load_checkpoint(path, local_env())
    new = {"variant", "vocab_size", *DFLASH2_DEFAULTS}
    old = {k: v for k, v in saved.drafter_config.items() if k not in new}
    loss = {k: v for k, v in saved.loss_config.items() if k != "selector_alpha"}
    shutil.rmtree(path)
    ckpt.save_checkpoint(
        run, saved.step, local_env(), record=replace(saved, drafter_config=old, loss_config=loss),
        per_rank={k: v for k, v in per_rank.items() if k in ("loader", "rng")},
    )  # fmt: skip
    train(target, samples, run, v1, 3, resume=True)
    assert read_trained_drafter(run).step == 3


def test_the_speculators_dialect_holds_the_same_drafter(target, samples, tmp_path):
    """``--format speculators``: speculators' layout (its loader and the converter's output
    are compared in ``make serve-check``), the same tensors, nothing for the DFlash loaders."""
    from safetensors.torch import load_file

    run = train(target, samples, tmp_path / "run", config(target, final_logit_softcapping=None), 2)
    folder = export_drafter(run, tmp_path / "d", dtype="fp32")
    out = export_drafter(run, tmp_path / "s", dtype="fp32", fmt="speculators")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2"
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["speculators_config"]["algorithm"] == "dflash2"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]  # the tiny target's layers 0..2, +1
    assert (cfg["selector_rank"], cfg["selector_top_k"], cfg["conv_group_size"]) == (8, 4, 32)
    assert cfg["sliding_window_non_causal"] is True and cfg["block_size"] == B
    layer = cfg["transformer_layer_config"]
    assert layer["layer_types"] == list(KINDS) and "dflash_config" not in layer
    theirs = load_file(str(out / "model.safetensors"))
    ours = load_file(str(folder / "model.safetensors"))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "dflash_export.json",
        "model.safetensors",
    ]


def test_the_speculators_dialect_refuses_what_it_cannot_say(run_dir, tmp_path):
    """speculators' DFlash2 config has no soft cap: such a drafter in that dialect would be
    served as another model, so the export refuses it (the DFlash dialect carries it)."""
    with pytest.raises(ValueError, match=r"final_logit_softcapping 30\.0: speculators' DFlash2"):
        export_drafter(run_dir, tmp_path / "s", fmt="speculators")
    assert not (tmp_path / "s").exists()
