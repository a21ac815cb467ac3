"""The one owner of output paths: every ``dflash-train`` command that writes goes through here.

``atomic_output`` builds a file or folder in a private folder beside its destination (a
hidden ``.OUT.XXXXXXXX.dflash-tmp`` that ``mkdtemp`` creates, so no user picks its name) and
moves it into place only when it is complete. It refuses an OUT that is, contains or lies
inside one of the command's inputs; it refuses an existing non-empty OUT unless ``force``,
and with ``force`` the old OUT is moved aside into the private folder and removed only once
the new one is in place, so a crash leaves the old or the new one, never neither. It
removes only what it created in this run: its private folder (and, with ``force``, the OUT
it replaced). A private folder a killed run leaves behind is hidden and never read as input.
What it moves into place has the permissions the umask gives (``readable``): writers that
create private files (safetensors' 0600, ``mkstemp``) must not make an export unreadable to
the user who serves it.

``check_output`` is the same refusal for outputs that are not built whole (a training run's
folder); ``fsync_dir`` makes a rename durable. Checkpoints add their own per-rank protocol on
top of these (``trainer.train.checkpoint``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_SUFFIX = ".dflash-tmp"


class OutputError(ValueError):
    """An output path that must not be written (one line for the user)."""


def umask() -> int:
    """This process's umask (read from /proc where it can be, without changing it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def readable(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes a plain ``open``
    or ``mkdir`` would under the umask: 0666 & ~umask for files (0777 for executables),
    0777 & ~umask for folders. Links are left alone."""
    if not os.path.lexists(path):
        return
    mask = umask()
    entries = [Path(path)]
    if Path(path).is_dir() and not Path(path).is_symlink():
        entries += sorted(Path(path).rglob("*"))
    for p in entries:
        if p.is_symlink():
            continue
        full = 0o777 if p.is_dir() or os.stat(p).st_mode & 0o111 else 0o666
        os.chmod(p, full & ~mask)


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_nonempty(path: Path) -> bool:
    """A file, or a folder with anything in it."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def overlap(out: Path, inputs: Iterable[Path | str]) -> str | None:
    """How ``out`` overlaps one of ``inputs`` ("is", "contains", "lies inside"), naming
    it, or None. Paths are compared resolved (links followed)."""
    target = Path(out).resolve()
    for raw in inputs:
        inp = Path(raw).resolve()
        if target == inp:
            return f"is the input {raw}"
        if target in inp.parents:
            return f"contains the input {raw}"
        if inp in target.parents and inp.is_dir():
            return f"lies inside the input folder {raw}"
    return None


def check_output(
    out: Path, *, inputs: Iterable[Path | str] = (), force: bool = True, hint: str = "--force"
) -> None:
    """Refuse an ``out`` that overlaps an input, or (without ``force``) that exists and is
    not empty; ``hint`` names the flag that allows replacing it."""
    how = overlap(out, inputs)
    if how is not None:
        raise OutputError(f"{out}: the output {how}: choose an output outside the inputs")
    if not force and is_nonempty(Path(out)):
        raise OutputError(f"{out}: already exists and is not empty ({hint} replaces it)")


@contextmanager
def atomic_output(
    out: Path,
    *,
    folder: bool,
    force: bool,
    inputs: Iterable[Path | str] = (),
    hint: str = "--force",
) -> Iterator[Path]:
    """Yield the path to build ``out`` at (an empty folder with ``folder``, else a file
    path); when the block ends without an error it becomes ``out`` (see the module
    docstring), otherwise nothing outside the private folder has changed."""
    out = Path(out)
    check_output(out, inputs=inputs, force=force, hint=hint)
    out.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PRIVATE_SUFFIX, dir=out.parent))
    new, aside = private / "new", private / "replaced"
    if folder:
        new.mkdir()
    try:
        yield new
        readable(new)
        if os.path.lexists(out) and (folder or (out.is_dir() and not out.is_symlink())):
            os.replace(out, aside)  # a rename cannot put a folder over anything, or a file
            # over a folder: move the old one aside (a file over a file is one rename)
        try:
            os.replace(new, out)
        except BaseException:
            if aside.exists() and not out.exists():
                os.replace(aside, out)  # put the old output back
            raise
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(private, ignore_errors=True)
