"""Why the daemon refuses a request, as exception types, and the wire code of each.

A handler raises; the dispatcher answers ``error`` with ``error_code(e)``: the code of the
nearest class in the exception's MRO found in ``ERROR_CODES``. Anything not in the table is
a bug of the daemon (``internal``), never a reason to stop serving.
"""

from __future__ import annotations

from typing import Any

from loader_server.planning.elastic import ChainMismatch
from loader_server.service.opening import SpecMismatch
from loader_server.service.rings import ShmSpaceError
from loader_server.wire import protocol as P


class UnknownSession(P.ProtocolError):
    """A message names a session this daemon does not hold."""

    def __init__(self, sid: Any) -> None:
        super().__init__(f"unknown session {sid!r} (the daemon restarted or expired it)")


class RankBusy(Exception):
    """Another live client reads the (job, rank) an ``open`` asks for."""


class CorpusChanged(Exception):
    """The corpus changed under the daemon: nothing is served until it is reloaded."""


#: Exception type -> the ``code`` of the ``error`` reply it earns.
ERROR_CODES: dict[type[BaseException], str] = {
    P.MalformedError: P.E_MALFORMED,
    P.VersionError: P.E_VERSION,
    UnknownSession: P.E_UNKNOWN_SESSION,
    ShmSpaceError: P.E_NO_SPACE,
    SpecMismatch: P.E_MISMATCH,
    ChainMismatch: P.E_MISMATCH,
    RankBusy: P.E_BUSY,
    CorpusChanged: P.E_CORPUS,
    P.ProtocolError: P.E_BAD_REQUEST,
    ValueError: P.E_BAD_REQUEST,
}
#: Codes whose reply names the session the request gave (``s``): its client is told about
#: that session, and woken if it sleeps on the session's ring.
SESSION_CODES = frozenset({P.E_UNKNOWN_SESSION, P.E_BAD_REQUEST})


def error_code(error: BaseException) -> str:
    """The wire code for ``error``: its most specific class in ``ERROR_CODES``, else
    ``internal``."""
    for cls in type(error).__mro__:
        code = ERROR_CODES.get(cls)
        if code is not None:
            return code
    return P.E_INTERNAL
