"""The vLLM engine: its numbering of layers, the server that computes the states (the
flags a user's server needs, and one the run starts), and its HTTP exchange.

**The server** runs the ``extract_hidden_states`` speculative method, which runs each
prompt's prefill and caches the chosen layers' outputs, with our connector
(``trainer/vllm/connector``, on the server's ``PYTHONPATH``) putting them where the
transport says (``kv_connector_extra_config``), and prefix caching off (a cached prefix is
not computed, so its states would be missing). A server the run starts runs on rank 0's
machine with ``trainer.vllm.process.vllm_command``'s CPU settings (fp32, eager; what this
project can test), and gets SIGTERM if the trainer dies.

**Layer ids.** vLLM's ``extract_hidden_states`` numbers layers as Transformers'
``hidden_states`` tuple does: id ``k`` is the output after ``k`` decoder layers, so our layer
``i`` (the output of decoder layer ``i``, ``trainer.model.target``) is vLLM's ``i + 1``. It
returns one ``[T, n, H]`` array per request with its ids in ascending order, whatever order
it was given, and repeated ids break it: so the server is given our ids sorted, unique and
shifted, and each feature is picked back out of that order (``Layers.columns``). Our last
layer (``L - 1``, vLLM's id ``L``) is vLLM's output before the final norm, where
Transformers' last entry (and our target's feature) is after it: the trainer applies the
target's final norm to that one (``Layers.prenorm``).

**Requests.** vLLM's OpenAI server returns only the first prompt's ``kv_transfer_params``
of a request, so each document is its own ``POST /v1/completions`` (token ids in,
``max_tokens`` 1: the prompt's forward is all that is needed), its ``X-Request-Id`` the
run's request id (vLLM names the request ``cmpl-ID-0-RANDOM``), its ``kv_transfer_params``
the transport's placement; the reply's ``kv_transfer_params`` say where the connector put
the states.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.engine.errors import EngineError
from trainer.engine.seam import Layers, ServedModel
from trainer.vllm.configs import CONNECTOR_DIR, kv_transfer_config, states_speculative_config
from trainer.vllm.process import (
    KV_CACHE_MEMORY_BYTES,
    died,
    vllm_process,
)


def engine_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for our ``layer_ids``: sorted, unique, +1."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise ValueError(f"layer ids {list(layer_ids)} must be in 0..{num_layers - 1} (and some)")
    return [i + 1 for i in sorted(set(layer_ids))]


def feature_columns(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """For each of our ``layer_ids`` in order, its index in the engine's ``[T, n, H]``."""
    order = engine_layer_ids(layer_ids, num_layers)
    return [order.index(i + 1) for i in layer_ids]


class StartedServer:
    """What the run knows of the vLLM server it started: its URL, process and log."""

    def __init__(self, url: str, proc: Any, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log
        self.pid = int(proc.pid)

    def ended(self) -> str | None:
        """None while the server runs; else its exit, why (its log's cause) and the end of
        its log."""
        if self.proc.poll() is None:
            return None
        return (
            f"the vLLM server this run started exited with {self.proc.returncode}: {died(self.log)}"
        )


class VllmAdapter:
    """``trainer.engine.seam.Engine`` for vLLM (0.32, the connector's pinned release)."""

    name = "vllm"

    def layers(self, ours: Sequence[int], num_layers: int) -> Layers:
        return Layers(
            engine_ids=engine_layer_ids(ours, num_layers),
            columns=feature_columns(ours, num_layers),
            prenorm=[i for i in ours if i == num_layers - 1],
        )

    def server_flags(self, engine_ids: list[int], connector: dict[str, Any]) -> list[str]:
        return ["--speculative-config", json.dumps(states_speculative_config(engine_ids)),
                "--kv-transfer-config", json.dumps(kv_transfer_config(connector)),
                "--no-enable-prefix-caching"]  # fmt: skip

    def serve_command(
        self, target: Path, engine_ids: list[int], connector: dict[str, Any], *, port: int = 8000,
        tensor_parallel_size: int = 1, max_model_len: int | None = None,
        env: dict[str, str] | None = None,
    ) -> str:  # fmt: skip
        """The shell command of a vLLM server a run can use (``--engine-url``): ``vllm
        serve`` of ``target`` with the flags, and our connector on its ``PYTHONPATH`` (copy
        ``trainer/vllm/connector`` next to a server on another machine)."""
        cmd = ["vllm", "serve", str(target), "--port", str(port),
               "--tensor-parallel-size", str(tensor_parallel_size)]  # fmt: skip
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        cmd += self.server_flags(engine_ids, connector)
        pre = {"PYTHONPATH": str(CONNECTOR_DIR), **(env or {})}
        lead = " ".join(f"{k}={shlex.quote(v)}" for k, v in pre.items())
        return f"{lead} " + " ".join(map(shlex.quote, cmd))

    @contextlib.contextmanager
    def start(
        self, python: str, target: Path, engine_ids: list[int], log: Path, *,
        connector: dict[str, Any], max_model_len: int, env: dict[str, str] | None = None,
        kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
    ) -> Iterator[StartedServer]:  # fmt: skip
        """vLLM serving ``target``'s states, started here and stopped (its process group)
        when the block ends, or when this process dies."""
        environ: dict[str, Any] = {"PYTHONPATH": str(CONNECTOR_DIR), **(env or {})}
        with vllm_process(
            python, target, log, max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            extra=self.server_flags(engine_ids, connector), echo=_log, **environ,
        ) as (url, proc):  # fmt: skip
            yield StartedServer(url, proc, log)

    def models_path(self) -> str:
        return "/v1/models"

    def served_model(self, reply: Any) -> ServedModel:
        models = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(models, list):
            raise EngineError(f"/v1/models: not a vLLM answer ({str(reply)[:200]})")
        if not models:
            raise EngineError("serves no model")
        first = models[0]
        limit = first.get("max_model_len")
        root = str(first.get("root") or first.get("id") or "")
        return ServedModel(str(first["id"]), root, None if limit is None else int(limit))

    def request(
        self, model: str, tokens: list[int], req_id: str, params: dict[str, Any]
    ) -> tuple[str, dict[str, Any], dict[str, str]]:
        body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1,
                                "temperature": 0.0}  # fmt: skip
        if params:
            body["kv_transfer_params"] = params
        return "/v1/completions", body, {"X-Request-Id": req_id}

    def placed(self, reply: Any) -> dict[str, Any] | None:
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        return params if isinstance(params, dict) and params else None


def _log(line: str) -> None:
    import logging

    logging.getLogger(__name__).info(line.strip())
