"""``dflash-train export`` and ``--init-drafter``: a checkpoint written by the real training
loop becomes a Hugging Face folder that Transformers loads with no missing or unused
tensors, computes what the trainer's drafter computes, and drafts losslessly (and with the
same acceptance lengths as our verifier) inside ``generate(speculation_type="dflash")``;
the folder reads back into a drafter bit for bit; what cannot be served is refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from drafters import greedy_samples, train_run, trained_drafter
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from trainer.cli import main
from trainer.hf.export import export_drafter
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DraftBlocks, DrafterConfig
from trainer.model.target import target_from_options
from trainer.model.verifier import DrafterProposer, greedy_generate, speculative_generate
from trainer.run import (
    build_drafter,
    init_from_folder,
    resolve_init_drafter,
)
from trainer.sections import RunOptions
from trainer.train import checkpoint as ckpt
from trainer.train.distributed import local_env

B = 8
MASK = 511
STEPS = 60


def tiny_opts(**over) -> RunOptions:
    """``dflash-train train`` options as the command line hands them to ``run_training``."""
    opts = dict(
        endpoint="unused", target="tiny", tiny_vocab=512, tiny_layers=4, tiny_hidden=128,
        tiny_seed=0, tiny_heads=4, tiny_kv_heads=2, tiny_intermediate=None, layers=None,
        drafter_layers=None, block_size=None, init_drafter=None, mask_token_id=None,
        learned_mask=False, seed=0, run_dir=Path("unused"), resume=False, anchors_per_doc=6,
        max_anchors=0, gamma=7.0, loss_chunk=1024, attention="sdpa", steps=1, epochs=None,
        grad_accum=None, lr=3e-3, warmup=0.0, weight_decay=0.01, grad_clip=1.0,
        eval_every=0, eval_new_tokens=16, ckpt_every=0, keep_checkpoints=3, no_progress=True,
    )  # fmt: skip
    return RunOptions(**{**opts, **over})


def train(target, samples, run_dir: Path, *, mask: int | None = MASK, steps: int = 1) -> Path:
    """A run of the real loop, its checkpoint saved as ``dflash-train train`` saves it."""
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=mask
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    if mask is None:
        drafter.mask_embedding.data.copy_(target.embed_tokens.weight.mean(0))
    return train_run(
        target, samples, run_dir, drafter, LossConfig(block_size=B, anchors_per_doc=6), steps
    )


@pytest.fixture(scope="module")
def samples(target) -> list[tuple[list[int], list[int]]]:
    return greedy_samples(target, MASK)


@pytest.fixture(scope="module")
def run_dir(target, samples, tmp_path_factory) -> Path:
    return train(target, samples, tmp_path_factory.mktemp("run"), steps=STEPS)


@pytest.fixture(scope="module")
def trained(run_dir) -> DFlashDrafter:
    return trained_drafter(run_dir)


@pytest.fixture(scope="module")
def folders(run_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    return {d: export_drafter(run_dir, root / d, dtype=d) for d in ("bf16", "fp32")}


def test_exported_files_are_readable_per_the_umask(folders):
    """safetensors writes 0600; the export is served by another user (vLLM's): every file
    and the folder get what the umask gives (the tests run under umask 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for folder in folders.values():
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
        for p in folder.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask, p.name


def load(folder: Path, **kw):
    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True, **kw
    )
    return model.eval(), info


def test_folder_is_the_serving_format(folders, target, run_dir):
    folder = folders["bf16"]
    files = {p.name for p in folder.iterdir()}
    assert files == {
        "config.json", "model.safetensors", "configuration_dflash.py", "modeling_dflash.py",
        "README.md", "dflash_export.json",
    }  # fmt: skip
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    per_layer = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    want = {f"layers.0.{n}" for n in per_layer} | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert names == want
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_target_layers"] == target.num_layers == 4  # depth, not captured layers
    assert cfg["vocab_size"] == 512 and cfg["num_hidden_layers"] == 1
    assert cfg["block_size"] == B and cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 1, 2]}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM numbering
    assert cfg["layer_types"] == ["full_attention"] and cfg["tie_word_embeddings"] is False
    info = json.loads((folder / "dflash_export.json").read_text())
    assert info["step"] == STEPS and info["target"] == "tiny"
    assert "[0, 1, 2]" in (folder / "README.md").read_text()

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.target_layer_ids == [0, 1, 2]
    assert (config.mask_token_id, config.block_size) == (MASK, B)
    model, loading = load(folder)
    assert type(model).__name__ == "DFlashDraftModel" and model.dtype == torch.bfloat16
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    assert not loading["mismatched_keys"] and not loading["error_msgs"]
    assert {n for n, _ in model.named_parameters()} == want


def draft_inputs(target, trained, anchor: int = 13):
    ids = torch.randint(0, MASK, (24,), generator=torch.Generator().manual_seed(3))
    feats, _ = target.features(ids[None])
    blocks = DraftBlocks.one_document(feats[:, :anchor], [anchor], ids[anchor : anchor + 1])
    noise = trained.block_inputs(target.embed_tokens, ids[anchor : anchor + 1])[None]
    return blocks, feats[:, :anchor], noise, torch.arange(anchor + B)[None]


@pytest.mark.parametrize(("dtype", "atol"), [("fp32", 1e-5), ("bf16", 0.08)])
def test_exported_model_computes_the_trainer_drafter(folders, target, trained, dtype, atol):
    blocks, ctx, noise, pos = draft_inputs(target, trained)
    model, _ = load(folders[dtype], dtype=torch.float32)
    with torch.no_grad():
        ref = trained(target.embed_tokens, blocks)
        out = model(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos)
        hidden = out.last_hidden_state[0]
        ref_logits, logits = target.lm_head(ref[1:]), target.lm_head(hidden[1:])
    torch.testing.assert_close(hidden, ref, atol=atol, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=4 * atol, rtol=0)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_bf16_export_in_bf16_matches_the_drafter_in_bf16(folders, target, trained):
    blocks, ctx, noise, pos = draft_inputs(target, trained)
    model, _ = load(folders["bf16"])
    ref_drafter = DFlashDrafter(trained.config).to(torch.bfloat16)
    ref_drafter.load_state_dict(trained.state_dict())
    bf16_blocks = DraftBlocks(**{**blocks.__dict__, "feats": blocks.feats.bfloat16()})
    with torch.no_grad():
        ref = ref_drafter(target.embed_tokens, bf16_blocks)
        out = model(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos)
    assert out.last_hidden_state.dtype == noise.dtype  # returned in the caller's dtype
    torch.testing.assert_close(out.last_hidden_state[0].bfloat16(), ref, atol=0.05, rtol=0.02)


def test_transformers_dflash_generate_is_lossless(folders, target, trained, samples):
    """Transformers' own DFlash loop with the exported model: the greedy output is the
    target's, and every step accepts what our verifier accepts with the trainer's drafter
    (the context each drafter call receives is what the previous step committed)."""
    prompts = [torch.tensor(s[0][:8]) for s in samples[:3]]
    prompts.append(torch.randint(0, MASK, (11,), generator=torch.Generator().manual_seed(9)))
    accepted = []
    for dtype in ("fp32", "bf16"):
        model, _ = load(folders[dtype], dtype=torch.float32)
        context_lengths: list[int] = []
        forward = model.forward

        def counting(*args, _forward=forward, _seen=context_lengths, **kw):
            _seen.append(kw["context_hidden_states"].shape[1])
            return _forward(*args, **kw)

        model.forward = counting
        for prompt in prompts:
            context_lengths.clear()
            kw = dict(do_sample=False, max_new_tokens=32, min_new_tokens=32)
            spec = target.model.generate(
                prompt[None], assistant_model=model, speculation_type="dflash", **kw
            )
            plain = target.model.generate(prompt[None], **kw)
            assert torch.equal(spec, plain)
            assert torch.equal(spec[0, prompt.numel() :], greedy_generate(target, prompt, 32))
            ours = speculative_generate(
                target, DrafterProposer(target, trained), prompt, block_size=B, max_new_tokens=32
            )
            # First call: the prompt's context; then one call per step (the last step of
            # ours, for the very last token, Transformers takes without drafting).
            assert context_lengths[0] == prompt.numel()
            steps = context_lengths[1:]
            assert steps == ours.acceptance_lengths[: len(steps)]
            assert len(steps) >= ours.served_steps - 2
            accepted += steps
    assert max(accepted) > 1  # the trained drafter is right some of the time


def test_init_drafter_round_trip(folders, trained, target, run_dir, tmp_path, caplog):
    for dtype, folder in folders.items():
        opts, folder_spec = resolve_init_drafter(tiny_opts(init_drafter=folder, run_dir=tmp_path))
        assert (opts.layers, opts.block_size, opts.drafter_layers) == ("0,1,2", B, 1)
        assert opts.mask_token_id == MASK
        run_target = target_from_options(opts, "cpu", [0, 1, 2])
        drafter = build_drafter(run_target, opts, torch.device("cpu"))
        init_from_folder(drafter, folder_spec, run_target, opts)
        for name, value in trained.state_dict().items():
            want = value.bfloat16().float() if dtype == "bf16" else value
            assert torch.equal(drafter.state_dict()[name], want), (dtype, name)
    blocks, *_ = draft_inputs(target, trained)
    with torch.no_grad():  # the fp32 round trip: the same drafter, the same logits
        fresh = DFlashDrafter(trained.config)
        opts, spec = resolve_init_drafter(tiny_opts(init_drafter=folders["fp32"]))
        init_from_folder(fresh, spec, target, replace(opts, run_dir=tmp_path))
        assert torch.equal(fresh(target.embed_tokens, blocks), trained(target.embed_tokens, blocks))

    # --resume with a checkpoint: the checkpoint wins, the folder's weights are not loaded.
    resumed = DFlashDrafter(trained.config)
    before = {k: v.clone() for k, v in resumed.state_dict().items()}
    cfg = tiny_opts(run_dir=run_dir, resume=True, block_size=B, drafter_layers=1)
    with caplog.at_level(logging.INFO, logger="trainer.run"):
        init_from_folder(resumed, spec, target, cfg)
    assert "wins over --init-drafter" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in resumed.state_dict().items())


def export_cli(*args: str):
    return CliRunner().invoke(main, ["export", *map(str, args)])


def test_export_refusals(target, samples, run_dir, tmp_path):
    learned = train(target, samples[:4], tmp_path / "learned", mask=None)
    res = export_cli(learned, tmp_path / "x")
    assert res.exit_code == 1 and "learned MASK vector" in res.output
    assert "step-00000001" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()

    # A MASK id outside the target vocabulary, in the trainer's own checkpoint format.
    saved, mine = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir), local_env())
    config = {**saved.drafter_config, "mask_token_id": 512}
    mine = {k: v for k, v in mine.items() if k in ("loader", "rng")}
    record = dataclasses.replace(saved, drafter_config=config)
    ckpt.save_checkpoint(tmp_path / "big", 3, local_env(), record=record, per_rank=mine)
    res = export_cli(tmp_path / "big", tmp_path / "y")
    assert res.exit_code == 1 and "mask_token_id 512 is outside" in res.output

    out = tmp_path / "out"
    assert export_cli(run_dir, out).exit_code == 0
    res = export_cli(run_dir, out)
    assert res.exit_code == 1 and "--force replaces it" in res.output
    res = export_cli(run_dir, out, "--force", "--dtype", "fp32")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]
    res = export_cli(run_dir, tmp_path / "z", "--step", "7")
    assert res.exit_code == 1 and "no checkpoint step-00000007" in res.output


def test_export_of_a_checkpoint_without_target_config(run_dir, tmp_path):
    """Checkpoints written before ``meta.target_config``: the run's config.json tells."""
    saved, mine = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir), local_env())
    meta = {k: v for k, v in saved.meta.items() if k != "target_config"}
    mine = {k: v for k, v in mine.items() if k in ("loader", "rng")}
    old = tmp_path / "old"
    record = dataclasses.replace(saved, meta=meta)
    ckpt.save_checkpoint(old, 5, local_env(), record=record, per_rank=mine)
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        export_drafter(old, tmp_path / "a")
    tiny_opts(run_dir=old).write(requested_loader_spec={}, world_size=1)
    cfg = json.loads((export_drafter(old, tmp_path / "b") / "config.json").read_text())
    assert (cfg["num_target_layers"], cfg["vocab_size"]) == (4, 512)


def edited_copy(folder: Path, dest: Path, *, config=None, tensors=None) -> Path:
    shutil.copytree(folder, dest)
    if config is not None:
        cfg = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(config(cfg)))
    if tensors is not None:
        state = tensors(load_file(dest / "model.safetensors"))
        save_file(state, dest / "model.safetensors")
    return dest


def init_error(folder: Path, target, tmp_path: Path, **opts) -> str:
    with pytest.raises(ValueError) as err:
        o, spec = resolve_init_drafter(tiny_opts(init_drafter=folder, **opts))
        drafter = build_drafter(target, o, torch.device("cpu"))
        init_from_folder(drafter, spec, target, replace(o, run_dir=tmp_path))
    return str(err.value)


def test_init_drafter_refusals(folders, target, tmp_path):
    src = folders["fp32"]
    assert "--layers [0, 1] differs" in init_error(src, target, tmp_path, layers="0,1")
    assert "--block-size 16 differs" in init_error(src, target, tmp_path, block_size=16)
    assert "--learned-mask" in init_error(src, target, tmp_path, learned_mask=True)

    def drop(state):
        return {k: v for k, v in state.items() if k != "layers.0.mlp.up_proj.weight"}

    def rename(state):
        return {k.replace("mlp.up_proj", "mlp.upp_proj"): v for k, v in state.items()}

    def extra(state):
        return {**state, "lm_head.weight": torch.zeros(512, 128)}

    for name, edit, needle in (
        ("missing", drop, "no tensor layers.0.mlp.up_proj.weight"),
        ("misnamed", rename, "no tensor layers.0.mlp.up_proj.weight"),
        ("extra", extra, "tensor lm_head.weight is not a drafter weight"),
    ):
        bad = edited_copy(src, tmp_path / name, tensors=edit)
        assert needle in init_error(bad, target, tmp_path), name

    def shrink_fc(state):
        return {**state, "fc.weight": state["fc.weight"][:, :256].contiguous()}

    bad = edited_copy(src, tmp_path / "fc", tensors=shrink_fc)
    assert "fc.weight has shape [128, 256]" in init_error(bad, target, tmp_path)

    for name, change, needle in (
        ("vocab", {"vocab_size": 1000}, "vocab_size 1000 != 512"),
        ("depth", {"num_target_layers": 36}, "num_target_layers 36 != 4"),
        ("arch", {"architectures": ["LlamaForCausalLM"]},
         "is none of ['DFlash2DraftModel', 'DFlashDraftModel']"),
        ("dflash2", {"dflash_config": {"target_layer_ids": [0, 1, 2], "selector_rank": 256}},
         "selector_rank = 256 is not supported"),
    ):  # fmt: skip
        bad = edited_copy(src, tmp_path / name, config=lambda c, ch=change: {**c, **ch})
        assert needle in init_error(bad, target, tmp_path), name


def test_a_damaged_drafter_folder_is_named_by_the_file_at_fault(folders, target, tmp_path):
    """A config.json cut off, a model.safetensors cut short, an index that is not JSON: one
    line naming the file and what it should be (with the parser's line and column), through
    --init-drafter and `eval` alike (one reader: ``loader_server.wire.files``)."""
    src = folders["fp32"]
    cases = {}
    cut = tmp_path / "cut-config"
    shutil.copytree(src, cut)
    text = (cut / "config.json").read_text()
    (cut / "config.json").write_text(text[: len(text) // 2])
    cases[cut] = rf"{cut}/config.json: not a drafter folder's config.json \(JSON\) \(.* at line"
    short = tmp_path / "cut-weights"
    shutil.copytree(src, short)
    data = (short / "model.safetensors").read_bytes()
    (short / "model.safetensors").write_bytes(data[: len(data) // 3])
    cases[short] = rf"{short}/model.safetensors: not safetensors weights \("
    for folder, says in cases.items():
        assert re.search(says, init_error(folder, target, tmp_path)), folder


def test_eval_of_a_run_killed_before_its_first_checkpoint_says_so(target, tmp_path):
    """A run folder with a config.json and metrics but no checkpoint is a run, not a drafter
    folder with no architectures."""
    from trainer.eval.runner import load_drafter

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "endpoint": "x"}))
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"a training run with no checkpoint yet \(stopped "
                       r"before its first\): nothing to evaluate"):  # fmt: skip
        load_drafter(run, target)


def test_a_released_folder_is_read_as_its_writer_computes_it_or_refused(
    run_dir, folders, target, tmp_path, caplog
):
    """speculators' id for the target's depth is the last layer's output before the final
    norm (vLLM's numbering); this trainer's last layer feature is after it: refused, not
    computed otherwise. A MASK token other than the target's is said once, at start."""
    spec = export_drafter(run_dir, tmp_path / "spec", dtype="fp32", fmt="speculators")
    ids = json.loads((spec / "config.json").read_text())["aux_hidden_state_layer_ids"]
    depth = target.num_layers
    assert depth not in ids  # what export writes

    def last(c):
        return {**c, "aux_hidden_state_layer_ids": [*ids[:-1], depth]}

    bad = edited_copy(spec, tmp_path / "prenorm", config=last)
    why = init_error(bad, target, tmp_path)
    assert f"aux_hidden_state_layer_ids holds {depth}, the target's depth" in why
    assert "before the final norm" in why

    def other_mask(c):
        return {**c, "dflash_config": {**c["dflash_config"], "mask_token_id": 7}}

    masked = edited_copy(folders["fp32"], tmp_path / "mask", config=other_mask)
    with caplog.at_level(logging.WARNING, logger="trainer.hf.folder"):
        for _ in range(2):  # read twice, said once
            o, found = resolve_init_drafter(tiny_opts(init_drafter=masked))
            drafter = build_drafter(target, o, torch.device("cpu"))
            init_from_folder(drafter, found, target, replace(o, run_dir=tmp_path))
    said = [r.getMessage() for r in caplog.records if "MASK token is 7" in r.getMessage()]
    assert len(said) == 1 and f"the target's {MASK}" in said[0], said
