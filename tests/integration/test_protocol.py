"""The control protocol from raw sockets: bad messages get error replies, abuse of one
session does not disturb others, the stats command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
import zmq
from conftest import (
    consume,
    plan_sequence,
    seq_of,
)

from client import LoaderClient
from loader_server.wire import protocol as P

pytestmark = pytest.mark.integration


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
        ([_open_msg(spec={"tokne_budget": 10})], P.E_BAD_REQUEST, "did you mean 'token_budget'?"),
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
    # A bad field is the client's own error now, before it asks the daemon (the daemon's
    # refusal of the same in a raw open: test_bad_messages_get_error_replies).
    with pytest.raises(ValueError, match="token_budget must be"):
        LoaderClient(d.endpoint, job="z", rank=0, world_size=1, spec={"token_budget": 0})
    with pytest.raises(ValueError, match="spec world_size 3"):
        LoaderClient(d.endpoint, job="z", rank=0, world_size=1, spec={"world_size": 3})


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
