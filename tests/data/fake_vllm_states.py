"""A stand-in for a vLLM server extracting hidden states (``extract_hidden_states`` with
``trainer.engine``'s connector), for the tests of ``trainer.engine`` (the real vLLM is
``make serve-check``'s).

It keeps vLLM 0.32's conventions, as ``trainer.engine.states`` documents them: layer id
``k`` is the output after ``k`` decoder layers, id ``L`` the last layer's before the final
norm; the ids come back in ascending order; the file is
``STATES/cmpl-<X-Request-Id>-0-<random>.safetensors`` (``hidden_states [T, n, H]``,
``token_ids [T]``), written after the reply while an exclusive ``flock`` on its ``.lock``
is held, through the connector's own writer (``dflash_states_file.write_states``: into
``NAME.part``, then renamed); or, for a request whose ``kv_transfer_params`` name a region
of a trainer's arena (``dflash_shm``), into that region under its record lock, as the
connector does (``dflash_states_shm``); or, for one that names a Mooncake key and segment
(``dflash_mooncake``), put into the store (``dflash_states_mooncake``; ``--mooncake-master``
and ``--mooncake-metadata``). ``GET /v1/models`` names the model, its ``root`` and its
``max_model_len``. A request's ``dflash_dtype`` casts what it sends, as the connector does
(``dflash_states_wire.encode``); one its torch does not carry is refused (``dflash_error``).

As a script (``python fake_vllm_states.py --model DIR --port N --layer-ids 1,2,4 --states
DIR [--max-model-len N]``) it computes the states with Transformers. Imported, ``serve``
runs one in a thread with any ``states`` function (the client's unit tests).

Faults, from the environment (script) or ``Faults`` (imported):

* ``FAKE_STATES_DIE_AFTER=N``: exit (as a kill would) after the N-th reply, its file half
  written (``FAKE_STATES_DIE_UNWRITTEN=1``: the ``.part`` half written, never renamed);
* ``FAKE_STATES_WRONG_TOKENS=1``: files name other token ids than asked for;
* ``FAKE_STATES_BAD=KIND@N``: the N-th reply's file is wrong in one way: ``nan`` (a NaN in
  its states), ``dtype`` (bfloat16, the others float32), ``shape`` (a layer short),
  ``fifo`` (a FIFO, not a file), ``outside`` (the reply names ``FAKE_STATES_VICTIM``, a
  path outside the folder), ``foreign`` (it names a file of another request in the folder),
  ``unwritable`` (the connector's write fails: states of a dtype neither the region
  layout nor safetensors carries, complex64; its writer then says why);
* ``FAKE_STATES_STATUS=CODE``: every request answered with that HTTP status (a web server
  that is not vLLM, a proxy);
* ``FAKE_STATES_ROOT=PATH``: ``/v1/models`` says it serves that model.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainer" / "vllm" / "connector"))
from dflash_states_file import PART, write_failure, write_states  # the connector's writers
from dflash_states_mooncake import Writer
from dflash_states_shm import Arenas, target_of
from dflash_states_wire import WIRE, encode


@dataclass
class Faults:
    die_after: int = 0
    die_unwritten: bool = False
    wrong_tokens: bool = False
    bad: str = ""  # KIND@N
    victim: str = ""
    status: int = 0
    root: str = ""

    @classmethod
    def from_env(cls) -> Faults:
        e = os.environ.get
        return cls(
            die_after=int(e("FAKE_STATES_DIE_AFTER", "0")),
            die_unwritten=e("FAKE_STATES_DIE_UNWRITTEN") == "1",
            wrong_tokens=e("FAKE_STATES_WRONG_TOKENS") == "1",
            bad=e("FAKE_STATES_BAD", ""), victim=e("FAKE_STATES_VICTIM", ""),
            status=int(e("FAKE_STATES_STATUS", "0")), root=e("FAKE_STATES_ROOT", ""),
        )  # fmt: skip

    def bad_kind(self, n: int) -> str | None:
        if "@" not in self.bad:
            return None
        kind, at = self.bad.split("@")
        return kind if int(at) == n else None


def model_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
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


def serve(
    port: int, folder: Path, states: Callable[[list[int]], torch.Tensor], *, root: str,
    max_model_len: int = 1024, faults: Faults | None = None, mooncake: dict | None = None,
) -> ThreadingHTTPServer:  # fmt: skip
    """The server on ``127.0.0.1:port`` (not yet serving: call ``serve_forever``);
    ``mooncake``: the store's ``master`` and ``metadata`` (puts for ``dflash_mooncake``)."""
    faults = faults or Faults()
    lock, served = threading.Lock(), {"n": 0}
    arenas = Arenas(str(folder))
    writer = Writer(protocol="tcp", local_host="127.0.0.1", **mooncake) if mooncake else None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if faults.status:
                self._send(faults.status, {"detail": "Not Found"})
            elif self.path == "/v1/models":
                self._send(200, {"data": [{"id": "target", "root": faults.root or root,
                                           "max_model_len": max_model_len}]})  # fmt: skip
            else:
                self._send(200, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if faults.status:
                self._send(faults.status, {"detail": "Not Found"})
                return
            ids = [int(t) for t in body["prompt"]]
            if len(ids) > max_model_len - 1:
                self._send(400, {"error": "prompt too long"})
                return
            rid = self.headers.get("X-Request-Id") or uuid.uuid4().hex
            asked = body.get("kv_transfer_params") or {}
            wire = str(asked.get("dflash_dtype") or "")
            if wire and wire not in WIRE:  # as the connector: said in the reply
                self._send(200, {"choices": [{"index": 0, "text": ""}], "kv_transfer_params": {
                    "dflash_error": f"dflash_dtype {wire!r}: not carried"}})  # fmt: skip
                return
            if asked.get("dflash_mooncake") is not None:
                self._put(ids, asked["dflash_mooncake"], wire)
                return
            if asked.get("dflash_shm") is not None:
                self._region(ids, rid, asked["dflash_shm"], wire)
                return
            path = folder / f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}.safetensors"
            lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            hs, tokens, kind, dying = self._computed(ids)
            named = str(path)
            if kind == "outside":
                named = faults.victim
            elif kind == "foreign":
                named = str(folder / f"cmpl-dflash-other-0-r0-{served['n']}-0-abcd.safetensors")
            self._send(200, {"choices": [{"index": 0, "text": ""}],
                             "kv_transfer_params": {"hidden_states_path": named}})  # fmt: skip
            self.wfile.flush()
            if dying:  # as a kill mid-write: half a file, the lock released by the exit
                if faults.die_unwritten:
                    Path(str(path) + PART).write_bytes(b"\x00" * 7)
                else:
                    path.write_bytes(b"\x00" * 7)
                os._exit(1)
            time.sleep(0.01)  # the write lands after the reply, as vLLM's thread's does
            if kind == "fifo":
                os.mkfifo(path, 0o600)
            else:
                try:
                    write_states(str(path), {**encode(hs, wire), "token_ids": tokens})
                except KeyError as e:  # as the connector's writer: why, beside the file
                    write_failure(str(path), f"{type(e).__name__}: {e}")
            os.close(lock_fd)

        def _computed(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, str | None, bool]:
            """A document's states and token ids as the faults say, its fault, and whether
            the server dies before they are written."""
            with lock:
                hs = states(ids)
                served["n"] += 1
                n = served["n"]
                dying = bool(faults.die_after and n >= faults.die_after)
            kind = faults.bad_kind(n)
            tokens = torch.tensor([(t + 1) % 7 for t in ids] if faults.wrong_tokens else ids)
            if kind == "nan":
                hs = hs.clone()
                hs[len(ids) // 2, 0, 1] = float("nan")
            elif kind == "dtype":
                hs = hs.to(torch.bfloat16)
            elif kind == "shape":
                hs = hs[:, :-1].contiguous()
            elif kind == "unwritable":
                hs = hs.to(torch.complex64)
            return hs, tokens, kind, dying

        def _put(self, ids: list[int], asked: dict, wire: str) -> None:
            """The connector's Mooncake path: the reply names the key, the put follows."""
            hs, tokens, kind, dying = self._computed(ids)
            key = str(asked["key"]) + ("-other" if kind == "outside" else "")
            self._send(200, {"choices": [{"index": 0, "text": ""}],
                             "kv_transfer_params": {"dflash_mooncake": {"key": key}}})  # fmt: skip
            self.wfile.flush()
            if dying:
                os._exit(1)
            time.sleep(0.01)  # the put lands after the reply, as vLLM's thread's does
            assert writer is not None, "serve(..., mooncake=...) for dflash_mooncake requests"
            try:
                writer.put(
                    str(asked["key"]),
                    str(asked["segment"]),
                    {**encode(hs, wire), "token_ids": tokens},
                )
            except (RuntimeError, ValueError) as e:  # (a rank gone): logged, as the connector
                print(f"stand-in: {e}", file=sys.stderr)

        def _region(self, ids: list[int], rid: str, region: dict, wire: str) -> None:
            """The connector's shm path: the region locked before the reply, written after."""
            try:
                arenas.check(region["arena"], int(region["offset"]), int(region["nbytes"]))
            except (ValueError, OSError) as e:  # as the connector: said, not raised
                self._send(200, {"choices": [{"index": 0, "text": ""}], "kv_transfer_params": {
                    "dflash_shm_error": f"{type(e).__name__}: {e}"}})  # fmt: skip
                return
            target = target_of(region["arena"], int(region["offset"]), int(region["nbytes"]),
                               str(region["key"]))  # fmt: skip
            arenas.lock(target)
            hs, tokens, kind, dying = self._computed(ids)
            placed = {k: region[k] for k in ("arena", "offset", "nbytes")}
            if kind == "outside":
                placed = {**placed, "offset": placed["offset"] + 64}
            self._send(200, {"choices": [{"index": 0, "text": ""}],
                             "kv_transfer_params": {"dflash_shm": placed}})  # fmt: skip
            self.wfile.flush()
            if dying:  # killed mid-write: the lock goes with the process, the header unwritten
                os._exit(1)
            time.sleep(0.01)  # the write lands after the reply, as vLLM's thread's does
            try:
                arenas.write(target, str(region["key"]), {**encode(hs, wire), "token_ids": tokens})
            except ValueError as e:  # logged, as the connector does
                print(f"stand-in: {e}", file=sys.stderr)

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # a trainer keeps dozens of requests in flight
        daemon_threads = True

    return Server(("127.0.0.1", port), Handler)


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--states", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--mooncake-master", default="")
    ap.add_argument("--mooncake-metadata", default="")
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layer_ids = sorted({int(k) for k in args.layer_ids.split(",")})
    server = serve(
        args.port, Path(args.states), lambda ids: model_states(model, ids, layer_ids),
        root=args.model, max_model_len=args.max_model_len, faults=Faults.from_env(),
        mooncake={"master": args.mooncake_master, "metadata": args.mooncake_metadata}
        if args.mooncake_master else None,
    )  # fmt: skip
    server.serve_forever()


if __name__ == "__main__":
    main()
