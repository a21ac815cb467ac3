"""The registry's admission rules, without sockets: a fake client list stands in for
ZeroMQ's answer to "can this peer still be reached?" (ROUTER_MANDATORY)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from conftest import TEST_SPEC

from loader_server.service.config import DaemonConfig
from loader_server.service.errors import RankBusy, UnknownSession
from loader_server.service.opening import Opening, OpenRequest, SpecMismatch
from loader_server.service.registry import Registry
from loader_server.service.rings import ShmSpaceError
from loader_server.wire.spec import BatchSpec

SPEC = BatchSpec(**TEST_SPEC)
SHORTEST = 16  # the corpus's shortest sample, for ring sizes
BIG = 1 << 40  # caps that never bind


class Clients:
    """The peers ZeroMQ can reach (all but ``gone``), and what was sent to them."""

    def __init__(self) -> None:
        self.gone: set[bytes] = set()
        self.sent: list[tuple[bytes, str, dict[str, Any]]] = []

    def __call__(self, peer: bytes, kind: str, **fields: Any) -> bool:
        if peer in self.gone:
            return False
        self.sent.append((peer, kind, fields))
        return True


@pytest.fixture
def clients() -> Clients:
    return Clients()


def make_registry(tmp_path, clients, *, ring=BIG, budget=BIG, **config) -> Registry:
    return Registry(
        DaemonConfig(shm_dir=tmp_path, **config),
        clients,
        instance="0123abcd",
        max_ring_bytes=ring,
        shm_budget_bytes=budget,
    )


@pytest.fixture
def registry(tmp_path, clients) -> Iterator[Registry]:
    reg = make_registry(tmp_path, clients)
    yield reg
    for sid in list(reg.sessions) + list(reg.opening):
        reg.drop(sid, "test over")
    reg.close()


def request(job="j", rank=0, world=2, spec=SPEC) -> OpenRequest:
    spec = BatchSpec.from_dict({**spec.to_dict(), "world_size": world})
    return OpenRequest(job, rank, world, spec, (0, 0, 0), None)


def open_(reg: Registry, peer: bytes, req: OpenRequest) -> Opening:
    """What the dispatcher does with an ``open``, short of planning (its plan never comes)."""
    reg.admit(peer, req)
    sid, need, ring = reg.make_ring(req, SHORTEST)
    op = Opening(sid, peer, req, need, Future(), ring)
    reg.add_opening(op)
    return op


def test_a_job_s_ranks_share_its_world_size_and_spec(registry):
    first = open_(registry, b"a", request(rank=0))
    open_(registry, b"b", request(rank=1))  # the same job, spec and world size
    with pytest.raises(SpecMismatch, match="world_size 2, not 4") as info:
        registry.admit(b"c", request(rank=2, world=4))
    assert f"session {first.sid}" in str(info.value)  # the holders are named
    other = BatchSpec.from_dict({**SPEC.to_dict(), "seed": SPEC.seed + 1})
    with pytest.raises(SpecMismatch, match=r"another spec; differences.*'seed'"):
        registry.admit(b"b", request(rank=1, spec=other))  # its own rank, another spec


def test_a_live_reader_keeps_its_rank(registry, clients):
    op = open_(registry, b"a", request())
    with pytest.raises(RankBusy, match="already being read by a live client"):
        registry.admit(b"b", request())
    assert clients.sent[-1] == (b"a", "hb", {"s": op.sid})  # the liveness probe
    assert registry.by_rank[("j", 0)] == op.sid


def test_a_dead_reader_s_rank_goes_to_its_successor(registry, clients, tmp_path):
    op = open_(registry, b"a", request())
    ring = op.ring.result()
    clients.gone.add(b"a")
    new = open_(registry, b"b", request())
    assert list(registry.opening) == [new.sid]
    assert registry.by_rank[("j", 0)] == new.sid
    assert registry.shm_used == new.nbytes
    assert not ring.path.exists()  # the replaced session's ring is gone


def test_the_same_connection_reopening_its_rank_replaces_its_session(registry):
    op = open_(registry, b"a", request())
    new = open_(registry, b"a", request())
    assert list(registry.opening) == [new.sid] and new.sid != op.sid


def test_a_restarted_job_drops_unreachable_holders_to_change_its_spec(registry, clients):
    open_(registry, b"old0", request(rank=0))
    open_(registry, b"old1", request(rank=1))
    clients.gone.update({b"old0", b"old1"})
    other = BatchSpec.from_dict({**SPEC.to_dict(), "seed": SPEC.seed + 1})
    op = open_(registry, b"new", request(rank=0, spec=other))
    assert list(registry.opening) == [op.sid]
    assert registry.jobs["j"].spec.key() == op.req.spec.key()


def test_a_job_s_spec_may_change_once_its_sessions_are_gone(registry):
    op = open_(registry, b"a", request(world=2))
    registry.drop(op.sid, "closed by client")
    assert registry.jobs == {} and registry.by_rank == {} and registry.shm_used == 0
    open_(registry, b"a", request(world=4))
    assert registry.jobs["j"].world_size == 4


def test_sessions_per_connection_are_capped(tmp_path, clients):
    reg = make_registry(tmp_path, clients, max_sessions_per_peer=2)
    open_(reg, b"a", request(job="x"))
    open_(reg, b"a", request(job="y"))
    with pytest.raises(ValueError, match=r"already has 2 sessions \(max_sessions_per_peer=2\)"):
        reg.admit(b"a", request(job="z"))
    open_(reg, b"b", request(job="z"))  # another connection still may
    for sid in list(reg.opening):
        reg.drop(sid, "test over")
    reg.close()


def test_a_ring_over_the_caps_is_refused_and_its_job_forgotten(tmp_path, clients):
    reg = make_registry(tmp_path, clients, ring=4096)
    reg.admit(b"a", request())
    with pytest.raises(ShmSpaceError, match="over the per-session cap of 4,096 bytes"):
        reg.make_ring(request(), SHORTEST)
    assert reg.jobs == {}
    reg.close()


def test_the_budget_counts_every_ring(tmp_path, clients):
    (tmp_path / "probe").mkdir()
    probe = make_registry(tmp_path / "probe", clients)
    one = open_(probe, b"a", request())
    probe.drop(one.sid, "measured")
    probe.close()
    reg = make_registry(tmp_path, clients, budget=one.nbytes * 3 // 2)
    open_(reg, b"a", request(rank=0))
    with pytest.raises(ShmSpaceError, match=r"are in use by 0 session\(s\)"):
        open_(reg, b"b", request(rank=1))
    assert reg.shm_used == one.nbytes
    for sid in list(reg.opening):
        reg.drop(sid, "test over")
    reg.close()


def test_an_opening_becomes_a_session_that_expires_when_silent(registry, tmp_path):
    op = open_(registry, b"a", request())
    registry.take_opening(op)
    ring = op.ring.result()
    sess = registry.start(op, ring)
    assert registry.session({"s": sess.sid}) is sess
    registry.expire(time.monotonic())
    assert sess.sid in registry.sessions  # it was just heard from
    timeout = DaemonConfig().session_timeout_s
    registry.expire(time.monotonic() + timeout + 1)
    assert registry.sessions == {} and registry.jobs == {} and registry.shm_used == 0
    assert not ring.path.exists()
    with pytest.raises(UnknownSession):
        registry.session({"s": sess.sid})


def test_telling_an_unreachable_client_ends_its_session(registry, clients):
    op = open_(registry, b"a", request())
    registry.take_opening(op)
    sess = registry.start(op, op.ring.result())
    registry.tell(sess, "hb")
    assert clients.sent[-1] == (b"a", "hb", {"s": sess.sid})
    clients.gone.add(b"a")
    registry.tell(sess, "hb")
    assert registry.sessions == {}
