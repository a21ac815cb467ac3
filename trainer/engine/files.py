"""One safetensors file per document (``--states-transport files``): for a server whose
folder this machine sees (a shared mount), and the baseline the other transports are
measured against (``benchmarks/bench_states.py``).

The connector writes ``FOLDER/cmpl-<request id>-0-RANDOM.safetensors`` (``hidden_states
[T, n, H]``, ``token_ids [T]``) after the server answered, into ``NAME.part`` then renamed,
while it holds an exclusive ``flock`` on ``NAME.lock`` (made before the reply). The client
waits on the lock (a shared ``flock``, polled), reads the file and deletes it with its
lock. The folder and the file are trusted as ``trainer.engine.folders`` says: this
request's own name, in a folder others cannot write to, a regular file.

Each new document's file is fresh memory (tmpfs allocates and zeroes its pages as they are
written): about 0.2 of one memcpy on this machine, whatever the writer does
(``docs/BENCHMARKS.md``, the transport table). ``--states-transport shm`` reuses its pages.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainer.engine import folders
from trainer.engine.errors import EngineError, unwritten
from trainer.engine.seam import Attempt, Lost, pause
from trainer.vllm.connector.dflash_states_file import FAILED, REASON_BYTES

log = logging.getLogger(__name__)


class FileTransport:
    """``trainer.engine.seam.Transport`` through files in ``folder`` (None: the folder the
    server's first reply names, checked then). ``run``: ``RUN-INC``; ``rank``: this rank."""

    name = "files"

    def __init__(self, folder: Path | None, *, run: str, rank: int, **_: Any) -> None:
        self.folder = folders.shared_folder(folder) if folder is not None else None
        self.run, self.run_id = run, run.split("-")[0]
        self.prefix = f"cmpl-dflash-{run}-r{rank}-"
        self._swept = False
        if self.folder is not None:
            self.sweep()

    def connector(self) -> dict[str, Any]:
        assert self.folder is not None, "a started server's folder is known"
        return {"shared_storage_path": str(self.folder)}

    def place(self, nbytes: int) -> None:
        return None  # a file per request, named by the connector

    def ready(self, place: None, attempt: Attempt) -> None:
        pass

    def params(self, place: None, req_id: str) -> dict[str, Any]:
        return {}

    def locate(self, place: None, placed: dict[str, Any], req_id: str, url: str,
               what: str) -> Path:  # fmt: skip
        named = placed.get("hidden_states_path")
        if not isinstance(named, str) or not named:
            raise EngineError(
                f"{url} returned no hidden-states file for {what}: is it serving with the "
                "extract_hidden_states method and the DFlash connector? (its flags: "
                "docs/TRAINER.md, 'Targets served by vLLM')"
            )
        path = folders.request_file(named, self.folder, req_id, url, what)
        if self.folder is None:
            self.folder = folders.shared_folder(path.parent)
            self.sweep()
        if os.path.realpath(path.parent) != os.path.realpath(self.folder):
            raise EngineError(
                f"{url} named {named!r} for {what}, outside the folder it wrote to before "
                f"({self.folder}): refusing to read or remove it"
            )
        return path

    def fetch(self, place: None, path: Path, attempt: Attempt) -> dict[str, torch.Tensor]:
        """The file, once its writer let go of its lock (it holds ``LOCK_EX`` until the
        file is whole, which takes milliseconds); a writer stuck past the deadline is an
        ``EngineError``. A file never written (its server died) is ``Lost``."""
        import fcntl

        from safetensors import SafetensorError
        from safetensors.torch import load_file

        attempt.stage(f"waiting for {path} to be written")
        try:
            with folders.open_regular(Path(str(path) + ".lock"), "the states' lock file") as lock:
                for k in itertools.count():
                    try:
                        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        _check_wait(path, attempt)
                        time.sleep(pause(k))
                attempt.stage(f"reading {path}")
                with folders.open_regular(path, f"the states file of {attempt.what}") as fd:
                    states = dict(load_file(f"/proc/self/fd/{fd}", device="cpu"))
            self.release(None, path)  # read into memory: the file goes at once
            return states
        except FileNotFoundError:
            if not Path(str(path) + ".lock").exists() and not path.exists():
                # The server makes the lock before it replies: none means another folder.
                raise EngineError(
                    f"the server wrote {attempt.what}'s states to {path.name}, which is not in "
                    f"{path.parent} here: give --engine-dir, the folder where this machine "
                    "sees the server's shared_storage_path"
                ) from None
            unwritten(attempt.what, path.name, _failure(path))
            raise Lost(f"its states file {path} was never written") from None
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # killed mid-write
            raise Lost(f"its states file {path} could not be read ({e})") from None

    def discard(self, place: None, path: Path) -> None:
        self.release(place, path)

    def release(self, place: None, path: Path | None) -> None:
        """Remove a request's file, its lock and what a killed writer left of it."""
        if path is None:
            return
        for p in (path, *(Path(str(path) + end) for end in (".lock", ".part", FAILED))):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def health(self) -> str | None:
        return None  # nothing between the server and this machine's memory

    def sweep(self) -> None:
        if self.folder is not None and not self._swept:
            self._swept = True
            folders.sweep_run(self.folder, self.run)

    def close(self) -> None:
        if self.folder is not None:
            folders.remove_named(self.folder, self.prefix, None)


def _failure(path: Path) -> str | None:
    """Why the writer could not write ``path`` (its ``.failed`` beside it), if it said."""
    try:
        with folders.open_regular(Path(str(path) + FAILED), "a failed write's reason") as fd:
            return os.read(fd, REASON_BYTES).decode(errors="replace")
    except FileNotFoundError:
        return None


def _check_wait(path: Path, attempt: Attempt) -> None:
    """Keep waiting for a writer, even while closing (a file written after the client
    left would stay behind), until the deadline or the close's grace."""
    if attempt.grace_over():
        raise EngineError(f"{path}: not written yet (closing)")
    if time.monotonic() > attempt.deadline:
        raise EngineError(
            f"{path}: the server has been writing {attempt.what}'s states past its deadline "
            "(--engine-timeout-s)"
        )
