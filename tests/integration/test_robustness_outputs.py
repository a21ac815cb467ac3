"""Issue 24, class 1: no writing command deletes or changes a file it did not create.

Every command that writes (tokenize, regen, export, calibrate, plot, save-target, and the
run folder of train) is run next to user files that look like the temporary names tools
pick (``OUT.tmp``, ``OUT.old``, dot files), with an output that overlaps its inputs, and
with ``--force`` over an existing output; the property checked is always the same: nothing
outside OUT changes, byte for byte (``snapshot``), and a refused command changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import ROOT
from drafters import in_process

from loader_server.data.synth import SynthSpec, write_corpus
from scripts.fixtures.tiny_chat import build_tokenizer, generate_conversations, write_jsonl
from trainer.cli import main
from trainer.model.blocks import LossConfig
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.verifier import greedy_generate
from trainer.options import TargetOptions
from trainer.run import run_meta
from trainer.train.batches import ListSource
from trainer.train.distributed import local_env
from trainer.train.loop import Trainer

B = 8


def snapshot(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every entry under ``root`` (but ``skip``): files by content digest, links by target,
    folders as such."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + str(p.readlink())
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.blake2b(p.read_bytes(), digest_size=8).hexdigest()
    return out


def decoys(folder: Path, name: str) -> None:
    """User files with the names a careless tool would use for its temporaries."""
    for d in (f"{name}.tmp", f"{name}.old"):
        (folder / d).mkdir()
        (folder / d / "mine.txt").write_text("the user's, not the tool's\n")
    (folder / f".{name}.tmp").write_text("also the user's\n")
    (folder / f"{name}.new").write_text("and this\n")


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chat")
    tok = build_tokenizer(root / "tokenizer", vocab_size=400)
    data = write_jsonl(root / "data" / "conversations.jsonl", generate_conversations(40, words=20))
    return tok, data


@pytest.fixture(scope="module")
def run_dir(target, tmp_path_factory) -> Path:
    """A short real run with metrics, cost records and a checkpoint."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(24):
        prompt = torch.randint(0, 511, (8,), generator=g)
        samples.append(
            (torch.cat([prompt, greedy_generate(target, prompt, 24)]).tolist(), [1] * 32)
        )
    cfg = DrafterConfig.from_target(
        target.config, num_target_layers=3, block_size=B, mask_token_id=511
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    out = tmp_path_factory.mktemp("run")
    tc = in_process(out, LossConfig(block_size=B, anchors_per_doc=4), steps=9, lr=3e-3,
                    warmup=1, cost_samples=12)  # fmt: skip
    source = ListSource(samples, rows=3, grad_accum=2, epochs=3)
    Trainer(tc, target=target, drafter=drafter, source=source, env=local_env(),
            meta=run_meta(TargetOptions(), target)).run()  # fmt: skip
    (out / "config.json").write_text(json.dumps(TargetOptions().to_record()))
    return out


def test_tokenize_never_touches_files_it_did_not_create(chat, tmp_path):
    tok, data = chat
    src = tmp_path / "src"
    src.mkdir()
    (src / "conversations.jsonl").write_bytes(data.read_bytes())
    decoys(tmp_path, "out")
    before = snapshot(tmp_path)
    cmd = [sys.executable, "-m", "trainer.cli", "tokenize", str(src), str(tmp_path / "out"),
           "--tokenizer", str(tok), "--workers", "1", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    assert snapshot(tmp_path, skip=tmp_path / "out") == before
    first = snapshot(tmp_path / "out")
    # again with --force: OUT replaced, everything else byte for byte as it was
    subprocess.run([*cmd, "--force"], check=True, cwd=ROOT, capture_output=True)
    assert snapshot(tmp_path, skip=tmp_path / "out") == before
    assert snapshot(tmp_path / "out").keys() == first.keys()
    # OUT is the source folder, holds it, or lies inside it: refused, nothing changed
    everything = snapshot(tmp_path)
    for out in (src, tmp_path, src / "corpus"):
        proc = subprocess.run([*cmd[:4], str(src), str(out), *cmd[6:], "--force"],
                              cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "choose an output outside the inputs" in last and "Traceback" not in proc.stderr
        assert snapshot(tmp_path) == everything


def test_a_failing_tokenize_leaves_nothing_behind(chat, tmp_path):
    tok, _ = chat
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list"}\n')
    decoys(tmp_path, "out")
    before = snapshot(tmp_path)
    code, out = run("tokenize", str(bad), str(tmp_path / "out"), "--tokenizer", str(tok),
                    "--workers", "1", "--no-progress")  # fmt: skip
    assert code == 1 and "no conversations for the corpus" in out
    assert snapshot(tmp_path) == before


def test_regen_in_process_needs_force_and_keeps_the_rest(tmp_path):
    src = tmp_path / "corpus.arrow"
    write_corpus(src, SynthSpec(num_samples=24, content="learnable", vocab_size=512,
                                median_len=40, max_len=80))  # fmt: skip
    out = tmp_path / "regen.arrow"
    out.write_text("an older file of the user's\n")
    decoys(tmp_path, "regen.arrow")
    args = ["regen", str(src), str(out), "--holdout", "2", "--limit", "4", "--no-progress"]
    before = snapshot(tmp_path)
    code, text = run(*args)
    assert code == 1 and "already exists and is not empty (--force replaces it)" in text
    assert snapshot(tmp_path) == before
    code, text = run(*args, "--force")
    assert code == 0, text
    after = snapshot(tmp_path)
    changed = {k for k in after if after.get(k) != before.get(k)}
    assert changed == {"regen.arrow", "regen.heldout.jsonl"}
    code, text = run("regen", str(src), str(src), "--force", "--no-progress")
    assert code == 1 and "is the input" in text


def test_export_calibrate_plot_write_only_their_outputs(run_dir, tmp_path):
    decoys(tmp_path, "hf")
    run_before = snapshot(run_dir)
    before = snapshot(tmp_path)
    code, text = run("export", str(run_dir), str(tmp_path / "hf"))
    assert code == 0, text
    code, text = run("export", str(run_dir), str(tmp_path / "hf"), "--force", "--dtype", "fp32")
    assert code == 0, text
    assert snapshot(tmp_path, skip=tmp_path / "hf") == before
    assert snapshot(run_dir) == run_before
    # into the run folder itself, or into its checkpoint: refused, nothing changed
    for out in (run_dir, run_dir / "checkpoints"):
        code, text = run("export", str(run_dir), str(out), "--force")
        assert code == 1 and "choose an output outside the inputs" in text, text
        assert snapshot(run_dir) == run_before
    code, text = run("calibrate", str(run_dir))
    assert code == 0, text
    code, text = run("plot", str(run_dir))
    assert code == 0, text
    after = snapshot(run_dir)
    new = {k for k in after if after.get(k) != run_before.get(k)}
    assert new == {"cost_profile.json", "cost_fit.png"} | {
        k for k in after if k == "plots" or k.startswith("plots/")
    }
    assert not [k for k in after if "tmp" in k or k.startswith(".")]


def test_save_target_needs_force_and_the_run_dir_must_not_hold_the_inputs(tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    code, text = run("save-target", str(out), "--tiny-vocab", "512")
    assert code == 1 and "--force replaces it" in text
    assert snapshot(tmp_path) == before
    code, text = run("save-target", str(tmp_path / "t2"), "--tiny-vocab", "512")
    assert code == 0, text
    assert (tmp_path / "t2" / "config.json").is_file()
    # a run folder that holds its own --target
    code, text = run("train", "--endpoint", "ipc:///nowhere", "--run-dir", str(tmp_path),
                     "--target", str(tmp_path / "t2"), "--steps", "1")  # fmt: skip
    assert code == 1 and "contains the input" in text, text


def test_every_writing_command_uses_the_one_output_module():
    """Writing an output anywhere but through ``trainer.files`` is how files get lost:
    the commands' modules must not write (or pick temp names) on their own."""
    import ast

    writers = {
        "trainer/data/tokenize.py", "trainer/data/regen.py", "trainer/data/corpus.py",
        "trainer/data/server/run.py", "trainer/hf/export.py", "trainer/ops/calibrate.py",
        "trainer/ops/plot.py", "trainer/cli/tools.py", "trainer/run.py",
    }  # fmt: skip
    for path in sorted(writers):
        text = (ROOT / path).read_text()
        assert "trainer.files" in text, f"{path} does not write through trainer.files"
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.endswith((".tmp", ".old")), f"{path}: picks {node.value!r}"
