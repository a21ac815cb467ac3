"""Which ``error`` code each refusal earns: the exception's type decides, through one table."""

from __future__ import annotations

import msgpack
import pytest

from loader_server.service.errors import (
    ERROR_CODES,
    SESSION_CODES,
    CorpusChanged,
    RankBusy,
    UnknownSession,
    error_code,
)
from loader_server.service.opening import SpecMismatch
from loader_server.service.rings import ControlPageError, ShmSpaceError
from loader_server.wire import protocol as P

WIRE_CODES = {v for k, v in vars(P).items() if k.startswith("E_")}


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (P.MalformedError("x"), P.E_MALFORMED),
        (P.VersionError("x"), P.E_VERSION),
        (UnknownSession("abc"), P.E_UNKNOWN_SESSION),
        (ShmSpaceError("x"), P.E_NO_SPACE),
        (SpecMismatch("x"), P.E_MISMATCH),
        (RankBusy("x"), P.E_BUSY),
        (CorpusChanged("x"), P.E_CORPUS),
        (P.ProtocolError("x"), P.E_BAD_REQUEST),
        (ValueError("x"), P.E_BAD_REQUEST),
        (KeyError("x"), P.E_INTERNAL),
        (RuntimeError("x"), P.E_INTERNAL),
    ],
)
def test_each_error_type_has_its_code(error, code):
    assert error_code(error) == code


def test_the_most_specific_class_wins():
    # UnknownSession is a ProtocolError, ShmSpaceError a ValueError: their own codes win.
    assert isinstance(UnknownSession("s"), P.ProtocolError)
    assert isinstance(ShmSpaceError("x"), ValueError)

    class JobMismatch(SpecMismatch):
        pass

    assert error_code(JobMismatch("x")) == P.E_MISMATCH
    # A ValueError subclass the table does not name is still the request's fault.
    assert error_code(ControlPageError("truncated")) == P.E_BAD_REQUEST


def test_the_table_speaks_only_wire_codes():
    assert set(ERROR_CODES.values()) <= WIRE_CODES
    assert SESSION_CODES <= WIRE_CODES


def test_decode_raises_a_version_error_for_another_protocol_version():
    frame = msgpack.packb({"v": P.PROTOCOL_VERSION + 1, "t": "ping"})
    with pytest.raises(P.VersionError, match="protocol version") as info:
        P.decode(frame)
    assert error_code(info.value) == P.E_VERSION


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"v": P.PROTOCOL_VERSION}),  # no type
        b"\x00" * (P.MAX_MESSAGE_BYTES + 1),  # too big
    ],
)
def test_decode_raises_a_malformed_error_for_what_is_not_a_message(frame):
    with pytest.raises(P.MalformedError) as info:
        P.decode(frame)
    assert error_code(info.value) == P.E_MALFORMED


def test_typed_decode_errors_are_still_protocol_errors():
    # Clients catch ProtocolError; the subclasses must not escape them.
    assert issubclass(P.VersionError, P.ProtocolError)
    assert issubclass(P.MalformedError, P.ProtocolError)
