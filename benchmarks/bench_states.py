"""Hidden states through each transport, against the limit: one memcpy of the same bytes.

    .venv/bin/python benchmarks/bench_states.py [--tokens 2048,8192] [--dtypes bf16,fp32]
        [--inflight 1,8] [--docs 12] [--json OUT]

Documents shaped like Qwen3-8B's states for 5 layers (``[T, 5, 4096]``: 84 MB a 2K-token
document in bf16, 336 MB an 8K one in bf16, twice that in fp32) move from a writer process
(the server's side: the connector's own writing code, ``trainer/vllm/connector``) to this
process (the trainer's side: the transport's own client code, ``trainer/engine``), until
they lie in memory the trainer reads (what the feed assembles a batch's features from). No
HTTP and no model: the transport alone. Rows, side by side in one run:

* ``memcpy``: the limit, one copy of the document from a source buffer into a buffer of
  the same size (both touched before: no page faults), one thread;
* ``files, before`` (the baseline: how states travelled before 2026-12-07): safetensors'
  ``save_file`` into ``/dev/shm``, ``load_file``, the copy, ``unlink``;
* ``files``: ``--states-transport files`` (the connector's ``write_states``, the client's
  lock wait, read and removal);
* ``shm``: ``--states-transport shm`` (each rank's arena: the region locked, written and
  let go by the writer, read where it lies by the trainer);
* ``mooncake, raw`` (Mooncake's own limit: its zero-copy calls on registered buffers, no
  layer of ours): the writer ``put_from`` a registered buffer holding the document into
  the reader's segment, then answers; the reader ``get_into`` its registered buffer and
  removes the key; loopback TCP, a master started here;
* ``mooncake``: ``--states-transport mooncake`` (the connector's ``Writer.put``: the region
  layout into a pooled staging buffer, ``put_from`` into the rank's segment; the client
  waits for the key, ``get_into`` its receive buffer, removes it, reads it where it lies).

Each row: GB/s (documents' bytes over the wall time, ``k`` documents in flight: ``k``
writer and ``k`` reader threads), p50 and p99 latency of a document (its request sent to
its bytes readable by the trainer), the fraction of the memcpy limit, and for ``mooncake``
the fraction of ``mooncake, raw`` with as many in flight. Before the clock
starts, ``k`` documents go through once (the writer's imports, the arena's first pages).
Measured on this machine's two cores: the writer and the reader share them, one thread
each (``torch.set_num_threads(1)``), as the memcpy limit.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "trainer" / "vllm" / "connector"))

LAYERS, WIDTH = 5, 4096  # Qwen3-8B, 5 feature layers
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def document(tokens: int, dtype: str):
    import torch

    g = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, LAYERS, WIDTH, generator=g).to(getattr(torch, dtype))


# ---- the writer's side (a process of its own, as the server is) ---------------------------


def writer(conn, folder: str, tokens: int, dtype: str, threads: int, store: dict) -> None:
    """Serve ``(kind, req_id, where)`` requests from ``conn`` with ``threads`` threads: the
    request's states written the transport's way, the lock taken before the answer."""
    import fcntl

    import torch
    from dflash_states_file import write_states
    from dflash_states_shm import Arenas, target_of
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    states = document(tokens, dtype)
    ids = torch.arange(tokens)
    arenas = Arenas(folder)
    send = threading.Lock()
    putter, raw = _mooncake_writer(store, states) if store else (None, None)

    def one(kind: str, req_id: str, where: dict) -> None:
        if kind == "mooncake":
            with send:
                conn.send(req_id)  # the reply first, the put after it (as the connector)
            assert putter is not None  # a mooncake job comes with its store
            putter.put(req_id, where["segment"], {"hidden_states": states, "token_ids": ids})
            return
        if kind == "mooncake-raw":
            assert raw is not None
            raw(req_id, where["segment"])
            with send:
                conn.send(req_id)
            return
        if kind == "shm":
            target = target_of(where["arena"], where["offset"], where["nbytes"], req_id)
            arenas.lock(target)
            with send:
                conn.send(req_id)  # the reply: the region is locked
            arenas.write(target, req_id, {"hidden_states": states, "token_ids": ids})
            return
        path = os.path.join(folder, f"cmpl-{req_id}-0-x.safetensors")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with send:
            conn.send(path)
        if kind == "files-before":
            save_file({"hidden_states": states, "token_ids": ids}, path)
        else:
            write_states(path, {"hidden_states": states, "token_ids": ids})
        os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        while (msg := conn.recv()) is not None:
            pool.submit(one, *msg)


def _mooncake_writer(store: dict, states):
    """The connector's writer, and the raw put of the document from one registered buffer
    (Mooncake's own zero-copy call, no layer of ours)."""
    import torch
    from dflash_states_mooncake import Writer, connect

    putter = Writer(protocol="tcp", local_host="127.0.0.1", **store)
    client = connect(protocol="tcp", local_host="127.0.0.1", **store)  # (its logging set)
    from mooncake.store import ReplicateConfig

    flat = states.reshape(-1).view(torch.uint8).clone()
    client.register_buffer(flat.data_ptr(), flat.numel())

    def raw(key: str, segment: str) -> None:
        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = segment
        code = client.put_from(key, flat.data_ptr(), flat.numel(), config)
        assert code == 0, code

    return putter, raw


# ---- the reader's side (this process, as a trainer rank) -----------------------------------


def memcpy_row(tokens: int, dtype: str, docs: int) -> dict:
    import torch

    src = document(tokens, dtype)
    dst = torch.empty_like(src)
    dst.copy_(src)
    lat = []
    t0 = time.perf_counter()
    for _ in range(docs):
        t = time.perf_counter()
        dst.copy_(src)
        lat.append(time.perf_counter() - t)
    return _row("memcpy", 1, docs, src, time.perf_counter() - t0, lat)


#: Each transport's row name.
NAMES = {"files-before": "files, before (baseline)", "files": "files", "shm": "shm",
         "mooncake-raw": "mooncake, raw (its limit)", "mooncake": "mooncake"}  # fmt: skip


def transport_row(kind: str, tokens: int, dtype: str, docs: int, inflight: int,
                  store: dict | None = None) -> dict:  # fmt: skip
    """``docs`` documents through ``kind`` with ``inflight`` in flight (``store``: a
    Mooncake master's addresses, for the Mooncake rows)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-states-", dir="/dev/shm"))
    ours, theirs = mp.Pipe()
    job = (theirs, str(folder), tokens, dtype, inflight, store or {})
    proc = mp.get_context("spawn").Process(target=writer, args=job)
    proc.start()
    like = document(tokens, dtype)
    reader = Reader(kind, ours, folder, like, inflight, store)
    threading.Thread(target=reader.listen, daemon=True).start()
    try:
        with ThreadPoolExecutor(inflight) as pool:  # warm-up: imports, the arena's pages
            list(pool.map(reader.one, range(10**6, 10**6 + inflight)))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(inflight) as pool:
            lat = list(pool.map(reader.one, range(docs)))
        wall = time.perf_counter() - t0
    finally:
        ours.send(None)
        proc.join(60)
        reader.close()
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    return _row(NAMES[kind], inflight, docs, like, wall, lat)


class Reader:
    """The trainer's side of one transport row: each document requested from the writer
    (``conn``), its answer awaited, and the document read the transport's way."""

    def __init__(self, kind: str, conn, folder: Path, like, inflight: int,
                 store: dict | None) -> None:  # fmt: skip
        from trainer.engine.files import FileTransport
        from trainer.engine.seam import Attempt
        from trainer.engine.shm import ShmTransport
        from trainer.vllm.connector.dflash_states_shm import region_bytes

        self.kind, self.conn, self.like = kind, conn, like
        self.nbytes = region_bytes(like.shape[0], LAYERS, WIDTH, like.element_size())
        self.run = "benchbench000-000000"
        room_mb = max(1, (inflight + 1) * self.nbytes >> 20) + 1
        self.shm = ShmTransport(folder, run=self.run, rank=0, size_mb=room_mb)
        self.files = FileTransport(folder, run=self.run, rank=0)
        self.mc = None
        if kind.startswith("mooncake"):
            from trainer.engine.mooncake import MooncakeTransport

            self.mc = MooncakeTransport(None, run=self.run, rank=0, size_mb=2 * room_mb,
                                        **(store or {}))  # fmt: skip
        self.replies: dict[str, threading.Event] = {}
        self.answered: dict[str, str] = {}
        self.lock = threading.Lock()
        self.seen = 0.0
        self.attempt = Attempt("bench", time.monotonic() + 3600, lambda: False, lambda text: None)

    def listen(self) -> None:
        """Take the writer's answers until the pipe closes, waking the request of each."""
        while True:
            try:
                said = self.conn.recv()
            except EOFError:
                return
            key = said if self.kind in ("shm", "mooncake", "mooncake-raw") else (
                Path(said).name.split("-0-x")[0][5:])  # fmt: skip
            with self.lock:
                self.answered[key] = said
                self.replies[key].set()

    def one(self, k: int) -> float:
        """Document ``k`` requested and read; returns its latency in seconds."""
        req_id = f"dflash-{self.run}-r0-{k}"
        with self.lock:
            self.replies[req_id] = threading.Event()
        t = time.perf_counter()
        if self.kind in ("mooncake", "mooncake-raw"):
            self._mooncake(req_id)
        elif self.kind == "shm":
            self._shm(req_id)
        else:
            self._files(req_id)
        return time.perf_counter() - t

    def _mooncake(self, req_id: str) -> None:
        """Through Mooncake: our transport's fetch, or (raw) its own get_into alone."""
        mc = self.mc
        assert mc is not None
        region = mc.place(self.nbytes)
        mc.ready(region, self.attempt)
        self.conn.send((self.kind, req_id, {"segment": mc.segment}))
        self.replies[req_id].wait()
        if self.kind == "mooncake":
            got = mc.fetch(region, req_id, self.attempt)
            self.seen += float(got["hidden_states"][-1, -1, -1])
            del got
        else:  # Mooncake alone: get_into the registered buffer, remove the key
            size = self.like.numel() * self.like.element_size()
            code = mc.store.get_into(req_id, mc.buffer.data_ptr() + region.offset, size)
            assert code == size, code
            mc.store.remove(req_id, True)
        mc.release(region)

    def _shm(self, req_id: str) -> None:
        """Through the shared-memory arena: read where it lies."""
        region = self.shm.place(self.nbytes)
        self.shm.ready(region, self.attempt)
        where = self.shm.params(region, req_id)["dflash_shm"]
        self.conn.send(("shm", req_id, where))
        self.replies[req_id].wait()
        got = self.shm.fetch(region, req_id, self.attempt)
        self.seen += float(got["hidden_states"][-1, -1, -1])  # read where it lies
        del got
        self.shm.release(region)

    def _files(self, req_id: str) -> None:
        """Through a file: our transport's fetch, or (before) the plain flock, load, unlink."""
        self.conn.send((self.kind, req_id, {}))
        self.replies[req_id].wait()
        path = Path(self.answered[req_id])
        if self.kind == "files":
            got = self.files.fetch(None, path, self.attempt)
        else:  # before: the plain flock, load_file, unlink
            import fcntl

            from safetensors.torch import load_file

            with open(str(path) + ".lock") as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
                got = load_file(str(path))
            os.unlink(path)
            os.unlink(str(path) + ".lock")
        self.seen += float(got["hidden_states"][-1, -1, -1])

    def close(self) -> None:
        """Let the arena (and Mooncake's buffers) go."""
        self.shm.close()
        if self.mc is not None:
            self.mc.close()


def _row(name: str, inflight: int, docs: int, like, wall: float, lat: list[float]) -> dict:
    size = like.numel() * like.element_size()
    lat = sorted(lat)
    return {"transport": name, "inflight": inflight, "gb_s": docs * size / wall / 1e9,
            "p50_ms": 1e3 * statistics.median(lat),
            "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mb": size / 1e6}  # fmt: skip


@click.command()
@click.option("--tokens", default="2048,8192", show_default=True, help="Document lengths.")
@click.option("--dtypes", default="bf16,fp32", show_default=True)
@click.option("--inflight", default="1,8", show_default=True, help="Documents in flight.")
@click.option("--docs", default=12, show_default=True, help="Documents per row.")
@click.option("--transports", default="files-before,files,shm,mooncake-raw,mooncake",
              show_default=True)  # fmt: skip
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the rows here.")
def main(tokens: str, dtypes: str, inflight: str, docs: int, transports: str,
         json_out: Path | None) -> None:  # fmt: skip
    """Hidden states of Qwen3-8B's shape through each transport, against one memcpy."""
    import contextlib

    import torch

    from trainer.engine.mooncake import master

    torch.set_num_threads(1)
    rows = []
    stack = contextlib.ExitStack()
    store = None
    if "mooncake" in transports:
        address, url, _ = stack.enter_context(master(Path(tempfile.mkdtemp()) / "master.log"))
        store = {"master": address, "metadata": url}
    print(f"{'document':>18} {'transport':>26} {'in flight':>9} {'GB/s':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'x memcpy':>9} {'x raw':>6}")  # fmt: skip
    for t in (int(x) for x in tokens.split(",")):
        for d in dtypes.split(","):
            limit = memcpy_row(t, DTYPES[d], docs)
            group = [limit]
            for kind in transports.split(","):
                for k in (int(x) for x in inflight.split(",")):
                    group.append(transport_row(kind, t, DTYPES[d], docs, k, store))
            raw = {r["inflight"]: r["gb_s"] for r in group if r["transport"].endswith("limit)")}
            for r in group:
                r.update(tokens=t, dtype=d, of_memcpy=r["gb_s"] / limit["gb_s"])
                if r["transport"] == "mooncake" and r["inflight"] in raw:
                    r["of_raw"] = r["gb_s"] / raw[r["inflight"]]
                of_raw = f"{r['of_raw']:>6.2f}" if "of_raw" in r else f"{'':>6}"
                print(f"{t:>6} tok {d:>4} {r['mb']:>4.0f}MB {r['transport']:>26} "
                      f"{r['inflight']:>9} {r['gb_s']:>7.2f} {r['p50_ms']:>8.1f} "
                      f"{r['p99_ms']:>8.1f} {r['of_memcpy']:>9.2f} {of_raw}",
                      flush=True)  # fmt: skip
            rows += group
    stack.close()
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
