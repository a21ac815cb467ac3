"""Writing outputs so that a crash never leaves a torn one: ``atomic_output`` builds a file or
folder beside its destination (``OUT.tmp``) and moves it into place only when it is complete;
``fsync_dir`` makes a rename durable. The one mechanism every command that writes an output
uses (tokenize, regen, export, held-out prompts); checkpoints add their own per-rank protocol
on top of the same primitives (``trainer.train.checkpoint``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file or a folder tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def is_nonempty(path: Path) -> bool:
    """A file, or a folder with anything in it."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


@contextmanager
def atomic_output(out: Path, *, folder: bool, force: bool, hint: str = "--force") -> Iterator[Path]:
    """Yield ``OUT.tmp`` (an empty folder with ``folder``, else a path to write a file to);
    when the block ends without an error it becomes ``out``, otherwise it is removed.

    An existing non-empty ``out`` is refused unless ``force`` (``hint`` names the flag that
    allows it); when replaced, it is moved aside to ``OUT.old`` and removed only once the new
    output is in place, so a crash leaves the old or the new one, never neither."""
    out = Path(out)
    if is_nonempty(out) and not force:
        raise ValueError(f"{out}: already exists and is not empty ({hint} replaces it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    remove(tmp)
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        if folder or out.is_dir():
            if out.exists():
                remove(old)
                os.replace(out, old)
            os.replace(tmp, out)
            remove(old)
        else:
            os.replace(tmp, out)  # replaces a file atomically
    except BaseException:
        remove(tmp)
        raise
