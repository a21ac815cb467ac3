"""vLLM's OpenAI server from its own virtualenv, and the calls serve-check and the batching
experiment make to it (``python -m benchmarks.experiment --vllm-python``).

``vllm_server`` starts ``vllm.entrypoints.openai.api_server`` with the interpreter of the
vLLM virtualenv (``bash scripts/checks/serve_check.sh --venv-only`` makes it once; vLLM
never runs in the project's ``.venv``), waits for ``/health``, yields its URL and stops
its whole process group when the block ends; ``complete`` sends greedy completions of
token-id prompts; ``spec_counters`` reads its spec-decode counters from ``/metrics``.
Standard library only: the project's code runs no vLLM import.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SERVED = "target"  # --served-model-name
#: The drafter's block size - 1, unless told otherwise (serve-check's drafters: blocks of 8).
NUM_SPECULATIVE_TOKENS = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # it answered, and refused: say what it said
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        # A server that died mid-check (kill -9, OOM): one failed check naming it, which
        # serve-check reports with its logs folder, not a traceback.
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"{url}: {reason} (did the vLLM server stop? see its log)") from e


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up after {timeout:.0f} s:\n{tail(log)}")
        time.sleep(0.5)


def tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this script started (vLLM's engine core and worker are
    children of its API server), SIGKILL what is left after 30 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent


def vllm_command(
    vllm_python: str, target: Path, port: int, drafter: Path | None, speculators: bool = False,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
) -> list[str]:  # fmt: skip
    """The vLLM OpenAI server for the target (docs/SERVING.md): fp32 on CPU, no
    torch.compile (--enforce-eager), a KV cache of a fixed size (the CPU backend otherwise
    reserves --gpu-memory-utilization of the machine's memory and refuses to start when
    that much is not free); with ``drafter``, its DFlash speculator. ``speculators``: the
    drafter is a speculators-dialect folder, which vLLM takes as ``--model`` (it serves the
    verifier its config names, with the drafter); ``num_speculative_tokens``: the drafter's
    block size - 1."""
    if speculators and drafter is not None:
        target, drafter = drafter, None
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
           "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0"]  # fmt: skip
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter),
                "num_speculative_tokens": num_speculative_tokens}  # fmt: skip
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


@contextlib.contextmanager
def vllm_server(
    vllm_python: str, target: Path, log: Path, drafter: Path | None = None,
    speculators: bool = False, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, **env: str,
) -> Iterator[str]:  # fmt: skip
    port = free_port()
    cmd = vllm_command(vllm_python, target, port, drafter, speculators, num_speculative_tokens)
    print("   $ " + " ".join(c if " " not in c else f"'{c}'" for c in cmd), flush=True)
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_http(url + "/health", proc, log, timeout=600)
        print(f"   vLLM up in {time.perf_counter() - t0:.1f} s ({log})", flush=True)
        yield url
    finally:
        stop_group(proc)


def spec_counters(url: str) -> dict[str, Any]:
    """vLLM's spec-decode counters from ``/metrics`` (Prometheus text)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in names:
            out[names[base]] += float(value)
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + float(value)
    return out


def complete(
    url: str, prompts: list[list[int]], max_tokens: int, stops: list[list[int]] | None = None
) -> list[list[int]]:
    """Greedy completions of token-id prompts, one request at a time (a batch of one:
    nothing depends on what else is in flight), each also ending at its ``stops`` (vLLM's
    ``stop_token_ids``: finished like an EOS, the token kept); the generated token ids."""
    out = []
    for k, p in enumerate(prompts):
        body = {"model": SERVED, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "stop_token_ids": stops[k] if stops else []}  # fmt: skip
        out.append(
            [int(t) for t in http_json(url + "/v1/completions", body)["choices"][0]["token_ids"]]
        )
    return out
