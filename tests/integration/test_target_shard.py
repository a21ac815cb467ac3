"""A target sharded over the ranks (``--target-shard``, ``trainer.model.sharding``) is the
whole target: features, loss, gradients and tau equal, for a dense Qwen3, a Qwen3-MoE
(one checkpoint tensor per expert) and a GPT-OSS (experts stacked, sliding layers),
padded and packed, with 2 gloo ranks on CPU; each rank holds half the decoder layers. Also
the per-expert reader unsharded, what a sharded load refuses, ``auto``'s rule, and
``dflash-train train --target-shard fsdp`` against a daemon, resumed on one rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_jobs import daemon, records, run, train_cmd
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.sharding import drafter_params_estimate, shard_needed
from trainer.model.target import target_from_options
from trainer.model.weights import WeightsError, load_model
from trainer.options import TargetOptions
from trainer.sections import RunOptions

pytestmark = [pytest.mark.integration, pytest.mark.heavy(29)]
__all__ = ["daemon"]  # the fixture (trainer_jobs)
WORKER = Path(__file__).parents[1] / "workers" / "sharded_target.py"
ROOT = Path(__file__).parents[2]
SHAPE = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.to(torch.bfloat16).save_pretrained(path)  # read back in fp32: the reader converts
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    torch.manual_seed(0)
    # an odd MLP width: ranks hold 65 and 64 rows of gate_proj and up_proj (torch.chunk's)
    dense = Qwen3ForCausalLM(Qwen3Config(**SHAPE, intermediate_size=129, num_hidden_layers=4))
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**SHAPE, intermediate_size=128, moe_intermediate_size=32,
                       num_hidden_layers=3, num_experts=4, num_experts_per_tok=2)
    )  # fmt: skip
    gpt = GptOssForCausalLM(
        GptOssConfig(**SHAPE, intermediate_size=64, num_hidden_layers=3, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    )  # fmt: skip
    return {n: _save(m, root / n) for n, m in (("dense", dense), ("moe", moe), ("gptoss", gpt))}


def test_a_sharded_target_is_the_whole_one(models, tmp_path):
    """2 ranks: per model, everything equal to the whole target's on the same rank (fp32
    on CPU: exactly, as the all-gathered layers are bit for bit the loaded ones)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(WORKER), str(tmp_path), *map(str, models.values())]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for name in models:  # every row on exactly one rank
        local = sum(r[name]["bytes_sharded"]["layers_local"] for r in ranks)
        assert local == ranks[0][name]["bytes_whole"]["layers_total"], name
    for rank in (0, 1):
        for name, r in ranks[rank].items():
            where = f"{name} rank {rank}"
            assert r["sharded"] and r["same_fingerprint"], where
            for key in ("features", "train_padded", "train_packed", "grad_padded",
                        "grad_packed", "prefetch", "hsdp"):  # fmt: skip
                assert r[key] <= 1e-6, (where, key, r[key])
            for key in ("loss_padded", "loss_packed"):
                assert r[key][0] == pytest.approx(r[key][1], rel=1e-6, abs=1e-7), (where, key)
            whole, sharded = r["bytes_whole"], r["bytes_sharded"]
            assert sharded["layers_total"] == whole["layers_total"] == whole["layers_local"]
            half = whole["layers_total"] / 2  # on each rank, to a row of a tensor
            assert abs(sharded["layers_local"] - half) <= 0.01 * half, where
            assert sharded["other"] == whole["other"]  # embedding, norm, head: whole on each
            assert r["hsdp_bytes"] == whole and r["hsdp_fingerprint"], where  # a node's all
            # rank 1 had nothing to train and still ran its forward with rank 0's
            assert (r["empty_micro_loss"] is None) == (rank == 1), where
            assert r["prompts"] == (3 if rank == 0 else 1)
            assert r["tau_sums"][0] == r["tau_sums"][1], where
            assert r["batched_same"], where


def test_a_moe_checkpoint_of_per_expert_tensors_is_read_into_the_stacked_experts(
    models, caplog, tmp_path
):
    """Qwen3-MoE checkpoints keep one tensor per expert, the model one stacked tensor: the
    reader fills its rows (no ``from_pretrained`` fallback) and equals a plain load."""
    with caplog.at_level("INFO", logger="trainer.model.weights"):
        ours = load_model(models["moe"], "cpu", torch.float32)
    assert "from_pretrained" not in caplog.text
    plain = AutoModelForCausalLM.from_pretrained(models["moe"], dtype=torch.float32)
    mine, theirs = ours.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert mine["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    # one expert's up_proj missing: the stacked tensor is not filled, named in one line
    part = tmp_path / "part"
    shutil.copytree(models["moe"], part)
    state = load_file(part / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, part / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"has no model.layers.1.mlp.experts.gate_up_proj"):
        load_model(part, "cpu", torch.float32)


def test_a_sharded_load_refuses_what_it_cannot_read_in_shards(models, tmp_path):
    """``from_pretrained`` would put the whole model on every rank: one line instead."""
    never = lambda model: pytest.fail("sharded before the checkpoint was checked")  # noqa: E731
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "config.json").write_text((models["dense"] / "config.json").read_text())
    with pytest.raises(WeightsError, match="read from safetensors files; it has none"):
        load_model(empty, "cpu", torch.float32, shard=never)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((models["dense"] / "config.json").read_text())
    state = load_file(models["dense"] / "model.safetensors")
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, renamed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"cannot be loaded sharded .*'model.extra.weight'"):
        load_model(renamed, "cpu", torch.float32, shard=never)


def test_auto_shards_only_what_does_not_fit_next_to_the_drafter():
    gib = 2**30
    fits = dict(target_bytes=16 * gib, drafter_params=10**9 // 2, total_bytes=80 * gib)
    # 16 GiB + 8 GB of drafter state + 20 GiB of activations: fits 60 GiB free, not 40
    assert not shard_needed(world_size=8, free_bytes=60 * gib, **fits)
    assert shard_needed(world_size=8, free_bytes=40 * gib, **fits)
    assert not shard_needed(world_size=1, free_bytes=1, **fits)  # nothing to shard over
    # the drafter estimate is its real size (1 layer of Qwen3-8B's width, 5 features)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
    real = DFlashDrafter(DrafterConfig.from_target(cfg, num_target_layers=5, num_layers=1))
    count = sum(p.numel() for p in real.parameters())
    assert drafter_params_estimate(cfg, 1, 5) == pytest.approx(count, rel=0.05)


def test_train_with_a_sharded_target_then_resume_on_one_rank(daemon, tmp_path):
    """``dflash-train train --target-shard fsdp`` on 2 ranks against the daemon: it trains
    (tau measured at the start and the end), each rank holding half the
    decoder layers (the summary says so per rank); ``--resume`` on 1 rank (``auto``: the
    target whole) continues from its checkpoint (the target's fingerprint is the same
    sharded or whole)."""
    target = tmp_path / "target"
    target_from_options(TargetOptions(), "cpu").model.save_pretrained(target)
    steps, run_dir = 6, tmp_path / "run"
    # given relative to where the command runs: recorded as a path that names it anywhere
    where = os.path.relpath(target)
    two = train_cmd(daemon.endpoint, run_dir, "shard", steps, "--target", where)
    run([*two, "--target-shard", "fsdp"], tmp_path / "two.log")
    assert json.loads((run_dir / "config.json").read_text())["target"] == str(target.resolve())
    recs = records(run_dir)
    assert sorted(recs) == list(range(steps + 1))
    assert 1.0 <= recs[0]["tau"] <= 8.0 and 1.0 <= recs[steps]["tau"] <= 8.0
    assert all(0 < recs[s]["loss"] < 10 for s in range(1, steps + 1))
    memory = json.loads((run_dir / "summary.json").read_text())["target_memory"]
    assert memory["sharded"] and len(memory["ranks"]) == 2
    for rank in memory["ranks"]:
        assert rank["layers_local_mib"] == pytest.approx(rank["layers_total_mib"] / 2, rel=0.01)
    one = [*two[:4], "--nproc-per-node", "1", *two[6:]]
    one[one.index("--steps") + 1] = str(steps + 2)  # 2 more steps of the first shape
    run([*one, "--target-shard", "auto", "--resume"], tmp_path / "one.log")
    log = (tmp_path / "one.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{steps:08d}'}" in log
    assert "world_size 2 x grad_accum 1 -> 1 x 1" in log
    after = records(run_dir)
    assert max(after) > steps and "tau" in after[max(after)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and not summary["target_memory"]["sharded"]


def test_auto_estimates_from_the_target_s_shape_on_the_meta_device(models, monkeypatch, caplog):
    """``auto`` weighs the target's bytes (its shape on the meta device, nothing loaded)
    and the drafter's training state against the rank's free memory."""
    from trainer.train import target_shard
    from trainer.train.distributed import DistEnv

    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    opts = RunOptions(endpoint="ipc:///x", run_dir=Path("/x"), target=str(models["dense"]),
                      target_shard="auto", drafter_layers=1)  # fmt: skip
    with caplog.at_level("INFO", logger="trainer.train.target_shard"):
        assert not target_shard._needs_sharding(opts, env)  # a few MiB fit this host
    assert "target 0.00 GiB" in caplog.text and "fits" in caplog.text
    monkeypatch.setattr(target_shard, "device_memory", lambda env: (1 << 20, 1 << 20))
    assert target_shard._needs_sharding(opts, env)  # not in 1 MiB
    assert target_shard._needs_sharding(replace(opts, target="tiny"), env)
