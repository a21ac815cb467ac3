"""Elastic resumes against the real daemon: a job's epoch served under world sizes 4, 2 and
3 (and another grad_accum) gives every sample exactly once, the rest of an epoch is the
same on a second daemon that never saw the first shape, and bad chains are refused."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TEST_SPEC, check_batch_tokens

from client import LoaderClient
from loader_server.planning.elastic import consumed, plan_rest
from loader_server.wire.protocol import Leg, LoaderRequestError
from loader_server.wire.spec import BatchSpec

pytestmark = pytest.mark.integration


def _ranks(endpoints, world, state=None, *, grad_accum=1, job="el", epochs=1, only=None):
    """One client per rank (``only``: these ranks), rank r on ``endpoints[r % len]``."""
    out = []
    for r in range(world) if only is None else only:
        c = LoaderClient(
            endpoints[r % len(endpoints)], job=job, rank=r, world_size=world,
            spec={"grad_accum": grad_accum}, epochs=epochs, timeout_s=30,
        )  # fmt: skip
        if state is not None:
            c.load_state_dict(state)
        out.append(c)
    return out


def _steps(clients, steps, grad_accum, corpus=None):
    """Consume ``steps`` optimizer steps (all if None) on every rank; the sample ids."""
    got, done = [], 0
    while steps is None or done < steps:
        try:
            for c in clients:
                for _ in range(grad_accum):
                    b = next(c)
                    if corpus is not None and done == 0:
                        check_batch_tokens(corpus, b)
                    got += b.sample_ids.tolist()
        except StopIteration:
            break
        done += 1
    return got


def test_an_epoch_resized_4_2_3_serves_every_sample_exactly_once(daemons, corpus):
    d = daemons()
    four = _ranks([d.endpoint], 4)
    first = _steps(four, 5, 1, corpus)
    state = four[0].state_dict()
    assert state["position"] == [0, 5, 0] and state["legs"] == []
    assert all(c.state_dict()["position"] == state["position"] for c in four)
    for c in four:
        c.close()

    two = _ranks([d.endpoint], 2, state)
    assert two[0].resized.startswith("world_size 4 x grad_accum 1 -> 2 x 1 at epoch 0 step 5")
    second = _steps(two, 7, 1, corpus)
    state2 = two[1].state_dict()  # any rank's: one position at a step boundary
    assert state2["legs"] == [[4, 1, 5]] and state2["position"] == [0, 7, 0]
    for c in two:
        c.close()

    three = _ranks([d.endpoint], 3, state2, grad_accum=2)
    next(three[0])
    # The operator sees it: `dflash-loader stats` lists the session's shape changes.
    from loader_server.cli.service import _request_stats, format_stats

    st = _request_stats(d.endpoint, 5.0)
    mine = [x for x in st["sessions"] if x["rank"] == 0 and x["world_size"] == 3]
    assert mine and mine[0]["legs"] == [[4, 1, 5], [2, 1, 7]]
    assert "rest of the epoch after 2 shape change(s)" in format_stats(st)
    three[0].load_state_dict({**state2, "rank": 0})  # back to where it began (nothing lost)
    third = _steps(three, None, 2, corpus)  # to the end of the epoch
    assert all(c.legs == () for c in three)

    got = np.array(first + second + third)
    ids, counts = np.unique(got, return_counts=True)
    assert counts.max() == 1  # nothing twice
    # The same three plans, computed here from the pure function: the daemon served them.
    base = BatchSpec(**TEST_SPEC)
    s4, s2, s3 = (BatchSpec(**TEST_SPEC, world_size=w, grad_accum=g) for w, g in
                  ((4, 1), (2, 1), (3, 2)))  # fmt: skip
    p4 = plan_rest(corpus.lengths, s4, epoch=0)
    p2 = plan_rest(corpus.lengths, s2, epoch=0, legs=[Leg(4, 1, 5)])
    p3 = plan_rest(corpus.lengths, s3, epoch=0, legs=[Leg(4, 1, 5), Leg(2, 1, 7)])
    want = np.concatenate([consumed(p4, 5), consumed(p2, 7), p3.sample_ids])
    assert np.array_equal(np.sort(want), ids)
    missing = np.setdiff1d(np.flatnonzero(corpus.lengths > 0), ids)
    assert missing.size == p3.stats["dropped_leftover"]  # only the last leg's leftover
    assert base.max_seq_len == s3.max_seq_len


def test_growing_in_the_epoch_s_last_step_serves_the_rest_as_one_short_step(daemons, corpus):
    """One rank trains to the epoch's last step; the job then grows to 8 ranks x 2, whose
    step the rest cannot fill: it is served as one short step (some micro-batches empty),
    every sample once, and the next epoch is a plain plan of the new shape."""
    d = daemons()
    (one,) = _ranks([d.endpoint], 1, epochs=2)
    plan1 = plan_rest(corpus.lengths, BatchSpec(**TEST_SPEC), epoch=0)
    first = _steps([one], plan1.num_steps - 1, 1)
    state = one.state_dict()
    one.close()
    eight = _ranks([d.endpoint], 8, state, grad_accum=2, epochs=2)
    batches = [[next(c) for _ in range(2)] for c in eight]  # the short step, every rank
    assert all(b.step == 0 and b.epoch == 0 and b.steps_per_epoch == 1 for r in batches for b in r)
    rows = [int(b.sample_ids.numel()) for r in batches for b in r]
    assert 0 in rows, rows  # the rest holds fewer samples than 16 micro-batches
    for r in batches:
        for b in r:
            packed = b.layout == "packed"  # [1, T]: one row of documents end to end
            want = (
                (1, int(b.lengths.sum()))
                if packed
                else (b.sample_ids.numel(), b.input_ids.shape[1])
            )
            assert tuple(b.input_ids.shape) == want
            if b.sample_ids.numel():
                check_batch_tokens(corpus, b)
    second = [i for r in batches for b in r for i in b.sample_ids.tolist()]
    got = np.array(first + second)
    assert np.unique(got).size == got.size  # nothing twice
    servable = np.flatnonzero(corpus.lengths > 0)
    assert np.array_equal(np.sort(got), servable)  # nothing left out: no leftover this time
    nxt = next(eight[0])
    assert (nxt.epoch, nxt.step) == (1, 0) and all(c.legs == () for c in eight[:1])
    for c in eight:
        c.close()


def test_a_second_daemon_serves_the_same_rest_of_the_epoch(daemons, corpus):
    """Two "nodes": after 4 -> 2 on daemon A, daemon B (started cold, it never served the
    4-rank plan) serves rank 1 of the rest; together with A's rank 0 it is one plan."""
    a = daemons(name="node-a")
    four = _ranks([a.endpoint], 4)
    _steps(four, 3, 1)
    state = four[0].state_dict()
    for c in four:
        c.close()
    b = daemons(name="node-b")
    two = _ranks([a.endpoint, b.endpoint], 2, state)
    got = [[], []]
    for _ in range(4):
        for r, c in enumerate(two):
            got[r] += next(c).sample_ids.tolist()
    p2 = plan_rest(corpus.lengths, BatchSpec(**TEST_SPEC, world_size=2), epoch=0,
                   legs=[Leg(4, 1, 3)])  # fmt: skip
    for r in range(2):
        assert got[r] == np.concatenate([p2.micro(s, r, 0) for s in range(4)]).tolist()


def test_bad_chains_and_resizes_are_refused_and_name_the_value(daemons, corpus):
    d = daemons()
    one = _ranks([d.endpoint], 2)
    _steps(one, 2, 1)
    state = one[0].state_dict()
    for c in one:
        c.close()
    # A chain claiming more steps than the 4-rank plan has on this corpus.
    bad = {**state, "legs": [[4, 1, 10**6]], "world_size": 2}
    c = _ranks([d.endpoint], 2, bad, only=[0])[0]
    with pytest.raises(LoaderRequestError, match=r"ran 1000000 steps under world_size 4"):
        next(c)
    # Inside a step (micro 1 of 2): a shape change needs a step boundary.
    c2 = LoaderClient(d.endpoint, job="el", rank=0, world_size=2, spec={"grad_accum": 2})
    inside = {**state, "position": [0, 2, 1], "spec": {**state["spec"], "grad_accum": 2}}
    with pytest.raises(ValueError, match=r"inside step 2 \(micro-batch 1 of 2\)"):
        _ranks([d.endpoint], 4, inside, only=[0])
    c2.close()
    # Another shape is fine, another token budget is not: refused naming the field.
    other = LoaderClient(d.endpoint, job="el", rank=0, world_size=4,
                         spec={"token_budget": 8192}, timeout_s=30)  # fmt: skip
    other.load_state_dict(state)
    with pytest.raises(LoaderRequestError, match=r"'token_budget': \(4096, 8192\)"):
        next(other)
    # Another job's position.
    with pytest.raises(ValueError, match="job='el'"):
        _ranks([d.endpoint], 4, state, job="other", only=[0])
    # So many ranks that the rest of the epoch cannot fill one step: not refused, served
    # as one short last step (a job growing at an epoch's end).
    plan = plan_rest(corpus.lengths, BatchSpec(**TEST_SPEC, world_size=2), epoch=0)
    late = {**state, "position": [0, plan.num_steps - 1, 0]}
    big = _ranks([d.endpoint], 64, late, only=[0])[0]
    first = next(big)
    assert (first.epoch, first.step, first.steps_per_epoch) == (0, 0, 1)
    big.close()
    # Nothing of this changed what the daemon serves the job at its real position.
    ok = _ranks([d.endpoint], 2, state, only=[0])[0]
    assert next(ok).position == (0, 2, 0)


def test_a_client_refuses_a_daemon_that_did_not_plan_its_rest(tmp_path):
    """A daemon from before elastic resumes ignores ``legs`` and would serve the epoch from
    its start (the served steps again): its welcome, which does not echo the legs, is
    refused. The stand-in answers as such a daemon did: welcome without legs."""
    import threading

    import zmq

    from loader_server.wire import protocol as P

    spec = BatchSpec(**TEST_SPEC, world_size=2).to_dict()
    state = {"version": 3, "job": "old", "rank": 0, "world_size": 4, "position": [0, 5, 0],
             "legs": [], "fingerprint": "f" * 16, "spec": {**spec, "world_size": 4}}  # fmt: skip
    endpoint = f"ipc://{tmp_path}/old.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)
    opened: list[dict] = []

    def old_daemon() -> None:
        if router.poll(20_000):
            peer, frame = router.recv_multipart()
            opened.append(P.decode(frame))
            router.send_multipart([peer, P.encode("welcome", s="abc", steps=9,
                                                  fingerprint="f" * 16, spec=spec)])  # fmt: skip

    t = threading.Thread(target=old_daemon)
    t.start()
    try:
        c = LoaderClient(endpoint, job="old", rank=0, world_size=2, timeout_s=10)
        c.load_state_dict(state)
        with pytest.raises(LoaderRequestError, match="did not plan the rest of epoch 0 after its "
                           r"shape changes \[\[4, 1, 5\]\].*upgrade the daemon"):  # fmt: skip
            next(c)
    finally:
        t.join(30)
        router.close(linger=0)
    assert opened and opened[0]["legs"] == [[4, 1, 5]]
