"""LoaderClient against a real daemon: every rank receives exactly its plan, resume is bit
exact, packed layout, state-dict checks, and the client's import cost."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import (
    TEST_SPEC,
    check_batch_tokens,
    consume,
    expected_plan,
    plan_sequence,
    seq_of,
)

from client import LoaderClient

pytestmark = pytest.mark.integration


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


def test_client_imports_neither_pyarrow_nor_the_daemon_beyond_the_wire():
    code = (
        "import sys, client; from client import LoaderClient, Batch; "
        "bad = [m for m in sys.modules if m.startswith('pyarrow') or m.startswith("
        "'loader_server.') and not m.startswith('loader_server.wire')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_state_dict_checks_job_world_and_version(daemons):
    d = daemons()
    c = LoaderClient(d.endpoint, job="a", rank=0, world_size=2)
    state = c.state_dict()
    other = LoaderClient(d.endpoint, job="b", rank=0, world_size=2)
    with pytest.raises(ValueError, match="job='a'"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        c.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="rank=1"):  # same shape: this rank's own state
        LoaderClient(d.endpoint, job="a", rank=1, world_size=2).load_state_dict(state)
    # Another world size resumes only with the spec the position was saved under.
    with pytest.raises(ValueError, match="world_size 2 was saved without its spec"):
        LoaderClient(d.endpoint, job="a", rank=0, world_size=4).load_state_dict(state)


def test_client_gets_a_ready_batch_while_the_next_epoch_is_still_planned(
    corpus, tmp_path, shm_dir, monkeypatch
):
    """A waiting client asks to be woken for two batches. When the daemon cannot make the
    second (epoch 1's plan is held back here until the test lets it finish), it must still
    wake the client for the first: the batch arrives while that plan is still in progress.
    The server runs in this process so that planning and filling can be slowed down.

    The daemon only submits epoch 1's plan to a planner thread before it fills the last
    batch of epoch 0; when that thread starts is up to the OS scheduler. So the fill waits
    for the plan to be under way (as well as for the client to be asleep), rather than
    assuming the planner thread got there first."""
    import loader_server.service.plans as plans
    from client.ring import Ring
    from loader_server.data.dataset import ArrowDataset
    from loader_server.service.config import DaemonConfig
    from loader_server.service.server import LoaderServer

    real_plan, real_fill, real_wait = plans.plan_rest, ArrowDataset.fill, Ring.wait
    planning, finish, asleep = threading.Event(), threading.Event(), threading.Event()

    def slow_plan(lengths, spec, *, epoch, **rest):
        if epoch >= 1:
            planning.set()
            finish.wait(60)
        return real_plan(lengths, spec, epoch=epoch, **rest)

    def waiting(self, bell, timeout_s):
        asleep.set()
        return real_wait(self, bell, timeout_s)

    def slow_fill(self, *args, **kwargs):
        asleep.wait(30)  # the client is asleep on the bell before the batch is published
        planning.wait(30)  # and epoch 1's plan (asked for before this fill) is being made
        return real_fill(self, *args, **kwargs)

    monkeypatch.setattr(plans, "plan_rest", slow_plan)
    monkeypatch.setattr(ArrowDataset, "fill", slow_fill)
    monkeypatch.setattr(Ring, "wait", waiting)
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
        last = next(client)  # the last batch of epoch 0, the only one before epoch 1's plan
        assert last.position == (0, steps - 1, 0)
        assert asleep.is_set(), "the client never waited on the bell"
        assert planning.is_set(), "epoch 1's plan was not asked for before the batch was filled"
        assert not finish.is_set(), "the batch came after epoch 1's plan"
        client.close()
    finally:
        finish.set()
        stop.set()
        loop.join(10)
        server.shutdown()
