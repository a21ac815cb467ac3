"""What serve-check and the batching experiment do when their vLLM server dies (the fault
matrix, docs/TRAINER.md): a server killed while starting, or mid-check, is one error naming
it (serve-check reports it as a failed check with its logs folder), never a hang or a
traceback. The server here is the OpenAI-compatible stand-in, a real process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from scripts.servers.vllm_client import free_port, http_json, wait_http

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
