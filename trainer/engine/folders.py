"""The states folder, and the files in it, trusted only as far as they are the run's.

Three kinds of folder hold a server's states files:

* **the run's own** (a server the run starts, its files in memory): made here with mode
  0700 (``own_folder``); one that exists already is taken only if it is a real folder (not
  a link) of this user that nobody else can enter (a resumed run finds its own again; a
  folder someone else made under the run's name is refused, naming owner and mode);
* **the user's** (``--engine-dir``, or the folder a user's server names): taken if it is a
  folder others cannot write to (``shared_folder``): ``/tmp`` or ``/dev/shm`` themselves, or
  any folder of mode ``o+w``, hold other programs' files and let anyone plant one;
* and in either, a **file** is read only if its name is the one its request owns
  (``request_file``: ``cmpl-<request id>-...safetensors`` directly in the folder: a reply
  that names a path elsewhere is refused, never read or removed) and it is a regular file
  (``open_regular``: a FIFO, a device or a link is refused at once instead of blocking the
  reader; a file this process may not read is named with its owner and mode).

What the run removes is what its own requests wrote: files whose names start with its own
request ids (``trainer.engine.client``), never a pattern another program could match.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from trainer.engine.errors import EngineError

log = logging.getLogger(__name__)

#: The file vLLM's connector writes for a request, beside its lock and a partial write.
SUFFIX = ".safetensors"


def describe(st: os.stat_result) -> str:
    """Owner and mode, as ``ls -l`` would show what matters here."""
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"


def own_folder(path: Path) -> Path:
    """``path`` created with mode 0700, or an existing one checked to be this user's
    private folder (a run resumed after a kill finds its own); ``EngineError`` otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = "belongs to another user"
    elif st.st_mode & 0o077:
        problem = "can be entered by other users"
    if problem:
        raise EngineError(
            f"the states folder {path} {problem} ({describe(st)}): this run makes it private "
            "(0700) and trusts no folder it did not make; remove it, or give --engine-dir a "
            "folder of your own"
        )
    return path


def shared_folder(path: Path, flag: str = "--engine-dir") -> Path:
    """``path`` (links followed) if it is a folder that others cannot write to."""
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise EngineError(f"{flag} {path}: no such folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EngineError(f"{flag} {path}: not a folder ({describe(st)})")
    if st.st_mode & stat.S_IWOTH:
        raise EngineError(
            f"{flag} {path}: any user can write to this folder ({describe(st)}: such as /tmp "
            "or /dev/shm themselves), so other programs' files live there and anyone could "
            "plant states in it: give the server and the run a folder of their own"
        )
    return real


def request_file(named: str, folder: Path | None, request_id: str, url: str,
                 what: str) -> Path:  # fmt: skip
    """The local path of the file a server's reply ``named`` for request ``request_id``:
    its name must be the request's own, and without ``folder`` (the files are where the
    server says) it must lie directly in the folder the server named before (checked by the
    caller); with ``folder``, it is that name in ``folder``."""
    name = os.path.basename(named)
    if not (name.startswith(f"cmpl-{request_id}-") and name.endswith(SUFFIX) and "/" not in name):
        raise EngineError(
            f"{url} named {named!r} as the states of {what}, which is not the file of its "
            f"request {request_id} (cmpl-{request_id}-*{SUFFIX}): refusing to read or remove "
            "it (is this server vLLM with the DFlash connector?)"
        )
    return (Path(folder) if folder is not None else Path(named).parent) / name


@contextlib.contextmanager
def open_regular(path: Path, what: str) -> Iterator[int]:
    """A read-only descriptor of ``path`` if it is a regular file, closed on leaving.
    Opened without blocking (a FIFO would block its reader) and without following a link;
    a FIFO, device, folder or link is an ``EngineError``, as is a file this process may not
    read. ``FileNotFoundError`` passes (the caller decides what a missing file means)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except PermissionError:
        try:
            said = describe(os.lstat(path))
        except OSError:
            said = "its folder cannot be entered"
        raise EngineError(
            f"{path}: this process (uid {os.geteuid()}) may not read {what} ({said}): "
            "run the trainer as the server's user, or serve into a folder both can read"
        ) from None
    except OSError as e:
        if e.errno == getattr(os, "ELOOP", -1) or os.path.islink(path):
            raise EngineError(f"{path}: {what} is a symbolic link: refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EngineError(
                f"{path}: {what} is not a regular file ({describe(st)}): refused (a FIFO or a "
                "device would block or never end)"
            )
        yield fd
    finally:
        os.close(fd)


def remove_named(folder: Path, prefix: str, keep: str | None) -> int:
    """Remove the files in ``folder`` whose names start with ``prefix`` (the run's own
    request ids), but those starting with ``keep``; how many."""
    removed = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            if not name.startswith(prefix) or (keep and name.startswith(keep)):
                continue
            if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    if removed:
        log.info("removed %d hidden-state file(s) this run left in %s", removed, folder)
    return removed


def sweep_run(folder: Path, run: str) -> int:
    """Remove what run ``RUN`` left in ``folder`` at its earlier starts (``run``:
    ``RUN-INC``, this start's): requests' files and ranks' arenas, by their names."""
    run_id = run.split("-")[0]
    return sum(
        remove_named(folder, f"{kind}-dflash-{run_id}-", f"{kind}-dflash-{run}-")
        for kind in ("cmpl", "arena")
    )
