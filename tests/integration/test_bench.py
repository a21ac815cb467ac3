"""`benchmarks/bench_loader.py` runs end to end on a small corpus (numbers are not judged here:
benchmarks measure, tests check the command works and reports every figure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, TEST_SPEC

pytestmark = pytest.mark.integration


def test_bench_reports_every_figure(corpus_path, tmp_path):
    pytest.importorskip("matplotlib")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TEST_SPEC.items()]
    png = tmp_path / "bench.png"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_loader.py"), str(corpus_path),
         "--seconds", "0.5", "--warmup", "0.3", "--json", "--plot", str(png), *flags],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    r = json.loads(out)
    assert r["samples"] == 2000 and r["memcpy_gbps"] > 0 and r["warmup_s"] == 0.3
    assert r["service"]["tokens_per_s"] > 0 and r["dataloader"]["tokens_per_s"] > 0
    assert len(r["service"]["per_rank_tokens_per_s"]) == 2
    assert r["sorted_plan"]["repeat"] == 1.0 and r["ours_plan"]["repeat"] < 1.0
    assert 0 < r["first_batch_warm_s"] < 60 and r["sort_once"]["restart_s"] > 0
    assert r["next_p99_ms"] >= r["next_p50_ms"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_anchor_draw_benchmark_reports_both_draws():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_anchor_draw.py"), "--rows", "2",
         "--repeat", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "per document (default)" in res.stdout and "cap 2048 (old)" in res.stdout
    assert "per document / old: blocks" in res.stdout
