"""A slot's batch description (``SlotMeta``) on the wire: the words it occupies in a ring's
header, written by the daemon's ring and read by the client's."""

from __future__ import annotations

import numpy as np
import pytest

from client.ring import Ring
from loader_server.service.rings import ShmRing
from loader_server.wire import protocol as P
from loader_server.wire import ring as R

SLOTS = 4
#: The header's per-slot words as daemon and client both laid them out before SlotMeta:
#: word k of slot s is the int64 at META + s * META_STRIDE + 8 * k.
LAYOUT_BEFORE = (
    "n",
    "epoch",
    "step",
    "micro",
    "next_epoch",
    "next_step",
    "next_micro",
    "steps",
    "bucket",
    "rows",
    "width",
    "tokens",
    "maxlen",
)


def sample(n: int) -> R.SlotMeta:
    """Batch ``n``'s description, with every other word unlike any other one's."""
    return R.SlotMeta(n, *(1000 * n + k for k in range(1, len(R.META_FIELDS))))


def words(header: bytes | bytearray, slot: int) -> list[int]:
    """Slot ``slot``'s words read the way both sides read them before SlotMeta (numpy)."""
    meta = np.frombuffer(header, np.uint8)[R.META : R.META + SLOTS * R.META_STRIDE]
    return meta.view(np.int64).reshape(SLOTS, R.META_STRIDE // 8)[slot].tolist()


def test_the_fields_and_their_words_are_the_layout_on_the_wire():
    assert R.META_FIELDS == R.SlotMeta._fields == LAYOUT_BEFORE
    assert len(R.META_FIELDS) * 8 <= R.META_STRIDE  # a slot's words stay in its stride
    assert [R.meta_offset(s) for s in range(SLOTS)] == [128, 256, 384, 512]


def test_round_trip_through_header_bytes_touches_only_its_slot():
    header = bytearray(R.header_bytes(SLOTS))
    for slot in (2, 0):
        sample(slot).pack_into(header, slot)
    for slot in range(SLOTS):
        expected = sample(slot) if slot in (0, 2) else R.SlotMeta._make([0] * 13)
        assert R.SlotMeta.unpack_from(header, slot) == expected
        assert words(header, slot) == [*expected, 0, 0, 0]  # the stride's spare words: 0
    assert not any(header[: R.META])  # the counters are left alone


@pytest.mark.parametrize("value", [-(2**63), -1, 2**31, 2**63 - 1])
def test_each_field_is_a_full_int64_word(value):
    header = bytearray(R.header_bytes(SLOTS))
    for k, name in enumerate(R.META_FIELDS):
        meta = R.SlotMeta._make([0] * 13)._replace(**{name: value})
        meta.pack_into(header, 1)
        assert words(header, 1)[k] == value
        assert R.SlotMeta.unpack_from(header, 1) == meta


def test_positions_are_the_fields_they_name():
    meta = sample(3)
    assert meta.position == (meta.epoch, meta.step, meta.micro) == (3001, 3002, 3003)
    assert meta.next_position == (meta.next_epoch, meta.next_step, meta.next_micro)


@pytest.fixture
def rings(tmp_path):
    """The daemon's ring for a session and the client's mapping of it, in ``tmp_path``."""
    instance, sid = "0123abcd", "0123456789ab"
    path = tmp_path / R.ring_name(12345, instance, sid)
    layout = R.SlotLayout.build(tokens=256, docs=8)
    daemon = ShmRing(path, layout, SLOTS)
    welcome = {
        "s": sid,
        "instance": instance,
        "shm": str(path),
        "ctl": f"{path}.ctl",
        "slots": SLOTS,
        "slot_bytes": layout.slot_bytes,
        "layout": layout.to_wire(),
    }
    client = Ring(str(tmp_path), welcome)
    yield daemon, client
    client.close()
    daemon.close()


def test_what_the_daemon_publishes_the_client_reads(rings, tmp_path):
    daemon, client = rings
    for n in range(SLOTS + 2):  # round the ring: batch n lands in slot n % SLOTS
        daemon.publish(sample(n))
        assert client.produced() == n + 1
        assert client.meta(n % SLOTS) == sample(n)
    header = (tmp_path / daemon.path.name).read_bytes()[: R.header_bytes(SLOTS)]
    assert words(header, 1) == [*sample(SLOTS + 1), 0, 0, 0]


def test_the_client_refuses_a_negative_description(rings):
    daemon, client = rings
    daemon.publish(sample(0)._replace(rows=-1))
    with pytest.raises(P.ProtocolError, match="negative"):
        client.meta(0)
