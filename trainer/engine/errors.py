"""``EngineError``: what stops a run fed by an engine (one line for the user)."""

from __future__ import annotations

from loader_server.wire.protocol import LoaderError


class EngineError(LoaderError):
    """The engine stayed away past its timeout, refused a document, is not the engine the
    run expects, or returned states that cannot be the document's. A ``LoaderError``: the
    run stops after a final checkpoint, and ``--resume`` continues where it stopped.
    ``fix`` is what the training loop's last line says to do (``train.loader_failure``
    reads it; the training room never imports this one)."""

    fix = "bring the vLLM server back (or fix what it refused)"

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        if fix is not None:
            self.fix = fix


def unwritten(what: str, req_id: str, why: str | None) -> None:
    """``EngineError`` naming why, when the server's connector said it could not write
    ``req_id``'s document (``why``: the reason its region or value holds; None: it did
    not say, and nothing is raised)."""
    if why is not None:
        raise EngineError(
            f"the server's connector could not write {what}'s states ({req_id}): {why}"
        )
