"""A stand-in for a vLLM server extracting hidden states (``extract_hidden_states`` with
``trainer.engine``'s connector), for the tests of ``trainer.engine`` that make test runs
(``tests/integration/test_engine_feed.py``; the real vLLM is ``make serve-check``'s).

It keeps vLLM 0.32's conventions, as ``trainer.engine.states`` documents them: layer id
``k`` is the output after ``k`` decoder layers, id ``L`` the last layer's before the final
norm; the ids come back in ascending order; the file is
``STATES/cmpl-<X-Request-Id>-0-<random>.safetensors`` (``hidden_states [T, n, H]``,
``token_ids [T]``), written after the reply while an exclusive ``flock`` on its ``.lock``
is held. ``GET /v1/models`` names the model and its ``max_model_len``.

``python fake_vllm_states.py --model DIR --port N --layer-ids 1,2,4 --states DIR
[--max-model-len N]``; ``$FAKE_STATES_DIE_AFTER=N``: exit (as a kill would) after the
N-th reply, its file half written (``$FAKE_STATES_DIE_UNWRITTEN=1``: not written at all,
half of it in a ``.tmpXXXXXX`` file, as safetensors' ``save_file`` cut short leaves it);
``$FAKE_STATES_WRONG_TOKENS=1``: files name other token
ids than asked for.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

LOCK = threading.Lock()
SERVED = {"n": 0}


def states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """``[T, n, H]``: the outputs after ``k`` layers for each ``k`` in ``layer_ids``."""
    captured = {}
    last = model.config.num_hidden_layers
    hook = model.model.norm.register_forward_pre_hook(
        lambda m, args: captured.__setitem__("pre_norm", args[0])
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    picked = [captured["pre_norm"] if k == last else out.hidden_states[k] for k in layer_ids]
    return torch.stack([p[0] for p in picked], dim=1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--states", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layer_ids = sorted({int(k) for k in args.layer_ids.split(",")})
    folder = Path(args.states)
    die_after = int(os.environ.get("FAKE_STATES_DIE_AFTER", "0"))
    wrong = os.environ.get("FAKE_STATES_WRONG_TOKENS") == "1"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _json(self, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json({"data": [{"id": "target", "max_model_len": args.max_model_len}]})
            else:
                self._json({})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = [int(t) for t in body["prompt"]]
            if len(ids) > args.max_model_len - 1:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b'{"error": "prompt too long"}')
                return
            rid = self.headers.get("X-Request-Id") or uuid.uuid4().hex
            path = folder / f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}.safetensors"
            lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            with LOCK:
                hs = states(model, ids, layer_ids)
                SERVED["n"] += 1
                dying = die_after and SERVED["n"] >= die_after
            self._json(
                {
                    "choices": [{"index": 0, "text": ""}],
                    "kv_transfer_params": {"hidden_states_path": str(path)},
                }
            )
            self.wfile.flush()
            if dying:  # as a kill mid-write: half a file (or none), the lock released by the exit
                if os.environ.get("FAKE_STATES_DIE_UNWRITTEN") != "1":
                    path.write_bytes(b"\x00" * 7)
                else:  # save_file writes a temporary file and renames it when whole
                    (folder / f".tmp{uuid.uuid4().hex[:6]}").write_bytes(b"\x00" * 7)
                os._exit(1)
            tokens = torch.tensor([(t + 1) % 7 for t in ids] if wrong else ids)
            time.sleep(0.01)  # the write lands after the reply, as vLLM's thread's does
            save_file({"hidden_states": hs, "token_ids": tokens}, str(path))
            os.close(lock_fd)

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # a trainer keeps dozens of requests in flight

    Server(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
