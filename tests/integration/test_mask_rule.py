"""One rule for the MASK id (``trainer.model.target.tokenizer_mask_id``), on a real Qwen3
tokenizer (no ``<|MASK|>``, as a Qwen3-8B download): the tokenizer's mask token, else
``<|MASK|>``, else the id ``add_special_tokens`` would give when the embedding has that
spare row (151669 for Qwen3), else one error naming both sizes. Local targets, tiny targets
saved with a tokenizer, and the trainer's resolution all follow it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from scripts.fixtures.qwen3_tokenizer import QWEN3_8B_VOCAB, qwen3_tokenizer_dir
from scripts.fixtures.tiny_chat import build_tokenizer
from trainer.cli import main
from trainer.model.target import load_target, mask_token_id, tokenizer_mask_id

SMALL = ["--tiny-hidden", "32", "--tiny-layers", "2", "--tiny-heads", "2", "--tiny-kv-heads", "1"]


@pytest.fixture(scope="module")
def qwen3() -> Path:
    return qwen3_tokenizer_dir()


def save_target(out: Path, tokenizer: Path | None, vocab: int) -> tuple[int, str]:
    args = ["save-target", str(out), "--tiny-vocab", str(vocab), *SMALL]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    r = CliRunner().invoke(main, args)
    return r.exit_code, r.output


def test_qwen3_without_mask_token_gets_the_id_add_special_tokens_gives(qwen3, caplog):
    tok = AutoTokenizer.from_pretrained(qwen3)
    assert tok.mask_token_id is None and "<|MASK|>" not in tok.get_vocab()
    with caplog.at_level(logging.INFO, logger="trainer.model.target"):
        found = tokenizer_mask_id(tok, QWEN3_8B_VOCAB, "qwen3")
    grown = AutoTokenizer.from_pretrained(qwen3)
    grown.add_special_tokens({"mask_token": "<|MASK|>"})  # z-lab's README
    assert found == grown.mask_token_id == 151669
    assert "add_special_tokens" in caplog.text and "151669" in caplog.text


def test_no_spare_row_is_one_error_naming_both_sizes(qwen3):
    tok = AutoTokenizer.from_pretrained(qwen3)
    with pytest.raises(ValueError, match=r"151669 tokens fill the target's 151669-row") as e:
        tokenizer_mask_id(tok, len(tok), "qwen3")
    assert "--mask-token-id" in str(e.value)


def test_a_tokenizer_with_a_mask_token_keeps_it(tmp_path):
    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok", vocab_size=300))
    want = tok.convert_tokens_to_ids("<|MASK|>")
    assert tokenizer_mask_id(tok, 10_000, "tiny") == want < len(tok)


def test_local_qwen3_folder_and_tiny_save_target_follow_the_rule(tmp_path, qwen3):
    """A Qwen3-shaped folder without mask_token_id in its config (a real download) gets
    151669 from its tokenizer; save-target --tokenizer writes that id into the config; a
    tokenizer as large as the embedding is refused with both sizes."""
    code, out = save_target(tmp_path / "tiny", qwen3, QWEN3_8B_VOCAB)
    assert code == 0, out
    cfg = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert cfg["mask_token_id"] == 151669 and cfg["eos_token_id"] == 151645

    download = tmp_path / "download"  # as `huggingface-cli download`: no mask id anywhere
    shutil.copytree(tmp_path / "tiny", download)
    cfg.pop("mask_token_id")
    (download / "config.json").write_text(json.dumps(cfg))
    target = load_target(str(download))
    assert getattr(target.config, "mask_token_id", None) is None
    assert mask_token_id(target, str(download)) == 151669

    code, out = save_target(tmp_path / "full", qwen3, 151669)
    assert code != 0 and "151669 tokens fill the target's 151669-row embedding" in out
    assert not (tmp_path / "full").exists()


def test_tiny_target_without_a_tokenizer_reserves_its_last_row(tmp_path):
    code, out = save_target(tmp_path / "bare", None, 1000)
    assert code == 0, out
    assert json.loads((tmp_path / "bare" / "config.json").read_text())["mask_token_id"] == 999
