"""Long context: a tiny target whose ``config.json`` has YaRN scaling. The drafter trained
against it rotates as it does; ``dflash-train export`` writes the scaling and the target's
context length into both dialects' ``config.json``; Transformers reloads the export (its
config and the remote code) and computes what the trainer's drafter computes at positions
past the original context, where plain RoPE would not; ``--init-drafter`` reads it back onto
the same target and refuses it for a target without the scaling; a checkpoint trained with
plain RoPE against the scaled target is exported as trained, with a warning; the batched
verifier equals the reference one on 4K-token prompts."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafters import greedy_samples, train_run, trained_drafter
from transformers import AutoConfig, AutoModel

from trainer.hf.export import export_drafter
from trainer.hf.folder import config_from_folder, init_drafter, read_drafter_folder
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DraftBlocks, DrafterConfig
from trainer.model.speculate import BatchedVerifier
from trainer.model.target import TinyTargetSpec, build_tiny_model, load_target
from trainer.model.verifier import DrafterProposer, speculative_generate
from trainer.options import TargetOptions
from trainer.run import run_meta

pytestmark = pytest.mark.integration

B = 8
MASK = 511
ORIGINAL = 1024  # the tiny target's "pretraining" context; YaRN x4 to 4,096
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
CONTEXT = 3000  # past the original context: plain RoPE and YaRN differ there


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory) -> Path:
    """The tiny target with YaRN in its config.json, saved as a model folder."""
    path = tmp_path_factory.mktemp("yarn-target")
    spec = TinyTargetSpec(max_positions=4 * ORIGINAL, rope_scaling=YARN)
    build_tiny_model(spec).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def yarn_target(yarn_dir):
    return load_target(str(yarn_dir), layer_ids=[0, 1, 2])


def train(target, run_dir: Path, *, scaled: bool = True, steps: int = 20):
    """The real loop on the target's greedy continuations; ``scaled`` False: the drafter
    rotates with plain RoPE, as drafters did before they followed the target's scaling."""
    cfg = DrafterConfig.from_target(target.config, num_target_layers=3, block_size=B,
                                    mask_token_id=MASK)  # fmt: skip
    if not scaled:
        cfg = replace(cfg, rope_scaling=None)
    torch.manual_seed(0)
    samples = greedy_samples(target, MASK)
    loss = LossConfig(block_size=B, anchors_per_doc=6)
    return train_run(target, samples, run_dir, DFlashDrafter(cfg), loss, steps)


@pytest.fixture(scope="module")
def run_dir(yarn_target, tmp_path_factory) -> Path:
    return train(yarn_target, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def trained(run_dir) -> DFlashDrafter:
    return trained_drafter(run_dir)


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    return {
        fmt: export_drafter(run_dir, root / fmt, dtype="fp32", fmt=fmt)
        for fmt in ("dflash", "speculators")
    }


def test_the_drafter_rotates_as_the_target(trained, yarn_target, yarn_dir):
    assert trained.config.rope_scaling == YARN
    assert yarn_target.config.rope_parameters["rope_type"] == "yarn"
    # what ``dflash-train train --target DIR`` records for the export
    meta = run_meta(TargetOptions(target=str(yarn_dir)), yarn_target)
    assert meta["target_config"]["rope_scaling"] == YARN


def test_both_dialects_carry_the_scaling_and_the_context(exports):
    want = {**YARN, "rope_theta": 10000.0}
    dflash = json.loads((exports["dflash"] / "config.json").read_text())
    spec = json.loads((exports["speculators"] / "config.json").read_text())
    for cfg in (dflash, spec["transformer_layer_config"]):
        assert cfg["rope_parameters"] == want and cfg["rope_scaling"] == YARN
        assert cfg["max_position_embeddings"] == 4 * ORIGINAL
    config = AutoConfig.from_pretrained(exports["dflash"], trust_remote_code=True)
    assert config.rope_parameters == want and config.max_position_embeddings == 4 * ORIGINAL


def long_inputs(target, drafter: DFlashDrafter, anchor: int = CONTEXT):
    ids = torch.randint(0, MASK, (anchor + B,), generator=torch.Generator().manual_seed(3))
    feats, _ = target.features(ids[None])
    blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
    noise = drafter.block_inputs(target.embed_tokens, ids[anchor : anchor + 1])[None]
    return blocks, feats[:, :anchor], noise, torch.arange(anchor + B)[None]


def test_transformers_computes_the_trainer_s_drafter_past_the_original_context(
    exports, yarn_target, trained
):
    blocks, ctx, noise, pos = long_inputs(yarn_target, trained)
    model = AutoModel.from_pretrained(exports["dflash"], trust_remote_code=True).eval()
    plain = DFlashDrafter(replace(trained.config, rope_scaling=None)).eval()
    plain.load_state_dict(trained.state_dict())
    with torch.no_grad():
        ours = trained(yarn_target.embed_tokens, blocks)
        theirs = model(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos)
        unscaled = plain(yarn_target.embed_tokens, blocks)
    torch.testing.assert_close(theirs.last_hidden_state[0], ours, atol=1e-5, rtol=0)
    assert (unscaled - ours).abs().max() > 1e-2  # the scaling matters at these positions


def test_init_drafter_reads_it_back_and_a_target_without_the_scaling_refuses_it(
    exports, yarn_target, trained, target
):
    for folder in exports.values():
        spec = read_drafter_folder(folder)
        assert spec.rope_scaling == YARN
        drafter = DFlashDrafter(config_from_folder(spec, yarn_target))
        init_drafter(drafter, spec, yarn_target)
        assert drafter.config == trained.config
        assert all(torch.equal(drafter.state_dict()[k], v) for k, v in trained.state_dict().items())
        plain = DFlashDrafter(config_from_folder(spec, target))  # the conftest's plain target
        with pytest.raises(ValueError, match=r"rope_scaling \{.*'yarn'.*\} != None"):
            init_drafter(plain, spec, target)


def test_a_plain_rope_drafter_of_a_scaled_target_exports_as_trained(yarn_target, tmp_path, caplog):
    run = train(yarn_target, tmp_path / "run", scaled=False, steps=2)
    with caplog.at_level(logging.WARNING, logger="trainer.hf.export"):
        out = export_drafter(run, tmp_path / "out")
    assert "target uses RoPE 'yarn'; the drafter was trained (and is exported) with plain" in (
        caplog.text
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_scaling" not in cfg


def test_batched_verifier_equals_the_reference_on_4k_prompts(yarn_target, trained):
    """Prompts of 4,000 tokens (past the original 1,024: YaRN's rotation), greedy."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, MASK, (n,), generator=g) for n in (4000, 3990, 3000)]
    proposer = DrafterProposer(yarn_target, trained)
    want = [
        speculative_generate(yarn_target, proposer, p, block_size=B, max_new_tokens=16)
        for p in prompts
    ]
    got = BatchedVerifier(yarn_target, trained, max_new_tokens=16).generate(prompts)
    for g_, w in zip(got, want, strict=True):
        assert torch.equal(g_.tokens, w.tokens)
        assert g_.acceptance_lengths == w.acceptance_lengths
        assert (g_.served_steps, g_.committed) == (w.served_steps, w.committed)
