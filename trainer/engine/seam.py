"""The seam between the generic states stream and what varies: *which engine* computes the
target's hidden states (``Engine``: vLLM today, ``trainer.engine.vllm``) and *how they
travel* from it to a trainer rank (``Transport``: a shared-memory arena on one machine,
``trainer.engine.shm``; one file per document, ``trainer.engine.files``; a Mooncake store
across machines, ``trainer.engine.mooncake``). Both are registries keyed by name, as the
run's options name them; the generic part (``client``, ``feed``, ``states``, ``target``,
``supply``) asks them and never branches on a name.

A request's life, as the generic client drives it:

1. ``Transport.reserve(req_id, nbytes)``: what the engine's connector needs to know to put
   this request's states where this rank will find them (an arena region, nothing for a
   file, a key for a store), sent with the request (``Engine.request``);
2. the engine answers once it has computed the prefill; ``Engine.placed(reply)`` is what
   its connector says it wrote, and ``Transport.locate`` checks that it is this request's
   own place (never another request's, run's or program's);
3. ``Transport.fetch`` waits, bounded, until the writer is done and returns the file's
   tensors (``hidden_states [T, n, H]``, ``token_ids [T]``), or raises ``Lost`` when the
   writer died before finishing (the request is asked again);
4. the trainer uses the states (the feed assembles them into the batch's features), then
   ``Transport.release`` gives the place back (an arena region reused, a key removed).

What a run created is named after its requests (``dflash-RUN-INC-rRANK-N``), so each
transport can remove what this run left at an earlier start (``sweep``) and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

#: The longest pause between two looks at a writer's lock: how late, at most, a reader
#: learns that its states are written (a lock has no timed wait to block on instead).
POLL_S = 0.002


def pause(k: int) -> float:
    """The ``k``-th pause of a poll (from 0): 0.2 ms, doubling up to ``POLL_S`` (a writer
    usually finishes within milliseconds), then ``POLL_S`` however long the wait."""
    return POLL_S if k >= 4 else min(0.0002 * (1 << k), POLL_S)


class Lost(Exception):
    """The writer of a request's states died before finishing: ask for them again."""


@dataclass
class Attempt:
    """One try at a document's states, as a transport waits for them: which document (for
    messages), until when, whether the client is closing, and where to say what it is
    doing (a stuck request is named by its stage)."""

    what: str
    deadline: float
    closing: Callable[[], bool]  # the client is closing: do not start what can wait
    stage: Callable[[str], None]
    #: the client is closing and its grace is over: stop waiting even for a writer that is
    #: about to finish (a file written after the client left would stay behind)
    grace_over: Callable[[], bool] = lambda: False
    #: the server stopped answering (a transport with no lock to tell a dead writer by
    #: asks this now and then)
    gone: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class ServedModel:
    """What the engine says it serves: its request name, its model folder or name, and its
    context length (None: not said)."""

    name: str
    root: str
    max_model_len: int | None


@dataclass(frozen=True)
class Layers:
    """How the engine numbers the run's feature layers: the ids it is asked for (its order,
    unique), which of them each of ours is (``columns``), and which of ours it gives before
    the target's final norm (the trainer applies it)."""

    engine_ids: list[int]
    columns: list[int]
    prenorm: list[int]


class OwnedServer(Protocol):
    """A server the run started: where it listens, and why it ended (None: it runs)."""

    url: str
    pid: int

    def ended(self) -> str | None: ...


class Engine(Protocol):
    """Which engine computes the states: its numbering of layers, the server it runs (the
    flags a user's server needs, and one the run starts), and its HTTP exchange."""

    name: str

    def layers(self, ours: Sequence[int], num_layers: int) -> Layers: ...

    def server_flags(self, engine_ids: list[int], connector: dict[str, Any]) -> list[str]: ...

    def serve_command(
        self, target: Path, engine_ids: list[int], connector: dict[str, Any], *, port: int,
        tensor_parallel_size: int, max_model_len: int | None, env: dict[str, str] | None = None,
    ) -> str: ...  # fmt: skip

    def start(
        self, python: str, target: Path, engine_ids: list[int], log: Path, *,
        connector: dict[str, Any], max_model_len: int, env: dict[str, str] | None = None,
    ) -> AbstractContextManager[OwnedServer]: ...  # fmt: skip

    def models_path(self) -> str: ...

    def served_model(self, reply: Any) -> ServedModel: ...

    def request(
        self, model: str, tokens: list[int], req_id: str, params: dict[str, Any]
    ) -> tuple[str, dict[str, Any], dict[str, str]]: ...

    def placed(self, reply: Any) -> dict[str, Any] | None: ...


class Transport(Protocol):
    """How states travel from the engine's connector to one trainer rank.

    A document's ``place`` is made when it is submitted (in the order the feed will use
    the documents: a transport with bounded room gives it out in that order, so the
    document the trainer waits for is never starved by younger ones); each try at it is
    a request whose ``handle`` is what the connector says it wrote."""

    name: str

    def connector(self) -> dict[str, Any]:
        """The connector's settings on the server (``kv_connector_extra_config``)."""
        ...

    def place(self, nbytes: int) -> Any:
        """A place for a document of at most ``nbytes`` bytes (tensors and header), in
        submission order; not yet room."""
        ...

    def ready(self, place: Any, attempt: Attempt) -> None:
        """Wait, bounded, until ``place`` has room."""
        ...

    def params(self, place: Any, req_id: str) -> dict[str, Any]:
        """What the engine's connector needs to put request ``req_id``'s states there."""
        ...

    def locate(self, place: Any, placed: dict[str, Any], req_id: str, url: str, what: str) -> Any:
        """The request's own handle, from what the connector says it wrote; EngineError if
        it is not this request's place."""
        ...

    def fetch(self, place: Any, handle: Any, attempt: Attempt) -> dict[str, torch.Tensor]:
        """The request's tensors once written (``Lost`` if never), waited for until
        ``attempt.deadline``; they may be views of the transport's memory, valid until
        ``release``."""
        ...

    def discard(self, place: Any, handle: Any) -> None:
        """Remove what a failed request may have left (its place is kept for the next)."""
        ...

    def release(self, place: Any, handle: Any) -> None:
        """The document's place given back once its states were used (or given up)."""
        ...

    def sweep(self) -> None:
        """Remove what this run left at its earlier starts (never anything else)."""
        ...

    def health(self) -> str | None:
        """None, or what of the transport itself does not answer (a store's master): said
        first when a request runs out of time."""
        ...

    def close(self) -> None:
        """Remove what this start of this rank still holds."""
        ...


#: Engines by ``--target-engine`` name: the module and class of each adapter (imported
#: when chosen: an engine's code never loads for a run that does not use it).
ENGINES = {"vllm": ("trainer.engine.vllm", "VllmAdapter")}
#: Transports by ``--states-transport`` name.
TRANSPORTS = {
    "shm": ("trainer.engine.shm", "ShmTransport"),
    "files": ("trainer.engine.files", "FileTransport"),
    "mooncake": ("trainer.engine.mooncake", "MooncakeTransport"),
}


def _load(table: dict[str, tuple[str, str]], name: str, what: str) -> Any:
    import importlib

    if name not in table:
        raise ValueError(f"unknown {what} {name!r}: one of {', '.join(table)}")
    module, attr = table[name]
    return getattr(importlib.import_module(module), attr)


def engine(name: str) -> Engine:
    return _load(ENGINES, name, "engine")()


def transport_class(name: str) -> Any:
    return _load(TRANSPORTS, name, "states transport")


def request_prefix(run: str, rank: int) -> str:
    """The request id prefix of one rank of one start of a run (``run``: ``RUN-INC``)."""
    return f"dflash-{run}-r{rank}"
