"""Requests to vLLM's OpenAI server: JSON in and out, token-id completions, and the seeds
a sampled call gives each prompt. Standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from trainer.vllm.process import SERVED

#: Prompt ``i`` of a ``generate(..., seed=s)`` call samples with vLLM's seed
#: ``s * SEED_STRIDE + i``: every prompt its own stream, every call reproducible.
SEED_STRIDE = 1_000_000
_INT64_MAX = (1 << 63) - 1


def fetch_bytes(url: str, data: bytes | None, timeout: float) -> bytes:
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
    data = None if body is None else json.dumps(body).encode()
    return json.loads(fetch_bytes(url, data, timeout))


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


def token_ids(reply: Any) -> list[int]:
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
        out.append(token_ids(http_json(url + "/v1/completions", body)))
    return out


def request_seeds(seed: int, n: int) -> list[int]:
    """vLLM's seed for each of ``n`` prompts of a call with ``seed`` (``SEED_STRIDE``)."""
    if seed < 0 or n > SEED_STRIDE or seed * SEED_STRIDE + n > _INT64_MAX:
        raise ValueError(
            f"seed {seed} for {n} prompts: the seed must lie in 0..{_INT64_MAX // SEED_STRIDE - 1}"
            f" and a call hold at most {SEED_STRIDE} prompts"
        )
    return [seed * SEED_STRIDE + i for i in range(n)]
