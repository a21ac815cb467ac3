"""vLLM's OpenAI server as a process: started by the interpreter of vLLM's own virtualenv,
in a session of its own, stopped with its whole process group; and what to say when it
dies (``cause``: the exception its log's first traceback ended with).

``vllm_server``/``vllm_process`` start ``vllm.entrypoints.openai.api_server``
(``vllm_command``: fp32 on CPU, no torch.compile, a fixed KV cache, optionally a DFlash
drafter as its speculator, and any more flags), wait for ``/health``, yield its URL (and
process) and stop its process group when the block ends, or when the starter dies
(``PR_SET_PDEATHSIG``). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from trainer.vllm.configs import dflash_speculative_config

SERVED = "target"  # --served-model-name
#: The drafter's block size - 1, unless told otherwise (serve-check's drafters: blocks of 8).
NUM_SPECULATIVE_TOKENS = 7
MAX_MODEL_LEN = 1024
#: vLLM's CPU backend otherwise reserves --gpu-memory-utilization of the machine's memory.
KV_CACHE_MEMORY_BYTES = 256 << 20
STARTUP_TIMEOUT_S = 600.0
HINT = (
    "`bash scripts/checks/serve_check.sh --venv-only` makes vLLM's CPU virtualenv (docs/SERVING.md)"
)


# ---- the server's process ---------------------------------------------------------------


# ---- the server's process ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            args = cast(list[str], proc.args)[:3]
            raise RuntimeError(f"{args} exited with {proc.returncode}: {died(log, 40)}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up after {timeout:.0f} s: {died(log, 40)}")
        time.sleep(0.5)


def tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


#: vLLM's prefix of a log line: ``(Worker pid=1) ERROR 12-07 03:42:20 [file.py:10] ``.
_PREFIX = re.compile(r"^(\([^)]*\)\s+)?([A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s?)?")
#: The line a Python traceback ends with: ``SomeError: what went wrong``.
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)|\w+Dead\w*)\b:?")


def cause(log: Path) -> str | None:
    """Why a vLLM server died, in one line of its log: the exception the first traceback
    ended with (vLLM's worker raises, its engine core and API server then fail with lines
    that only point back at it, and the log ends with the shutdown), its prefix removed;
    else the first ``ERROR`` line; None without either."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    body = [_PREFIX.sub("", line, count=1) for line in lines]
    in_trace = False
    for text in body:
        if text.startswith("Traceback (most recent call last)"):
            in_trace = True
        elif in_trace and not text.startswith(" ") and _RAISED.match(text):
            return text.strip()
    errors = [t.strip() for line, t in zip(lines, body, strict=True) if " ERROR " in line]
    return errors[0] if errors else None


def died(log: Path, n: int = 15) -> str:
    """What to say of a server that exited: the line that says why (``cause``), then its
    log's last ``n`` lines."""
    why = cause(log)
    lead = f"{why}\n" if why else ""
    return f"{lead}(its log, {log}, ends:)\n{tail(log, n)}"


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this module started (vLLM's engine core and worker are
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
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, *, max_model_len: int = MAX_MODEL_LEN,
    kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES, extra: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """The vLLM OpenAI server for the target (docs/SERVING.md): fp32 on CPU, no
    torch.compile (--enforce-eager), a KV cache of a fixed size (the CPU backend otherwise
    reserves --gpu-memory-utilization of the machine's memory and refuses to start when
    that much is not free); with ``drafter``, its DFlash speculator. ``speculators``: the
    drafter is a speculators-dialect folder, which vLLM takes as ``--model`` (it serves the
    verifier its config names, with the drafter); ``num_speculative_tokens``: the drafter's
    block size - 1; ``extra``: more flags."""
    if speculators and drafter is not None:
        target, drafter = drafter, None
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--kv-cache-memory-bytes", str(kv_cache_memory_bytes), "--seed", "0"]  # fmt: skip
    if drafter is not None:
        spec = dflash_speculative_config(drafter, num_speculative_tokens)
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(extra)


def _end_with_parent() -> None:
    """In the server's process before it runs vLLM: SIGTERM it when the process that
    started it dies (Linux ``PR_SET_PDEATHSIG``), so a killed trainer or check leaves no
    server behind (vLLM's API server stops its engine core and workers on SIGTERM); the
    server runs in a session of its own, which a signal to its starter's group misses."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def _print(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def vllm_server(*args: Any, **kwargs: Any) -> Iterator[str]:
    """``vllm_process`` (the same arguments), yielding its URL only."""
    with vllm_process(*args, **kwargs) as (url, _):
        yield url


@contextlib.contextmanager
def vllm_process(
    vllm_python: str, target: Path, log: Path, drafter: Path | None = None,
    speculators: bool = False, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, *,
    max_model_len: int = MAX_MODEL_LEN, kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
    extra: Sequence[str] = (), echo: Callable[[str], None] = _print,
    startup_timeout_s: float = STARTUP_TIMEOUT_S, **env: str,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:  # fmt: skip
    """vLLM's server (``vllm_command``) in a session of its own, its output in ``log``,
    ``env`` added to its environment; its URL and process once ``/health`` answers (its
    owner may watch the process). ``echo`` shows the command and the start-up time. Its
    processes' ZeroMQ sockets go into a folder of its own, removed when it stops (vLLM puts
    them in the system's temporary folder, where a stopped server left them, a few each)."""
    port = free_port()
    cmd = vllm_command(vllm_python, target, port, drafter, speculators, num_speculative_tokens,
                       max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                       extra=extra)  # fmt: skip
    echo("   $ " + " ".join(c if " " not in c else f"'{c}'" for c in cmd))
    sockets = tempfile.mkdtemp(prefix="dflash-vllm-rpc-")
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_RPC_BASE_PATH": sockets, **env}
    proc = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=_end_with_parent,
            )
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        wait_http(url + "/health", proc, log, timeout=startup_timeout_s)
        echo(f"   vLLM up in {time.perf_counter() - t0:.1f} s ({log})")
        yield url, proc
    finally:
        if proc is not None:
            stop_group(proc)
        shutil.rmtree(sockets, ignore_errors=True)


# ---- requests ---------------------------------------------------------------------------
