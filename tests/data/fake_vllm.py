"""A stand-in for ``python -m vllm.entrypoints.openai.api_server``, for the tests of
``trainer.eval.engine`` (``tests/integration/test_vllm_client.py``): an interpreter
wrapper runs ``fake_vllm.py -m vllm.entrypoints.openai.api_server --port N ...``.
Standard library only.

* ``GET /health``; ``GET /metrics``: vLLM 0.32's spec-decode counter lines, counting each
  completion as ``max_tokens`` drafts of ``num_speculative_tokens`` tokens (from
  ``--speculative-config``) that accepted draft 0 only;
* ``POST /v1/completions``: ``choices[0].token_ids`` = ``(sum(prompt) + seed + i) % 1000``
  for ``i < max_tokens``, cut after a ``stop_token_ids`` token. The first request waits
  (5 s at most) until a second one is in flight, so a client that sends one at a time is
  seen (``max_in_flight`` in the record);
* a socket file under ``$VLLM_RPC_BASE_PATH``, as vLLM's processes make theirs;
* ``$FAKE_VLLM_DIR``: ``argv.json`` (its arguments), ``rpc`` (that socket's path), ``pids``
  (its own and a child's, the stand-in for vLLM's engine core in the same process group),
  ``bodies.jsonl`` (every request body) and ``record.json`` (``max_in_flight``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

OUT = Path(os.environ["FAKE_VLLM_DIR"])
LOCK = threading.Condition()
STATE = {"in_flight": 0, "max_in_flight": 0, "requests": 0, "drafts": 0, "accepted": 0}


def metrics(k: int) -> str:
    labels = 'engine="0",model_name="target"'
    d, a = STATE["drafts"], STATE["accepted"]
    lines = [
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {float(d)}",
        f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7962269255014985e+09",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(d * k)}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {float(a)}",
    ]
    for pos in range(k):
        n = a if pos == 0 else 0
        lines.append(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} '
            f"{float(n)}"
        )
    return "\n".join(lines) + "\n"


def complete(body: dict) -> list[int]:
    with LOCK:
        STATE["in_flight"] += 1
        STATE["max_in_flight"] = max(STATE["max_in_flight"], STATE["in_flight"])
        first = STATE["requests"] == 0
        STATE["requests"] += 1
        LOCK.notify_all()
        if first:
            LOCK.wait_for(lambda: STATE["in_flight"] > 1, timeout=5)
        with open(OUT / "bodies.jsonl", "a") as f:
            f.write(json.dumps(body) + "\n")
        (OUT / "record.json").write_text(json.dumps({"max_in_flight": STATE["max_in_flight"]}))
    base = sum(body["prompt"]) + (body.get("seed") or 0)
    out = []
    for i in range(body["max_tokens"]):
        out.append((base + i) % 1000)
        if out[-1] in body.get("stop_token_ids", []):
            break
    with LOCK:
        STATE["in_flight"] -= 1
        STATE["drafts"] += body["max_tokens"]
        STATE["accepted"] += body["max_tokens"]
    return out


class Handler(BaseHTTPRequestHandler):
    k = 1

    def log_message(self, fmt: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/metrics":
            with LOCK:
                text = metrics(self.k)
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("model") != "target":
            self._send(404, b'{"error": "not here"}', "application/json")
            return
        reply = {"choices": [{"token_ids": complete(body)}]}
        self._send(200, json.dumps(reply).encode(), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    assert sys.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], sys.argv
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative-config")
    args, _ = p.parse_known_args(sys.argv[3:])
    (OUT / "argv.json").write_text(json.dumps(sys.argv[1:]))
    # vLLM's ZeroMQ sockets: a socket file under $VLLM_RPC_BASE_PATH, as its processes
    # make them (a killed server leaves them there); where it is, in ``rpc``
    import socket
    import uuid

    rpc = Path(os.environ.get("VLLM_RPC_BASE_PATH", "/tmp")) / str(uuid.uuid4())
    socket.socket(socket.AF_UNIX).bind(str(rpc))
    (OUT / "rpc").write_text(str(rpc))
    if args.speculative_config:
        Handler.k = json.loads(args.speculative_config)["num_speculative_tokens"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (OUT / "pids").write_text(f"{os.getpid()} {child.pid}\n")
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
