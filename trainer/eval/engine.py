"""vLLM as an evaluation engine (``dflash-train eval --engine vllm``, serve-check): its
OpenAI server serving the target with a DFlash drafter, many prompts in flight, its
spec-decode counters. The server, requests and counters are ``trainer.vllm``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from trainer.vllm.api import completion_body, http_json, request_seeds, token_ids
from trainer.vllm.metrics import SpecCounters, read_counters
from trainer.vllm.process import HINT, KV_CACHE_MEMORY_BYTES, STARTUP_TIMEOUT_S, vllm_server

log = logging.getLogger(__name__)


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
                return [token_ids(f.result()) for f in futures]
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
