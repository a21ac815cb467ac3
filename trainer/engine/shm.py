"""States through a shared-memory arena of the trainer rank's (``--states-transport shm``,
the default when the server runs on this machine).

Why not a file per document: a fresh file's pages are allocated and zeroed by the kernel
as they are written, and freed when it is removed, which bounds a file per document at
about 0.2 of one memcpy on this machine however it is written; pages that are mapped once
and reused cost one copy (``docs/BENCHMARKS.md``, the transport table). So each rank maps
an arena once (in the run's private states folder, ``--states-buffer-mb``; its pages are made
by the first documents written there, then reused) and gives each document a region of it
before asking for it;
the server's connector copies the states into the region
(``trainer/vllm/connector/dflash_states_shm.py``: the layout, the record lock, the header
written last), and the trainer reads them where they lie: the feed's assembly into the
batch's features is the only copy on this side. The region is given back once the feed
has assembled its micro-batch.

Room is given out in the order documents were submitted (``place``): the document the
feed waits for is never starved by younger ones holding the room, and one larger than the
arena is refused at once, naming the flag. What the run removes: its arenas of earlier
starts (``arena-dflash-RUN-...``), and its own on closing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainer.engine import folders
from trainer.engine.errors import EngineError, unwritten
from trainer.engine.regions import Region, Room
from trainer.engine.seam import Attempt, Lost, pause
from trainer.vllm.connector import dflash_states_shm as layout

log = logging.getLogger(__name__)

#: The arena's default size per rank.
DEFAULT_MB = 2048


class ShmTransport:
    """``trainer.engine.seam.Transport`` through an arena of ``size_mb`` MiB in ``folder``
    (the run's private folder, or ``--engine-dir``: the server's ``shared_storage_path``
    on this machine). ``run``: ``RUN-INC``; ``rank``: this rank."""

    name = "shm"

    def __init__(self, folder: Path | None, *, run: str, rank: int,
                 size_mb: int = DEFAULT_MB, **_: Any) -> None:  # fmt: skip
        if folder is None:
            raise EngineError(
                "--states-transport shm needs the server's folder on this machine "
                "(--engine-dir, or a server the run starts)"
            )
        self.folder = folders.shared_folder(folder)
        self.run, self.run_id = run, run.split("-")[0]
        self.arena = f"arena-dflash-{run}-r{rank}"
        self.path = self.folder / self.arena
        self.sweep()
        self.size = _check_room(self.folder, int(size_mb) << 20)
        self.mem = _make_arena(self.path, self.size)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.room = Room(self.size, f"arena {self.path}", "--states-buffer-mb")

    def connector(self) -> dict[str, Any]:
        return {"shared_storage_path": str(self.folder)}

    # ---- room ------------------------------------------------------------------------

    def place(self, nbytes: int) -> Region:
        return self.room.place(nbytes)

    def ready(self, region: Region, attempt: Attempt) -> None:
        """Room for ``region``, once every older place has had its own."""
        attempt.stage(f"waiting for {region.nbytes >> 20} MiB of room in {self.path}")
        if self.room.ready(region, attempt.what, attempt.deadline, attempt.closing):
            layout.clear_header(self.mem, region.offset)

    def release(self, region: Region, handle: Any = None) -> None:
        self.room.release(region)

    # ---- one request -------------------------------------------------------------------

    def params(self, region: Region, req_id: str) -> dict[str, Any]:
        layout.clear_header(self.mem, region.offset)
        return {"dflash_shm": {"arena": self.arena, "offset": region.offset,
                               "nbytes": region.nbytes, "key": req_id}}  # fmt: skip

    def locate(self, region: Region, placed: dict[str, Any], req_id: str, url: str,
               what: str) -> str:  # fmt: skip
        if "dflash_shm_error" in placed:
            raise EngineError(
                f"{url} cannot put {what}'s states in this rank's arena {self.path} "
                f"({placed['dflash_shm_error']}): give --engine-dir the folder the server "
                "writes to (its shared_storage_path) as this machine sees it; a server on "
                "another machine needs --states-transport mooncake or files"
            )
        said = placed.get("dflash_shm")
        asked = {"arena": self.arena, "offset": region.offset, "nbytes": region.nbytes}
        if said != asked:
            raise EngineError(
                f"{url} says it put {what}'s states at {said!r}, not in the region this rank "
                f"gave request {req_id} ({asked}): is the server's connector "
                "--states-transport shm's? refusing to read there"
            )
        return req_id

    def fetch(self, region: Region, req_id: str, attempt: Attempt) -> dict[str, torch.Tensor]:
        """The region's tensors (views of the arena) once the writer let go of its lock;
        ``Lost`` if it let go without writing (it died)."""
        attempt.stage(f"waiting for {req_id}'s states in {self.path}")
        for k in itertools.count():
            if layout.lock_range(self._fd, False, region.offset, region.nbytes, wait=False):
                break  # the writer let go
            if attempt.closing():
                raise EngineError(f"{self.path}: {req_id} not written yet (closing)")
            if time.monotonic() > attempt.deadline:
                raise EngineError(
                    f"{self.path}: the server has been writing {attempt.what}'s states past "
                    "its deadline (--engine-timeout-s)"
                )
            time.sleep(pause(k))
        layout.unlock_range(self._fd, region.offset, region.nbytes)
        found = layout.read_region(self.mem, region.offset)
        if found is None or found[0] != layout.key_of(req_id):
            unwritten(attempt.what, req_id, layout.failure(self.mem, region.offset, req_id))
            raise Lost(f"its region in {self.path} was let go unwritten (the writer died)")
        return found[1]

    def discard(self, region: Region, handle: Any) -> None:
        pass  # the region is kept for the next try; its header is cleared then

    # ---- the arena ---------------------------------------------------------------------

    def health(self) -> str | None:
        return None  # nothing between the server and this machine's memory

    def sweep(self) -> None:
        folders.sweep_run(self.folder, self.run)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(BufferError, ValueError):
            self.mem.close()  # views still alive keep the mapping until they go
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _check_room(folder: Path, size: int) -> int:
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise EngineError(
            f"--states-buffer-mb {size >> 20}: {folder} has {free >> 20} MiB free (Docker's "
            "/dev/shm is 64 MiB unless --shm-size says more): lower it, or give more"
        )
    return size


def _make_arena(path: Path, size: int) -> mmap.mmap:
    """The arena file (0600, this run's own name), sized and mapped. Its pages come into
    being as documents are first written (the memory the run holds grows with what it
    reads ahead, up to ``size``) and are reused from then on."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
