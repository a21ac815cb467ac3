"""The real daemon in a subprocess, real clients: exact delivery, resume, faults, bad input."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import (
    TEST_SPEC,
    audited,
    batch_crc,
    check_batch_tokens,
    expected_plan,
    read_runs,
)

from client import LoaderClient, LoaderRequestError, LoaderUnavailableError
from loader_server.wire import protocol as P
from loader_server.wire import ring as R

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "consume.py"


def consume(client: LoaderClient, limit: int | None = None) -> list:
    out = []
    for batch in client:
        out.append(batch.clone())
        if limit is not None and len(out) >= limit:
            break
    return out


def plan_sequence(ds, rank: int, epochs: range, **spec) -> list[tuple[tuple[int, int, int], list]]:
    """This rank's (position, sample ids) in order, straight from the planner."""
    seq = []
    for e in epochs:
        plan = expected_plan(ds, e, **spec)
        g = plan.spec.grad_accum
        for s in range(plan.num_steps):
            for m in range(g):
                seq.append(((e, s, m), plan.micro(s, rank, m).tolist()))
    return seq


def seq_of(batches) -> list[tuple[tuple[int, int, int], list]]:
    return [(b.position, b.sample_ids.tolist()) for b in batches]


def test_ranks_receive_exactly_the_plan(daemons, corpus):
    d = daemons()
    world, accum = 3, 2
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        c = LoaderClient(d.endpoint, job="exact", rank=rank, world_size=world, epochs=2,
                         spec={"grad_accum": accum})  # fmt: skip
        results[rank] = consume(c)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rank in range(world):
        want = plan_sequence(corpus, rank, range(2), world_size=world, grad_accum=accum)
        assert seq_of(results[rank]) == want
        for b in results[rank][::7]:
            check_batch_tokens(corpus, b)
    for e in range(2):
        served = [s for r in range(world) for (pos, ids) in seq_of(results[r]) if pos[0] == e
                  for s in ids]  # fmt: skip
        plan = expected_plan(corpus, e, world_size=world, grad_accum=accum)
        assert len(served) == len(set(served)) == plan.stats["served"]
    assert not list(d.shm_dir.iterdir()), "finished clients left rings behind"


def test_resume_from_state_dict_is_bit_exact(daemons):
    d = daemons()
    everything = consume(LoaderClient(d.endpoint, job="r", rank=0, world_size=1, epochs=2))
    first = LoaderClient(d.endpoint, job="r", rank=0, world_size=1, epochs=2)
    head = consume(first, limit=77)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    first.close()
    second = LoaderClient(d.endpoint, job="r", rank=0, world_size=1, epochs=2)
    second.load_state_dict(state)
    rest = consume(second)
    assert len(head) + len(rest) == len(everything)
    for a, b in zip(head + rest, everything, strict=True):
        assert a.position == b.position
        for name in ("input_ids", "loss_mask", "lengths", "sample_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name))


def _run_worker(d, job, rank, world, tmp_path, epochs=1, spec=None):
    state, log = tmp_path / f"state{rank}.json", tmp_path / f"log{rank}.txt"
    args = [sys.executable, str(WORKER), d.endpoint, job, str(rank), str(world), str(state),
            str(log), str(epochs)]  # fmt: skip
    if spec:
        args.append(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.Popen(args, env=env)


def _wait_lines(path: Path, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.005)
    raise TimeoutError(f"{path} did not reach {n} lines")


def test_kill9_client_then_restart_continues_exactly(daemons, corpus, tmp_path):
    d = daemons()
    log = tmp_path / "log0.txt"
    p = _run_worker(d, "k", 0, 1, tmp_path)
    _wait_lines(log, 40)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    p = _run_worker(d, "k", 0, 1, tmp_path)
    assert p.wait(60) == 0
    runs = read_runs(log)
    assert len(runs) == 2 and runs[1][0] > (0, 0, 0)
    got = audited(log)
    assert [(pos, ids) for pos, _, ids in got] == plan_sequence(corpus, 0, range(1))
    for _, crc, ids in got:
        assert crc == batch_crc(corpus, ids)


def test_kill9_daemon_then_new_daemon_client_continues(daemons, corpus):
    d = daemons()
    client = LoaderClient(d.endpoint, job="dk", rank=0, world_size=1, epochs=1, dead_after_s=0.5)
    got = consume(client, limit=50)
    d.kill()
    stale = list(d.shm_dir.iterdir())
    assert stale, "the killed daemon's ring should still be there before the sweep"
    d2 = daemons()  # same endpoint and shm dir: sweeps the dead instance's rings
    got += consume(client)
    assert seq_of(got) == plan_sequence(corpus, 0, range(1))
    for b in got[45:55]:
        check_batch_tokens(corpus, b)
    assert not any(p.exists() for p in stale)
    d2.stop()


def test_two_daemons_serve_halves_of_one_world(daemons, corpus):
    a, b = daemons(name="node0"), daemons(name="node1")
    world = 4
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        ep = a.endpoint if rank < 2 else b.endpoint
        results[rank] = consume(LoaderClient(ep, job="mn", rank=rank, world_size=world, epochs=1))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    plan = expected_plan(corpus, 0, world_size=world)
    served = []
    for rank in range(world):
        assert seq_of(results[rank]) == plan_sequence(corpus, rank, range(1), world_size=world)
        served += [s for b in results[rank] for s in b.sample_ids.tolist()]
    assert sorted(served) == sorted(plan.sample_ids.tolist())


def test_packed_layout(daemons, corpus):
    d = daemons()
    c = LoaderClient(d.endpoint, job="p", rank=0, world_size=1, epochs=1, spec={"layout": "packed"})
    batches = consume(c)
    plan = expected_plan(corpus, 0, layout="packed")
    assert seq_of(batches) == plan_sequence(corpus, 0, range(1), layout="packed")
    for b in batches[:20]:
        assert b.input_ids.shape[0] == 1 and b.input_ids.shape[1] <= TEST_SPEC["token_budget"]
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == b.input_ids.shape[1]
        assert b.max_seqlen == max(np.diff(cu))
        for k, sid in enumerate(b.sample_ids.tolist()):
            lo, hi = cu[k], cu[k + 1]
            n = hi - lo
            assert np.array_equal(b.input_ids[0, lo:hi].numpy(), corpus.input_ids(sid)[:n])
            assert np.array_equal(b.loss_mask[0, lo:hi].numpy(), corpus.loss_mask(sid)[:n])
            assert b.position_ids[0, lo:hi].tolist() == list(range(n))
    assert sum(len(b.sample_ids) for b in batches) == plan.stats["served"]


# --- bad input: error replies, the daemon keeps serving ------------------------------------


def _raw(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _reply(sock: zmq.Socket, timeout_s: float = 5) -> dict:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return msgpack.unpackb(sock.recv(), raw=False)


def _open_msg(**over) -> bytes:
    fields = {"job": "bad", "rank": 0, "world_size": 2, "spec": {}, "pos": [0, 0, 0]}
    return P.encode("open", **{**fields, **over})


@pytest.mark.parametrize(
    ("frames", "code", "text"),
    [
        ([b"\xc1\xff garbage"], P.E_MALFORMED, "undecodable"),
        ([msgpack.packb({"v": 99, "t": "open"})], P.E_VERSION, "protocol version 99"),
        ([msgpack.packb([1, 2, 3])], P.E_MALFORMED, "not a map"),
        ([P.encode("open")[:-3]], P.E_MALFORMED, "undecodable"),
        ([P.encode("launch_missiles")], P.E_BAD_REQUEST, "unknown message type"),
        ([P.encode("ping"), b"extra"], P.E_MALFORMED, "expected 1 message frame"),
        ([_open_msg(rank=5)], P.E_BAD_REQUEST, "rank must be"),
        ([_open_msg(spec={"token_budget": 10})], P.E_BAD_REQUEST, "token_budget 10"),
        ([_open_msg(spec={"tokne_budget": 10})], P.E_BAD_REQUEST, "unknown BatchSpec field"),
        ([_open_msg(pos=[0, -1, 0])], P.E_BAD_REQUEST, "non-negative"),
        ([P.encode("release", s="nope", slot=0)], P.E_UNKNOWN_SESSION, "unknown session"),
        ([P.encode("open", job="x" * 129, rank=0, world_size=1)], P.E_BAD_REQUEST, "job must"),
    ],
)
def test_bad_messages_get_error_replies(daemons, frames, code, text):
    d = daemons()
    sock = _raw(d.endpoint)
    sock.send_multipart(frames)
    reply = _reply(sock)
    assert reply["t"] == "error" and reply["code"] == code and text in reply["msg"], reply
    assert d.proc.poll() is None
    sock.close()


def test_daemon_survives_abuse_while_serving_others(daemons, corpus):
    d = daemons()
    good = LoaderClient(d.endpoint, job="good", rank=0, world_size=2, epochs=1)
    got = consume(good, limit=10)
    sock = _raw(d.endpoint)
    sock.send(b"\x00" * (P.MAX_MESSAGE_BYTES + 10))  # oversized: ZeroMQ drops this peer
    for _ in range(200):
        sock.send(os.urandom(64))
    sock.send(P.encode("release", s="nope", slot=3))
    # Another rank of the job with another world size or spec is refused; rank 0 is not hurt.
    for over, what in (({"world_size": 3}, "world_size 2"), ({"spec": {"seed": 5}}, "seed")):
        bad = _raw(d.endpoint)
        bad.send(_open_msg(**{"job": "good", "rank": 1, "world_size": 2, **over}))
        reply = _reply(bad)
        while reply["t"] != "error":
            reply = _reply(bad)
        assert reply["code"] == P.E_MISMATCH and what in reply["msg"], reply
        bad.close()
    got += consume(good)
    assert seq_of(got) == plan_sequence(corpus, 0, range(1), world_size=2)
    assert d.proc.poll() is None
    with pytest.raises(LoaderRequestError, match="token_budget must be"):
        next(
            iter(LoaderClient(d.endpoint, job="z", rank=0, world_size=1, spec={"token_budget": 0}))
        )
    with pytest.raises(ValueError, match="spec world_size 3"):
        LoaderClient(d.endpoint, job="z", rank=0, world_size=1, spec={"world_size": 3})


# --- lifecycle ------------------------------------------------------------------------------


def test_sigterm_tells_clients_unlinks_rings_exits_zero(daemons):
    d = daemons()
    client = LoaderClient(d.endpoint, job="t", rank=0, world_size=1, timeout_s=1.0,
                          dead_after_s=0.3)  # fmt: skip
    next(client)
    ring, ctl = sorted(d.shm_dir.iterdir())
    assert ctl.name == ring.name + ".ctl"
    assert stat.S_IMODE(ring.stat().st_mode) == 0o600 == stat.S_IMODE(ctl.stat().st_mode)
    assert d.stop() == 0
    assert not list(d.shm_dir.iterdir())
    # Batches already announced stay readable (the mapping outlives the unlink); then `bye`,
    # then no daemon: the client gives up after its timeout.
    with pytest.raises(LoaderUnavailableError, match="no loader daemon answered"):
        for _ in range(10):  # up to a full ring (4 slots, none held by the client) first
            next(client)
    assert "stopped" in d.log()


def test_ring_and_socket_modes_follow_config(daemons):
    d = daemons()
    sock_path = Path(d.endpoint[len("ipc://") :])
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600  # owner only by default
    d.stop()
    d = daemons("--shm-mode", "0640")
    client = LoaderClient(d.endpoint, job="m", rank=0, world_size=1)
    next(client)
    ring, ctl = sorted(d.shm_dir.iterdir())
    assert stat.S_IMODE(ring.stat().st_mode) == 0o640
    # group members may read rings, so they may connect and write their control page.
    assert stat.S_IMODE(ctl.stat().st_mode) == 0o660
    assert stat.S_IMODE(sock_path.stat().st_mode) == 0o660
    client.close()


def test_client_imports_neither_pyarrow_nor_the_daemon_beyond_the_wire():
    code = (
        "import sys, client; from client import LoaderClient, Batch; "
        "bad = [m for m in sys.modules if m.startswith('pyarrow') or m.startswith("
        "'loader_server.') and not m.startswith('loader_server.wire')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_second_daemon_on_same_endpoint_refuses(daemons, tmp_path, shm_dir, corpus_path):
    d = daemons()
    p = subprocess.run(
        [sys.executable, "-m", "loader_server", "serve", "--dataset", str(corpus_path),
         "--endpoint", d.endpoint, "--shm-dir", str(shm_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode != 0
    assert f"another dflash-loader daemon (pid {d.proc.pid}) is serving" in p.stderr
    assert d.proc.poll() is None


def test_stats_command(daemons):
    d = daemons()
    client = LoaderClient(d.endpoint, job="st", rank=0, world_size=1)
    consume(client, limit=5)
    out = subprocess.run(
        [sys.executable, "-m", "loader_server", "stats", "--endpoint", d.endpoint, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    st = json.loads(out)
    (sess,) = st["sessions"]
    assert sess["job"] == "st" and sess["rank"] == 0 and sess["batches"] >= 5
    text = subprocess.run(
        [sys.executable, "-m", "loader_server", "stats", "--endpoint", d.endpoint],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "st" in text and "tokens/s" in text
    client.close()


def test_state_dict_checks_job_world_and_version(daemons):
    d = daemons()
    c = LoaderClient(d.endpoint, job="a", rank=0, world_size=2)
    state = c.state_dict()
    other = LoaderClient(d.endpoint, job="b", rank=0, world_size=2)
    with pytest.raises(ValueError, match="job='a'"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        c.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="world_size=4"):
        LoaderClient(d.endpoint, job="a", rank=0, world_size=4).load_state_dict(
            {**state, "world_size": 2}
        )


# --- the shared-memory counters -----------------------------------------------------------


def test_one_slot_ring_wakes_both_sides_every_batch(daemons, corpus):
    """With one slot, every batch needs both wake-ups: the daemon waits for each release
    and the client for each batch. A lost client wake-up would stall until a heartbeat
    (5 s here), so no next() may take seconds; and delivery stays exact."""
    d = daemons("--slots", "1")
    client = LoaderClient(
        d.endpoint, job="w", rank=0, world_size=1, epochs=1, heartbeat_s=5.0, dead_after_s=20.0
    )
    got, slowest = [], 0.0
    while True:
        t = time.monotonic()
        try:
            b = next(client)
        except StopIteration:
            break
        slowest = max(slowest, time.monotonic() - t)
        got.append((b.position, b.sample_ids.tolist()))
    assert got == plan_sequence(corpus, 0, range(1))
    assert slowest < 2.5, f"a next() took {slowest:.2f} s: a wake-up was lost"


def test_garbage_in_a_control_page_ends_only_that_session(daemons, corpus):
    d = daemons()
    victim = LoaderClient(d.endpoint, job="g", rank=0, world_size=2)
    other = LoaderClient(d.endpoint, job="g", rank=1, world_size=2, epochs=1)
    next(victim)
    next(other)
    ctl = next(p for p in d.shm_dir.iterdir() if p.suffix == ".ctl" and victim._sid in p.name)
    with open(ctl, "r+b") as f:
        f.seek(R.CONSUMED)
        f.write((10**12).to_bytes(8, "little"))  # consumed far past anything produced
    deadline = time.monotonic() + 10
    while "consumed counter" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)  # the daemon reads counters at least every 20 ms
    with pytest.raises(LoaderRequestError, match="consumed counter 1000000000000 outside"):
        for _ in range(10):  # batches already in the ring are still delivered
            next(victim)
    assert len(consume(other)) + 1 == len(plan_sequence(corpus, 1, range(1), world_size=2))


def test_client_gets_a_ready_batch_while_the_next_epoch_is_still_planned(
    corpus, tmp_path, shm_dir, monkeypatch
):
    """A waiting client asks to be woken for two batches. When the daemon cannot make the
    second (epoch 1's plan takes 3 s here), it must still wake the client for the first.
    The server runs in this process so that planning and filling can be slowed down."""
    import loader_server.service.plans as plans
    from loader_server.data.dataset import ArrowDataset
    from loader_server.service.config import DaemonConfig
    from loader_server.service.server import LoaderServer

    real_plan, real_fill = plans.plan_epoch, ArrowDataset.fill

    def slow_plan(lengths, spec, *, epoch):
        if epoch >= 1:
            time.sleep(3.0)
        return real_plan(lengths, spec, epoch=epoch)

    def slow_fill(self, *args, **kwargs):
        time.sleep(0.2)  # the client is asleep on the bell before the batch is published
        return real_fill(self, *args, **kwargs)

    monkeypatch.setattr(plans, "plan_epoch", slow_plan)
    monkeypatch.setattr(ArrowDataset, "fill", slow_fill)
    endpoint = f"ipc://{tmp_path}/inproc.sock"
    server = LoaderServer(corpus, DaemonConfig(endpoint=endpoint, shm_dir=shm_dir))
    server.bind()
    stop = threading.Event()
    loop = threading.Thread(target=server.serve_forever, args=(stop.is_set,))
    loop.start()
    try:
        steps = expected_plan(corpus, 0).num_steps
        client = LoaderClient(endpoint, job="n", rank=0, world_size=1, spec=TEST_SPEC,
                              heartbeat_s=5.0, dead_after_s=20.0)  # fmt: skip
        client.load_state_dict({**client.state_dict(), "position": [0, steps - 1, 0]})
        t = time.monotonic()
        last = next(client)  # the last batch of epoch 0, the only one before epoch 1's plan
        assert last.position == (0, steps - 1, 0)
        assert time.monotonic() - t < 1.5, "a ready batch waited for the next epoch's plan"
        client.close()
    finally:
        stop.set()
        loop.join(10)
        server.shutdown()
