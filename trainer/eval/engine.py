"""vLLM as an evaluation engine: its OpenAI server, run by the interpreter of vLLM's own
virtualenv, serving the target with a DFlash drafter; token ids in and out; its spec-decode
counters read off ``/metrics``.

The one home of everything that talks to vLLM: ``make serve-check``, the batching
experiment (``python -m benchmarks.experiment --vllm-python``) and ``dflash-train eval
--engine vllm`` all import it. Standard library only: vLLM never runs in the project's
process, and never in its ``.venv`` (``bash scripts/checks/serve_check.sh --venv-only``
makes vLLM's CPU virtualenv once, in ``${DFLASH_CACHE:-~/.cache/dflash-loader}``).

Two levels:

* ``vllm_server`` starts ``vllm.entrypoints.openai.api_server`` (``vllm_command``: fp32 on
  CPU, no torch.compile, a fixed KV cache, the drafter as its DFlash speculator), waits for
  ``/health``, yields its URL and stops its whole process group when the block ends;
  ``complete`` sends greedy completions of token-id prompts one at a time;
  ``read_counters`` reads the spec-decode counters (``spec_counters``: the same as a dict);
* ``VllmEngine``, the context manager the eval runner uses: the same server, with vLLM's
  neutral sampling defaults (not the model's ``generation_config.json``'s), and
  ``generate`` (many prompts in flight at once, so vLLM batches them; seeded sampling) and
  ``counters``.

vLLM counts per request and per step (``docs/SERVING.md``; ``trainer.model.verifier``):
``num_drafts`` +1 for each step that ran a draft, ``num_draft_tokens`` +K, ``num_accepted_
tokens`` +j (the accepted drafts) and ``num_accepted_tokens_per_pos[k]`` +1 when draft
``k`` was accepted. Its mean acceptance length ``1 + accepted / drafts`` (``SpecCounters.
tau``) is the verifier's ``tau_served``; at temperature 0 the two are equal (serve-check).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import TracebackType
from typing import Any, cast

log = logging.getLogger(__name__)

SERVED = "target"  # --served-model-name
#: The drafter's block size - 1, unless told otherwise (serve-check's drafters: blocks of 8).
NUM_SPECULATIVE_TOKENS = 7
MAX_MODEL_LEN = 1024
#: vLLM's CPU backend otherwise reserves --gpu-memory-utilization of the machine's memory.
KV_CACHE_MEMORY_BYTES = 256 << 20
STARTUP_TIMEOUT_S = 600.0
#: Prompt ``i`` of a ``generate(..., seed=s)`` call samples with vLLM's seed
#: ``s * SEED_STRIDE + i``: every prompt its own stream, every call reproducible.
SEED_STRIDE = 1_000_000
_INT64_MAX = (1 << 63) - 1
HINT = (
    "`bash scripts/checks/serve_check.sh --venv-only` makes vLLM's CPU virtualenv (docs/SERVING.md)"
)


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


def speculative_config(drafter: Path, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a DFlash drafter folder."""
    return {"method": "dflash", "model": str(drafter),
            "num_speculative_tokens": num_speculative_tokens}  # fmt: skip


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
        spec = speculative_config(drafter, num_speculative_tokens)
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
    owner may watch the process). ``echo`` shows the command and the start-up time."""
    port = free_port()
    cmd = vllm_command(vllm_python, target, port, drafter, speculators, num_speculative_tokens,
                       max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                       extra=extra)  # fmt: skip
    echo("   $ " + " ".join(c if " " not in c else f"'{c}'" for c in cmd))
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **env}
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
    try:
        t0 = time.perf_counter()
        wait_http(url + "/health", proc, log, timeout=startup_timeout_s)
        echo(f"   vLLM up in {time.perf_counter() - t0:.1f} s ({log})")
        yield url, proc
    finally:
        stop_group(proc)


# ---- requests ---------------------------------------------------------------------------


def _fetch(url: str, data: bytes | None, timeout: float) -> bytes:
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as e:  # it answered, and refused: say what it said
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        # A server that died mid-check (kill -9, OOM): one failed check naming it, which
        # serve-check reports with its logs folder, not a traceback.
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"{url}: {reason} (did the vLLM server stop? see its log)") from e


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    """GET (no ``body``) or POST JSON; the reply's JSON. A refusal or a dead server is one
    ``RuntimeError`` naming the URL."""
    return json.loads(_fetch(url, None if body is None else json.dumps(body).encode(), timeout))


def completion_body(
    prompt: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
    top_k: int = -1, seed: int | None = None, stop_token_ids: Sequence[int] = (),
) -> dict[str, Any]:  # fmt: skip
    """A ``POST /v1/completions`` body: token ids in, token ids out (``return_token_ids``:
    the reply's ``choices[0].token_ids``); ``stop_token_ids`` end the response as an EOS
    does (the token kept). Greedy (temperature 0) ignores ``top_p`` and ``top_k``."""
    body: dict[str, Any] = {"model": SERVED, "prompt": [int(t) for t in prompt],
                            "max_tokens": max_tokens, "temperature": temperature,
                            "top_p": top_p, "top_k": top_k, "return_token_ids": True,
                            "stop_token_ids": [int(t) for t in stop_token_ids]}  # fmt: skip
    if seed is not None:
        body["seed"] = seed
    return body


def _token_ids(reply: Any) -> list[int]:
    return [int(t) for t in reply["choices"][0]["token_ids"]]


def complete(
    url: str, prompts: list[list[int]], max_tokens: int, stops: list[list[int]] | None = None
) -> list[list[int]]:
    """Greedy completions of token-id prompts, one request at a time (a batch of one:
    nothing depends on what else is in flight), each also ending at its ``stops`` (vLLM's
    ``stop_token_ids``: finished like an EOS, the token kept); the generated token ids."""
    out = []
    for k, p in enumerate(prompts):
        body = completion_body(p, max_tokens, stop_token_ids=stops[k] if stops else ())
        out.append(_token_ids(http_json(url + "/v1/completions", body)))
    return out


def request_seeds(seed: int, n: int) -> list[int]:
    """vLLM's seed for each of ``n`` prompts of a call with ``seed`` (``SEED_STRIDE``)."""
    if seed < 0 or n > SEED_STRIDE or seed * SEED_STRIDE + n > _INT64_MAX:
        raise ValueError(
            f"seed {seed} for {n} prompts: the seed must lie in 0..{_INT64_MAX // SEED_STRIDE - 1}"
            f" and a call hold at most {SEED_STRIDE} prompts"
        )
    return [seed * SEED_STRIDE + i for i in range(n)]


# ---- /metrics ---------------------------------------------------------------------------

#: vLLM's counter families (Prometheus text: a counter ``X`` is the sample ``X_total``).
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative spec-decode counters, read off ``/metrics`` (summed over its
    engines): drafts (draft steps, one per request and step), draft tokens, accepted draft
    tokens, and accepted drafts by position (``per_position[k]``: steps that accepted draft
    ``k``, 0-based). ``later.minus(earlier)`` counts the requests in between."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...]

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(earlier.per_position))
        mine, theirs = _padded(self.per_position, n), _padded(earlier.per_position, n)
        out = SpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted=self.accepted - earlier.accepted,
            per_position=tuple(a - b for a, b in zip(mine, theirs, strict=True)),
        )
        if min(out.drafts, out.draft_tokens, out.accepted, *out.per_position, 0) < 0:
            raise ValueError(
                f"vLLM's counters went down ({earlier} -> {self}): "
                "was the server restarted between the two reads?"
            )
        return out

    @property
    def tau(self) -> float:
        """vLLM's mean acceptance length ``1 + accepted / drafts``."""
        return 1.0 + self.accepted / self._drafts()

    def position_rates(self) -> list[float]:
        """The acceptance rate of each draft position: ``per_position[k] / drafts``."""
        drafts = self._drafts()
        return [n / drafts for n in self.per_position]

    def inconsistencies(self) -> list[str]:
        """What vLLM's counting rules rule out, in words (none: the counters are coherent).
        A step that accepted ``j`` drafts adds 1 to positions ``0..j-1``, so the positions
        sum to ``accepted``, never rise, and position 0 counts at most ``drafts``."""
        pos = self.per_position
        out = []
        if sum(pos) != self.accepted:
            out.append(f"accepted {self.accepted} != {sum(pos)}, the positions' sum")
        if any(b > a for a, b in pairwise(pos)):
            out.append(f"accepted by position rises: {list(pos)}")
        if pos and pos[0] > self.drafts:
            out.append(f"position 0 accepted {pos[0]} of {self.drafts} drafts")
        return out

    def _drafts(self) -> int:
        if self.drafts <= 0:
            raise ValueError(f"vLLM counted no drafts ({self}): was a drafter served?")
        return self.drafts


def _padded(values: tuple[int, ...], n: int) -> tuple[int, ...]:
    return values + (0,) * (n - len(values))


def parse_spec_counters(text: str) -> SpecCounters:
    """The spec-decode counters in vLLM's ``/metrics`` text (all zero when it serves no
    drafter: then it has none of them)."""
    sums = dict.fromkeys(COUNTERS.values(), 0)
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in COUNTERS:
            sums[COUNTERS[base]] += round(float(value))
        elif base == PER_POSITION:
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + round(float(value))
    positions = tuple(per_pos.get(k, 0) for k in range(max(per_pos, default=-1) + 1))
    return SpecCounters(per_position=positions, **sums)


def read_metrics(url: str) -> str:
    """``/metrics`` of the server at ``url`` (Prometheus text)."""
    return _fetch(url + "/metrics", None, timeout=30).decode()


def read_counters(url: str) -> SpecCounters:
    return parse_spec_counters(read_metrics(url))


def spec_counters(url: str) -> dict[str, Any]:
    """``read_counters`` as a dict: ``drafts``, ``draft_tokens``, ``accepted`` (floats) and
    ``per_pos`` (position -> accepted drafts)."""
    c = read_counters(url)
    return {"drafts": float(c.drafts), "draft_tokens": float(c.draft_tokens),
            "accepted": float(c.accepted),
            "per_pos": {k: float(n) for k, n in enumerate(c.per_position)}}  # fmt: skip


# ---- the engine -------------------------------------------------------------------------


class VllmEngine:
    """vLLM serving ``target`` with ``drafter`` as its DFlash speculator, for evaluation: a
    context manager that starts the server on enter and stops its process group on exit.

    ``generate`` sends the prompts ``concurrency`` at a time (vLLM batches what is in
    flight) and returns the completions in prompt order; ``counters`` reads the cumulative
    spec-decode counters (``after.minus(before)`` for the requests between two reads). The
    server runs with ``--generation-config vllm``: vLLM's neutral sampling defaults, not the
    model's (Qwen3's ``generation_config.json`` says temperature 0.6, top_p 0.95, top_k 20),
    so only what ``generate`` is told applies; the EOS ids still come from that file.
    ``speculators``: ``drafter`` is a speculators-dialect folder; ``env``: added to vLLM's
    environment."""

    def __init__(
        self, *, target: Path, drafter: Path, vllm_python: Path, num_speculative_tokens: int,
        max_model_len: int, log: Path, speculators: bool = False,
        kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES, concurrency: int = 16,
        request_timeout_s: float = 600.0, startup_timeout_s: float = STARTUP_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("max_model_len", max_model_len), ("concurrency", concurrency),
                            ("kv_cache_memory_bytes", kv_cache_memory_bytes)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not Path(vllm_python).is_file():
            raise ValueError(f"vllm_python {vllm_python}: no such interpreter; {HINT}")
        for name, path in (("target", target), ("drafter", drafter)):
            if not Path(path, "config.json").is_file():
                raise ValueError(f"{name} {path}: no config.json (a Hugging Face folder?)")
        self.target, self.drafter, self.log = Path(target), Path(drafter), Path(log)
        self.vllm_python = Path(vllm_python)
        self.num_speculative_tokens, self.max_model_len = num_speculative_tokens, max_model_len
        self.speculators, self.kv_cache_memory_bytes = speculators, kv_cache_memory_bytes
        self.concurrency, self.request_timeout_s = concurrency, request_timeout_s
        self.startup_timeout_s, self.env = startup_timeout_s, dict(env or {})
        self._stack: contextlib.ExitStack | None = None
        self._url: str | None = None

    def __enter__(self) -> VllmEngine:
        if self._stack is not None:
            raise RuntimeError("this VllmEngine is already running")
        stack = contextlib.ExitStack()
        self._url = stack.enter_context(vllm_server(
            str(self.vllm_python), self.target, self.log, self.drafter, self.speculators,
            self.num_speculative_tokens, max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            extra=("--generation-config", "vllm"), echo=log.info,
            startup_timeout_s=self.startup_timeout_s, **self.env,
        ))  # fmt: skip
        self._stack = stack
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack, self._url = self._stack, None, None
        if stack is not None:
            stack.close()

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the VllmEngine is not running: use it in a `with` block")
        return self._url

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
        top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """One completion per prompt (the generated token ids, in prompt order), at most
        ``max_new_tokens`` each, ending at an EOS or one of ``stop_token_ids`` (kept).
        Temperature 0 is greedy; above it vLLM samples with ``top_p`` and ``top_k`` (-1:
        all tokens), prompt ``i`` with the seed ``seed * SEED_STRIDE + i`` (``seed`` None:
        vLLM's own generator, not reproducible)."""
        bodies = self._bodies(prompts, max_new_tokens, temperature, top_p, top_k, seed,
                              stop_token_ids or ())  # fmt: skip
        if not bodies:
            return []
        url = self.url + "/v1/completions"
        with ThreadPoolExecutor(min(self.concurrency, len(bodies))) as pool:
            futures = [pool.submit(http_json, url, b, self.request_timeout_s) for b in bodies]
            try:
                return [_token_ids(f.result()) for f in futures]
            except BaseException:
                for f in futures:  # a failed request ends the call: send no more
                    f.cancel()
                raise

    def _bodies(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
        top_p: float, top_k: int, seed: int | None, stops: Sequence[int],
    ) -> list[dict[str, Any]]:  # fmt: skip
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or (top_k < 1 and top_k != -1):
            raise ValueError(
                f"temperature {temperature} (>= 0), top_p {top_p} (in (0, 1]), "
                f"top_k {top_k} (-1 or >= 1): out of range"
            )
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.max_model_len - max_new_tokens:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} does not "
                    f"fit max_model_len {self.max_model_len} (or the prompt is empty)"
                )
        seeds = request_seeds(seed, len(prompts)) if seed is not None else [None] * len(prompts)
        return [
            completion_body(p, max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=s, stop_token_ids=stops)
            for p, s in zip(prompts, seeds, strict=True)
        ]  # fmt: skip

    def counters(self) -> SpecCounters:
        """vLLM's cumulative spec-decode counters now."""
        return read_counters(self.url)
