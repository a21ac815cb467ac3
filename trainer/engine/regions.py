"""Room in a buffer of fixed size, given to documents in the order they were submitted.

A transport that puts states into memory of the trainer's (the shared-memory arena, the
Mooncake receive buffer) gives each document a region before asking for it, and takes it
back once the feed used it. Room is given oldest first: the feed waits for its oldest
document, and a younger one holding the room it needs would never be given back. First
fit over a free list kept in offset order, 64-byte aligned; pure Python, no I/O.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from trainer.engine.errors import EngineError

ALIGN = 64


@dataclass
class Region:
    """A document's place: its order, and once it has room, where."""

    order: int
    nbytes: int
    offset: int = -1


class Room:
    """Regions of a buffer of ``size`` bytes (``what`` names it in errors; ``flag``, the
    option that sizes it)."""

    def __init__(self, size: int, what: str, flag: str) -> None:
        self.size, self.what, self.flag = size, what, flag
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, bytes), by offset
        self._order = itertools.count()
        self._waiting: deque[int] = deque()  # orders of regions without room, oldest first
        self._cond = threading.Condition()

    @staticmethod
    def _need(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    def place(self, nbytes: int) -> Region:
        """A region for ``nbytes``, in submission order (no room yet); a document larger
        than the buffer is refused at once."""
        if nbytes > self.size:
            raise EngineError(
                f"a document of {nbytes / 2**20:.0f} MiB of states does not fit the "
                f"{self.size >> 20} MiB {self.what}: raise {self.flag}"
            )
        region = Region(next(self._order), nbytes)
        with self._cond:
            self._waiting.append(region.order)
        return region

    def ready(self, region: Region, what: str, deadline: float,
              closing: Callable[[], bool]) -> bool:  # fmt: skip
        """Room for ``region`` once every older region has had its own; True when it was
        given now (False: it had room already). ``EngineError`` at the deadline."""
        if region.offset >= 0:
            return False
        with self._cond:
            while True:
                if self._waiting and self._waiting[0] == region.order:
                    at = self._fit(region.nbytes)
                    if at is not None:
                        region.offset = at
                        self._waiting.popleft()
                        self._cond.notify_all()
                        return True
                if closing():
                    raise EngineError(f"the {self.what}: no room yet (closing)")
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"{what}: no room in the {self.size >> 20} MiB {self.what} before its "
                        f"deadline: the trainer holds that many states; raise {self.flag} or "
                        "lower --engine-inflight"
                    )
                self._cond.wait(0.2)

    def _fit(self, nbytes: int) -> int | None:
        need = self._need(nbytes)
        for k, (at, size) in enumerate(self._free):
            if size >= need:
                self._free[k : k + 1] = [(at + need, size - need)] if size > need else []
                return at
        return None

    def release(self, region: Region) -> None:
        """Give ``region``'s room back (or, never given room, stop its wait)."""
        with self._cond:
            if region.offset < 0:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(region.order)
            else:
                self._give_back(region.offset, self._need(region.nbytes))
                region.offset = -1
            self._cond.notify_all()

    def _give_back(self, at: int, size: int) -> None:
        merged: list[tuple[int, int]] = []
        for start, n in sorted([*self._free, (at, size)]):
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged

    @property
    def free(self) -> list[tuple[int, int]]:
        return list(self._free)
