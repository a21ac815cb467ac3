"""`dflash-loader synth` and `inspect` on small corpora, through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from loader_server.data.dataset import open_dataset
from loader_server.data.synth import SynthSpec, synth_lengths, write_corpus

CLI = [sys.executable, "-m", "loader_server"]


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert (p.returncode == 0) == ok, p.stderr
    return p


def test_synth_then_inspect_json(tmp_path):
    out = tmp_path / "corpus"
    run(
        "synth",
        str(out),
        "--samples",
        "3000",
        "--shards",
        "3",
        "--median-len",
        "300",
        "--seed",
        "7",
    )
    info = json.loads(run("inspect", str(out), "--json", "--vocab-size", "151936").stdout)
    want = synth_lengths(SynthSpec(num_samples=3000, seed=7, median_len=300))
    assert info["samples"] == 3000 and info["shards"] == 3 and info["has_loss_mask"]
    assert info["tokens"] == int(want.sum())
    assert info["percentiles"]["p50"] == pytest.approx(float(np.median(want)))
    assert info["min_len"] >= 16 and info["max_len"] <= 8192


def test_inspect_text_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "c.arrow"
    run("synth", str(out), "--samples", "500", "--median-len", "100", "--stream")
    p = run("inspect", str(out), "--plot", str(tmp_path / "h.png"))
    assert "samples 500" in p.stdout and "length percentiles" in p.stdout
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synth_is_deterministic(tmp_path):
    spec = SynthSpec(num_samples=400, seed=3, median_len=80, chunk_samples=128)
    a = write_corpus(tmp_path / "a.arrow", spec)[0].read_bytes()
    b = write_corpus(tmp_path / "b.arrow", spec)[0].read_bytes()
    c = write_corpus(tmp_path / "c.arrow", SynthSpec(num_samples=400, seed=4, median_len=80))
    assert a == b and a != c[0].read_bytes()


def test_synth_mask_covers_response(tmp_path):
    ds = open_dataset(
        write_corpus(tmp_path / "a.arrow", SynthSpec(num_samples=200, median_len=60))[0]
    )
    for i in range(ds.num_samples):
        m = ds.loss_mask(i)
        prompt = int(np.argmax(m)) if m.any() else len(m)
        assert not m[:prompt].any() and m[prompt:].all()  # one prompt, then the response
        assert 0.1 * len(m) - 1 <= prompt <= 0.5 * len(m)


def test_learnable_content_depends_on_length(tmp_path):
    spec = SynthSpec(
        num_samples=300, median_len=200, max_len=800, content="learnable", vocab_size=512
    )
    ds = open_dataset(write_corpus(tmp_path / "l.arrow", spec)[0], vocab_size=512)
    short = np.concatenate([ds.input_ids(i) for i in range(300) if ds.lengths[i] < 200])
    long_ = np.concatenate([ds.input_ids(i) for i in range(300) if ds.lengths[i] >= 200])
    assert short.max() < 64 and long_.max() >= 64  # easy chain lives on 64 tokens

    def bigram_entropy(x):  # conditional entropy H(next | prev), bits
        pairs = x[:-1].astype(np.int64) * 512 + x[1:]
        _, joint = np.unique(pairs, return_counts=True)
        _, prev = np.unique(x[:-1], return_counts=True)
        pj, pp = joint / joint.sum(), prev / prev.sum()
        return -(pj * np.log2(pj)).sum() + (pp * np.log2(pp)).sum()

    assert bigram_entropy(short) < 0.8 < bigram_entropy(long_)


def test_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"not arrow at all")
    p = run("inspect", str(bad), ok=False)
    assert "Traceback" not in p.stderr and "bad.arrow" in p.stderr
    t = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3]]),
            "loss_mask": pa.array([[1], [1]], pa.list_(pa.uint8())),
        }
    )
    with pa.OSFile(str(tmp_path / "m.arrow"), "wb") as s, pa.ipc.new_file(s, t.schema) as w:
        w.write_table(t)
    p = run("inspect", str(tmp_path / "m.arrow"), ok=False)
    assert "row 0: length 1 differs" in p.stderr and "Traceback" not in p.stderr
    p = run("synth", str(tmp_path / "x"), "--samples", "0", ok=False)
    assert "num_samples must be positive" in p.stderr
