"""``trainer.eval.engine`` against real server processes on 127.0.0.1, without vLLM.

What serve-check and the batching experiment do when their vLLM server dies (the fault
matrix, docs/TRAINER.md): a server killed while starting, or mid-check, is one error naming
it (serve-check reports it as a failed check with its logs folder), never a hang or a
traceback; the server there is the OpenAI-compatible stand-in. And ``VllmEngine``'s life
and requests, with ``tests/data/fake_vllm.py`` standing in for vLLM's OpenAI server: it
starts the server with the drafter, sends a call's prompts concurrently and returns them in
order, reads the counters, and stops the server's whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from trainer.eval.engine import VllmEngine
from trainer.vllm.api import http_json
from trainer.vllm.metrics import SpecCounters
from trainer.vllm.process import free_port, wait_http

pytestmark = pytest.mark.integration


def _server(port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "scripts/servers/chat_server.py"), "--fixed-delay", "0",
           "--port", str(port), "--parent-pid", str(os.getpid())]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def test_a_server_killed_while_starting_is_one_error_naming_its_exit(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = _server(free_port(), f)
    proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with -9"):
        wait_http("http://127.0.0.1:1/v1/models", proc, log, timeout=60)
    assert time.monotonic() - t0 < 5  # noticed at once, not at the timeout


def test_a_server_killed_mid_check_is_one_error_naming_its_url(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as f:
        proc = _server(port, f)
    try:
        wait_http(url + "/v1/models", proc, log, timeout=60)
        assert http_json(url + "/v1/models")["data"]  # up and answering
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(RuntimeError, match=f"{url}/v1/models: .*vLLM server stop"):
            http_json(url + "/v1/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- VllmEngine, with a stand-in for vLLM ------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (PID 1 here may never reap it)


def _engine(tmp_path: Path, monkeypatch, **over) -> VllmEngine:
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT}/tests/data/fake_vllm.py "$@"\n')
    fake.chmod(0o755)
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setenv("FAKE_VLLM_DIR", str(tmp_path))
    kw = dict(target=tmp_path / "target", drafter=tmp_path / "drafter", vllm_python=fake,
              num_speculative_tokens=3, max_model_len=256, log=tmp_path / "vllm.log",
              startup_timeout_s=60)  # fmt: skip
    return VllmEngine(**{**kw, **over})


def test_the_engine_serves_the_drafter_and_answers_concurrently_in_prompt_order(
    tmp_path, monkeypatch
):
    prompts = [[k, 10 * k] for k in range(8)]  # the stand-in answers 11k, 11k + 1, ...
    with _engine(tmp_path, monkeypatch, concurrency=4) as engine:
        before = engine.counters()
        greedy = engine.generate(prompts, max_new_tokens=5, stop_token_ids=[24])
        sampled = engine.generate(prompts[:2], max_new_tokens=3, temperature=1.0, seed=1)
        seen = engine.counters().minus(before)
    want = [[11 * k + i for i in range(5)] for k in range(8)]
    want[2] = [22, 23, 24]  # ended at its stop token, the token kept
    assert greedy == want
    assert sampled == [[0, 1, 2], [12, 13, 14]]  # seeds 1_000_000 and 1_000_001 added
    assert json.loads((tmp_path / "record.json").read_text())["max_in_flight"] >= 2
    # the stand-in counts max_tokens drafts of 3 tokens a request, position 0 accepted
    assert seen == SpecCounters(drafts=46, draft_tokens=138, accepted=46,
                                per_position=(46, 0, 0))  # fmt: skip
    bodies = [json.loads(x) for x in (tmp_path / "bodies.jsonl").read_text().splitlines()]
    seeded = sorted((b["seed"], b["temperature"], b["top_p"], b["top_k"]) for b in bodies[8:])
    assert seeded == [(1_000_000, 1.0, 1.0, -1), (1_000_001, 1.0, 1.0, -1)]
    assert all("seed" not in b and b["temperature"] == 0 for b in bodies[:8])
    argv = json.loads((tmp_path / "argv.json").read_text())
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "drafter"),
                    "num_speculative_tokens": 3}  # fmt: skip
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert argv[-2:] == ["--generation-config", "vllm"]  # vLLM's neutral sampling defaults


def test_the_engine_stops_its_server_s_process_group(tmp_path, monkeypatch):
    """... and the folder its ZeroMQ sockets went into goes with it (vLLM puts them in the
    system's temporary folder, where a stopped server left them)."""
    with _engine(tmp_path, monkeypatch) as engine:
        url = engine.url
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert all(_alive(p) for p in pids)
        rpc = Path((tmp_path / "rpc").read_text())
        assert rpc.is_socket() and rpc.parent.name.startswith("dflash-vllm-rpc-")
    assert not rpc.parent.exists()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)  # the server and its child
    with pytest.raises(RuntimeError, match="not running"):
        _ = engine.url
    with pytest.raises(RuntimeError, match=f"{url}/metrics: .*vLLM server stop"):
        from trainer.vllm.metrics import read_counters

        read_counters(url)


def test_a_server_does_not_outlive_the_process_that_started_it(tmp_path, monkeypatch):
    """kill -9 of the process that started the server (a trainer owning its engine, a
    check): the server, in a session of its own, gets SIGTERM from the kernel
    (``PR_SET_PDEATHSIG``) and exits; vLLM's API server then stops its engine core."""
    _engine(tmp_path, monkeypatch)  # writes the stand-in interpreter and the folders
    script = (
        "import sys, time\nfrom pathlib import Path\n"
        "from trainer.vllm.process import vllm_server\n"
        f"with vllm_server({str(tmp_path / 'python')!r}, Path({str(tmp_path / 'target')!r}), "
        f"Path({str(tmp_path / 'vllm.log')!r}), startup_timeout_s=60, echo=lambda _: None) "
        "as url:\n    print(url, flush=True)\n    time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        assert starter.stdout is not None and starter.stdout.readline().startswith("http://")
        server = int((tmp_path / "pids").read_text().split()[0])
        assert _alive(server)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server)
