"""What a trainer does with its client and its batches, against a real daemon.

Batches are the trainer's own (private copies): held ones never change, in-place writes
work, they pickle compactly. A client belongs to the process that connected it and is
dead after ``close()``. Paths and sizes the daemon sends are checked before anything is
mapped (a fake daemon sends hostile ``welcome`` messages).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from conftest import ROOT, TEST_SPEC, check_batch_tokens, expected_plan

from client import LoaderClient, LoaderError, ProtocolError
from loader_server.wire import protocol as P
from loader_server.wire import ring as R

pytestmark = pytest.mark.integration


# --- 5. in-place writes to a batch ------------------------------------------------------------

_WRITER = """
import sys
from client import LoaderClient
c = LoaderClient(sys.argv[1], job="w", rank=0, world_size=1)
for _ in range(6):
    b = next(c)
    labels = b.input_ids.clone()
    labels[b.loss_mask == 0] = -100          # a copy: always fine
    b.input_ids[b.loss_mask == 0] = -100     # in place
    b.loss_mask.mul_(3)
    b.lengths.add_(1)
    assert b.input_ids.numpy().flags.writeable
    b.input_ids.numpy()[:] = 7
print("ok")
"""


def test_in_place_writes_to_a_batch_work(daemons):
    d = daemons()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _WRITER, d.endpoint], capture_output=True,
                       text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# --- 6. held batches never change -------------------------------------------------------------


def test_held_batches_never_change(daemons, corpus):
    d = daemons("--slots", "2")
    c = LoaderClient(d.endpoint, job="h", rank=0, world_size=1)
    held = [next(c) for _ in range(12)]  # six times the ring
    snapshots = [(b.input_ids.clone(), b.loss_mask.clone()) for b in held]
    for _ in range(30):
        next(c)
    for b, (ids, mask) in zip(held, snapshots, strict=True):
        assert torch.equal(b.input_ids, ids) and torch.equal(b.loss_mask, mask)
        check_batch_tokens(corpus, b)
    c.close()


def test_list_of_the_loader_is_the_plan(daemons, corpus):
    d = daemons("--slots", "1")  # every batch outlives its slot
    batches = list(LoaderClient(d.endpoint, job="l", rank=0, world_size=1, epochs=1))
    plan = expected_plan(corpus, 0)
    assert [b.sample_ids.tolist() for b in batches] == [
        plan.micro(s, 0, 0).tolist() for s in range(plan.num_steps)
    ]
    for b in batches:
        check_batch_tokens(corpus, b)


def test_pickle_and_torch_save_are_compact_and_exact(daemons):
    d = daemons()
    with LoaderClient(d.endpoint, job="p", rank=0, world_size=1, spec={"layout": "packed"}) as c:
        for b in (next(c), next(c)):
            own = sum(t.numel() * t.element_size() for t in
                      (b.input_ids, b.loss_mask, b.lengths, b.sample_ids, b.position_ids,
                       b.cu_seqlens))  # fmt: skip
            blob = pickle.dumps(b)
            buf = io.BytesIO()
            torch.save(b, buf)
            assert len(blob) < own + 4096 and buf.tell() < own + 8192, (len(blob), own)
            for back in (pickle.loads(blob), torch.load(io.BytesIO(buf.getvalue()),
                                                        weights_only=False)):  # fmt: skip
                assert back.position == b.position and back.num_tokens == b.num_tokens
                for name in ("input_ids", "loss_mask", "position_ids", "cu_seqlens"):
                    assert torch.equal(getattr(back, name), getattr(b, name))


# --- process rules ------------------------------------------------------------------------------


def test_fork_after_connecting_raises_in_the_child(daemons):
    d = daemons()
    c = LoaderClient(d.endpoint, job="f", rank=0, world_size=1)
    first = next(c)
    pid = os.fork()
    if pid == 0:  # the child: must be refused, must not disturb the parent's session
        code = 1
        try:
            next(c)
        except LoaderError as e:
            code = 0 if "after fork()" in str(e) else 2
        except BaseException:
            code = 3
        c.close()  # only forgets the parent's connection
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    second = next(c)
    assert second.position > first.position and d.proc.poll() is None
    c.close()


def test_next_after_close_raises_and_exhaustion_keeps_stopping(daemons):
    d = daemons()
    c = LoaderClient(d.endpoint, job="c", rank=0, world_size=1)
    next(c)
    c.close()
    with pytest.raises(LoaderError, match="was closed"):
        next(c)
    done = LoaderClient(d.endpoint, job="e", rank=0, world_size=1, epochs=0)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(done)
    deadline = time.monotonic() + 10  # the daemon unlinks the closed session's ring
    while list(d.shm_dir.iterdir()):
        assert time.monotonic() < deadline, list(d.shm_dir.iterdir())
        time.sleep(0.02)


# --- paths and sizes from the wire -------------------------------------------------------------


class FakeDaemon:
    """Answers every ``open`` with the welcome a test gives it."""

    def __init__(self, endpoint: str, welcome: dict) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.welcome = welcome
        self.closed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, frame = self.sock.recv_multipart()
            msg = msgpack.unpackb(frame)
            if msg["t"] == "open":
                self.sock.send_multipart([peer, P.encode("welcome", **self.welcome)])
            elif msg["t"] == "close":
                self.closed.append(msg["s"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _welcome(shm_dir: Path, **over) -> dict:
    name = f"dflash-{os.getpid()}-0123abcd-0123456789ab"
    layout = R.SlotLayout.build(TEST_SPEC["token_budget"], TEST_SPEC["max_batch_size"])
    w = {"s": "0123456789ab", "instance": "0123abcd", "shm": str(shm_dir / name),
         "ctl": str(shm_dir / name) + ".ctl", "slots": 4, "slot_bytes": layout.slot_bytes,
         "layout": layout.to_wire(), "steps": 10, "fingerprint": "f", "spec": {}}  # fmt: skip
    w.update(over)
    return w


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("outside", "is not in this client's shm dir"),
        ("name", "not dflash-<pid>-0123abcd-0123456789ab"),
        ("ctl", "named control page"),
        ("symlink", "cannot open"),
        ("slots", "slots 100000 not in"),
        ("layout", "does not fit the slot"),
        ("writable", "writable by others"),
    ],
)
def test_client_maps_only_predictable_files_in_its_shm_dir(tmp_path, shm_dir, corpus_path,
                                                           case, text):  # fmt: skip
    w = _welcome(shm_dir)
    ring, ctl = Path(w["shm"]), Path(w["ctl"])
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * (1 << 20))
    if case == "outside":  # the right name in another folder
        other = tmp_path / ring.name
        other.write_bytes(bytes(1 << 20))
        w.update(shm=str(other), ctl=str(other) + ".ctl")
    elif case == "name":
        w.update(shm=str(shm_dir / "corpus.arrow"), ctl=str(shm_dir / "corpus.arrow.ctl"))
    elif case == "ctl":
        w.update(ctl=str(secret))
    elif case == "symlink":  # the right name, but a link to a file the client may read
        ring.symlink_to(secret)
    elif case == "slots":
        w.update(slots=100_000)
    elif case == "layout":
        bad = dict(w["layout"])
        bad["sample_ids"] = ["int64", 8, w["slot_bytes"]]  # runs past the slot
        w.update(layout=bad)
    elif case == "writable":
        ring.write_bytes(bytes(1 << 20))
        ctl.write_bytes(bytes(4096))
        os.chmod(ring, 0o666)
    endpoint = f"ipc://{tmp_path}/fake.sock"
    fake = FakeDaemon(endpoint, w)
    try:
        c = LoaderClient(endpoint, job="x", rank=0, world_size=1, timeout_s=3)
        with pytest.raises(ProtocolError, match=text):
            next(c)
        assert c._ring is None
    finally:
        fake.stop()
    assert secret.read_bytes() == b"s" * (1 << 20)


def test_hostile_slot_descriptions_are_refused(daemons):
    """A ring header describing more rows than a slot holds is an error, not a wild read."""
    d = daemons()
    c = LoaderClient(d.endpoint, job="m", rank=0, world_size=1)
    next(c)
    ring = c._ring
    deadline = time.monotonic() + 10
    while ring.produced() < 2:  # batch 1 is in its slot
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (path,) = (p for p in d.shm_dir.iterdir() if p.suffix != ".ctl")  # this session's ring
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), R.header_bytes(ring.slots)) as header:
        # The daemon will not write slot 1 again before batch 1 is consumed.
        R.SlotMeta.unpack_from(header, 1)._replace(rows=10**6).pack_into(header, 1)
    with pytest.raises(ProtocolError, match="capacity"):
        c._batch(1)
