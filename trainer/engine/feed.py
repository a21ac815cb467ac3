"""The loader's micro-batches, read ahead of the plan, their target features requested
from the engine before the step needs them.

Where this lives: in the trainer, around the loader client, not in the daemon. The daemon
knows every rank's next micro-batches, but a feature is a trainer's input, as large as
``tokens x layers x hidden`` (a 4K-token document of Qwen3-8B's 5 layers is 160 MB in
bf16): it belongs next to the GPU that uses it, read from the engine's files by the rank
that needs it, not copied through the daemon's rings. The client already hands over each
batch as the trainer's own memory (``client.batch``), so reading ahead is only holding
batches longer; the daemon, its plan and its exactly-once bookkeeping are unchanged, and
the engine is a dependency of the trainers alone (a URL and a folder), as the target was.

``EngineFeed`` is a ``BatchSource``: at each ``next()`` it takes the oldest micro-batch
read ahead, pulls micro-batches from the loader until ``inflight`` documents are ahead
besides it (one request each, in flight or answered: what the engine computes while it
trains), and yields it once all its documents' states are in, after giving the features
to the ``EngineTarget``. The states held are bounded by that number and one micro-batch's. Its
``state_dict`` is the loader's position after the last micro-batch it *yielded*, not the
last it read: a checkpoint resumes at the next batch to train, and what was read ahead is
read again by the resumed run (the same documents, the same features). A loader error met
while reading ahead is raised when the micro-batch it stands for is asked for; the end of
the plan likewise. The time a step waits for features is ``next()``'s, so the run's
``data_wait_frac`` shows an engine that cannot keep up.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from loader_server.wire.protocol import LoaderError
from trainer.engine.client import StateClient
from trainer.engine.states import assemble
from trainer.model.doc_view import DocView
from trainer.train.batches import Batch, BatchSource

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    """A micro-batch read ahead: the loader's state and shape changes after it, its
    documents' requests."""

    batch: Batch
    state: dict[str, Any]
    legs: Any
    states: list[Future[Any]]


class EngineFeed:
    """``source``'s micro-batches with their features from ``client``, for ``target``
    (an ``EngineTarget``). ``max_ahead``: micro-batches read ahead at most (besides the
    in-flight bound)."""

    def __init__(self, source: BatchSource, target: Any, client: StateClient,
                 max_ahead: int = 16) -> None:  # fmt: skip
        self.source, self.target, self.client = source, target, client
        self.max_ahead = max_ahead
        self._queue: deque[_Ahead] = deque()
        self._ended: BaseException | None = None  # StopIteration or the loader's error
        self._state: dict[str, Any] | None = None  # after the last yielded micro-batch
        self._yielded: _Ahead | None = None  # the last yielded micro-batch
        self._it: Iterator[Batch] | None = None

    # ---- BatchSource -------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int | None:
        """Of the last micro-batch yielded (the loader's may be an epoch further on)."""
        last = self._yielded
        if last is not None and last.batch.steps_per_epoch:
            return int(last.batch.steps_per_epoch)
        return self.source.steps_per_epoch

    @property
    def effective_spec(self) -> dict[str, Any] | None:
        return self.source.effective_spec

    @property
    def legs(self) -> Any:
        """The shape changes as of the last micro-batch yielded."""
        last = self._yielded
        return last.legs if last is not None else getattr(self.source, "legs", ())

    @property
    def spec(self) -> Any:
        return getattr(self.source, "spec", None)

    @spec.setter
    def spec(self, value: Any) -> None:  # resume adjusts the loader client's request
        self.source.spec = value  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:  # endpoint, resized: the loader's
        if name.startswith("_") or name in ("source", "target", "client", "max_ahead"):
            raise AttributeError(name)
        return getattr(self.source, name)

    def state_dict(self) -> dict[str, Any]:
        return self._state if self._state is not None else self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop_ahead()
        self.source.load_state_dict(state)
        self._state, self._yielded = None, None

    def close(self) -> None:
        self._drop_ahead()
        self.client.close()
        self.source.close()

    def __iter__(self) -> Iterator[Batch]:
        self._it = iter(self.source)
        while True:
            self._read_ahead()
            if not self._queue:
                ended, self._ended = self._ended, None
                if ended is None or isinstance(ended, StopIteration):
                    return
                raise ended
            item = self._queue.popleft()
            self._read_ahead()  # what the engine computes while this micro-batch trains
            states = [self.client.result(f) for f in item.states]  # EngineError: it stops
            self.target.hold(item.batch, assemble(item.batch, states, self.target.columns,
                                                  self.target.dtype))  # fmt: skip
            del states  # they may lie in the transport's memory: given back now
            for f in item.states:
                self.client.release(f)
            self._state, self._yielded = item.state, item
            yield item.batch

    # ---- reading ahead -----------------------------------------------------------------

    def _ahead(self) -> int:
        """Documents read ahead: asked for, or answered and waiting for their step."""
        return sum(len(item.states) for item in self._queue)

    def _read_ahead(self) -> None:
        """Read micro-batches until ``inflight`` documents are ahead (in flight or held:
        the host memory the states take is bounded by it too), ``max_ahead`` micro-batches
        wait, or the loader ended (kept until it is reached); at least one."""
        assert self._it is not None
        while (
            self._ended is None
            and len(self._queue) < self.max_ahead
            and (not self._queue or self._ahead() < self.client.inflight)
        ):
            try:
                batch = next(self._it)
            except (StopIteration, LoaderError) as e:
                self._ended = e
                break
            legs = getattr(self.source, "legs", ())
            self._queue.append(_Ahead(batch, self.source.state_dict(), legs, self._request(batch)))

    def _request(self, batch: Batch) -> list[Future[Any]]:
        docs = DocView.of(batch)
        where = f"epoch {batch.epoch} step {batch.step} micro {batch.micro}"
        out = []
        for k in range(len(docs)):
            r, a, n = int(docs.row[k]), int(docs.start[k]), int(docs.length[k])
            what = f"sample {int(batch.sample_ids[k])} ({where})"
            out.append(self.client.submit(batch.input_ids[r, a : a + n], what))
        return out

    def _drop_ahead(self) -> None:
        """Forget what was read ahead (its requests finish, and their places are given
        back)."""
        for item in self._queue:
            for f in item.states:
                f.cancel()
                if f.done():
                    self.client.release(f)
        self._queue.clear()
        self._ended = None
        self._it = None
