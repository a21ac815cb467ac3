"""Loading a local target straight onto its device (trainer.model.weights): the weights
equal a plain ``from_pretrained`` load (single file, sharded, tied embeddings, with and
without a dtype change), a rank's peak memory stays at the weights plus one staging buffer
(a plain load converting the dtype holds a whole second copy), and a checkpoint that does
not fit its config is one line naming the tensor."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from scripts.checks.target_load import measure
from trainer.model.target import load_target
from trainer.model.weights import STAGING_BYTES, WeightsError, load_model

pytestmark = pytest.mark.integration


def _save(path: Path, *, dtype: torch.dtype, tied: bool = False, shard: str | None = None,
          hidden: int = 64, vocab: int = 512, layers: int = 2) -> Path:  # fmt: skip
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kw)
    return path


def _plain(path: Path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)


@pytest.mark.parametrize(
    ("saved", "loaded", "tied", "shard"),
    [
        (torch.bfloat16, torch.float32, False, None),  # CPU training of a bf16 release
        (torch.float32, torch.bfloat16, False, "100KB"),  # sharded, with an index
        (torch.bfloat16, torch.float32, True, None),  # tied embeddings: one tensor saved
        (torch.float32, torch.float32, False, None),  # same dtype on CPU: page-cache views
    ],
)
def test_weights_equal_a_plain_load(tmp_path, saved, loaded, tied, shard):
    path = _save(tmp_path / "m", dtype=saved, tied=tied, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    ours, plain = load_model(path, "cpu", loaded).state_dict(), _plain(path, loaded).state_dict()
    assert ours.keys() == plain.keys()
    for k in ours:
        assert ours[k].dtype == loaded and torch.equal(ours[k], plain[k]), k
    model = load_model(path, "cpu", loaded)
    assert not model.training
    for name, buf in model.named_buffers():  # rotary tables are computed, not loaded
        assert torch.equal(buf, dict(_plain(path, loaded).named_buffers())[name]), name
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The trainer's Target loads through it, and a forward is the plain model's.
    target = load_target(str(path), device="cpu", dtype=loaded)
    assert all(torch.equal(t, plain[k]) for k, t in target.model.state_dict().items())
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, _plain(path, loaded)(ids).logits)


def test_a_checkpoint_that_does_not_fit_its_config_is_named(tmp_path):
    path = _save(tmp_path / "m", dtype=torch.bfloat16)
    state = load_file(path / "model.safetensors")
    bad = dict(state)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(bad, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        WeightsError,
        match=r"tensor 'model.layers.1.mlp.up_proj.weight' has "
        r"shape \[3, 3\], the model built from .*config.json has \[128, 64\]",
    ):
        load_model(path, "cpu", torch.float32)  # fmt: skip
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"the checkpoint has no model.norm.weight"):
        load_model(path, "cpu", torch.float32)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError, match="unreadable shard index"):
        load_model(path, "cpu", torch.float32)


def test_a_checkpoint_it_does_not_read_goes_through_from_pretrained(tmp_path, caplog):
    path = _save(tmp_path / "m", dtype=torch.bfloat16)
    state = load_file(path / "model.safetensors")
    # A tensor the model does not have (a renamed or extra key): found on the meta device
    # before anything is allocated, and from_pretrained loads the checkpoint instead.
    extra = {**state, "model.rotary_emb.inv_freq": torch.ones(8)}
    save_file(extra, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="trainer.model.weights"):
        ours = load_model(path, "cpu", torch.float32).state_dict()
    assert "holds 'model.rotary_emb.inv_freq', which the model does not have" in caplog.text
    plain = _plain(path, torch.float32).state_dict()
    assert all(torch.equal(ours[k], plain[k]) for k in plain)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")  # an older format
    ours = load_model(path, "cpu", torch.float32).state_dict()
    plain = _plain(path, torch.float32).state_dict()
    assert all(torch.equal(ours[k], plain[k]) for k in plain)


def test_a_rank_holds_the_weights_and_one_staging_buffer_not_a_second_copy(tmp_path):
    """A 0.4 GB fp32 checkpoint loaded in bf16 (what a GPU rank asks of a fp32 release):
    beyond the 0.2 GB of bf16 weights the load costs at most a staging buffer and
    bookkeeping; a plain from_pretrained holds the whole fp32 model on the way."""
    path = _save(tmp_path / "big", dtype=torch.float32, hidden=1024, vocab=32000, layers=4)
    size = (path / "model.safetensors").stat().st_size
    assert size > 350 << 20
    # Each load in its own process, whose own peak is read: the two run side by side.
    with ThreadPoolExecutor(2) as pool:
        ours, plain = pool.map(lambda mode: measure(path, mode, "bfloat16"), ("ours", "plain"))
    ours_extra, plain_extra = ours["extra"], plain["extra"]
    print(f"checkpoint {size / 2**20:.0f} MiB, bf16 weights {ours['weights'] / 2**20:.0f} MiB; "
          f"peak beyond them: ours {ours_extra / 2**20:.0f} MiB, from_pretrained "
          f"{plain_extra / 2**20:.0f} MiB")  # fmt: skip
    assert ours_extra < STAGING_BYTES + (96 << 20)
    assert plain_extra > size / 2  # the copy this avoids is really there


def test_a_bf16_target_keeps_its_rotary_table_in_fp32(tmp_path):
    """Casting a whole model to bf16 casts its rotary ``inv_freq`` too: at position 4096
    that puts 19 of Qwen3-8B's 64 rotary bands off by more than 0.1 rad (up to 4.7), so the
    trainer's target would not be the model an engine serves (engines keep it in fp32)."""
    path = _save(tmp_path / "m", dtype=torch.bfloat16)
    for target in (load_target("tiny", dtype=torch.bfloat16),
                   load_target(str(path), dtype=torch.bfloat16)):  # fmt: skip
        buffers = dict(target.model.named_buffers())
        assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
        assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}
    ids = torch.arange(300)[None] % 512  # positions where a bf16 table is already off
    with torch.no_grad():
        want = _plain(path, torch.bfloat16)(ids).logits
        assert torch.equal(target.model(ids).logits, want)
