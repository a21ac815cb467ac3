"""The corpus's files: one open descriptor per shard, their identity and content digests.

The daemon maps exactly the inode it opened: each shard is opened once (``ShardFile``) and
pyarrow maps it through ``/proc/self/fd/N``, so a file renamed over the path meanwhile is
never half-read. The descriptor stays open for the life of the dataset, which lets the
corpus watcher (``loader_server.data.corpus_watch``) ``fstat`` the very inode it serves:
truncation, growth and in-place writes change its size, mtime or ctime, while an atomic
replacement (a new file renamed over the path) leaves it untouched (the old inode is served
until a restart or SIGHUP).

The fingerprint hashes the lengths and each shard's relative name, size and content
(whole file up to 64 MiB; otherwise 256 evenly spaced 4 KiB samples plus head and tail);
the same bytes give each shard's own digest, which the watcher recomputes when only a
shard's ctime moved (a write that restored the mtime, or a chmod).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Shards up to this size are hashed whole for the fingerprint; larger ones are sampled.
FULL_HASH_BYTES = 64 << 20
_HASH_SAMPLES = 256
_HASH_SAMPLE_BYTES = 4096


class ShardError(Exception):
    """A shard file that cannot be opened as a regular file."""


@dataclass(frozen=True)
class Identity:
    """What ``fstat`` says about a shard's inode; a change means the file changed."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class ShardFile:
    """One open shard: ``fd`` refers to the inode that is mapped and served."""

    path: Path
    fd: int
    identity: Identity
    digest: str = ""

    @property
    def map_path(self) -> str:
        """A path that opens exactly this inode (for pyarrow's memory_map)."""
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.exists(proc) else str(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_shard(path: Path) -> ShardFile:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ShardError(f"{path}: cannot open ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ShardError(f"{path}: not a regular file")
    return ShardFile(path, fd, Identity.of(st))


def content_digest(shard: ShardFile, feed: Callable[[bytes], None] | None = None) -> str:
    """Digest of the shard's size and content samples (see the module docstring), read
    from its descriptor; ``feed`` receives the same bytes (the dataset fingerprint)."""
    size = shard.identity.size
    own = hashlib.blake2b(digest_size=16)
    own.update(str(size).encode())
    for off, n in _hash_ranges(size):
        data = os.pread(shard.fd, n, off)
        own.update(data)
        if feed is not None:
            feed(data)
    return own.hexdigest()


def _hash_ranges(size: int) -> list[tuple[int, int]]:
    if size <= FULL_HASH_BYTES:
        return [(off, min(1 << 24, size - off)) for off in range(0, size, 1 << 24)]
    offsets = np.linspace(0, size - _HASH_SAMPLE_BYTES, _HASH_SAMPLES, dtype=np.int64)
    return [(int(off), _HASH_SAMPLE_BYTES) for off in offsets]


def fingerprint(lengths: np.ndarray, shards: list[ShardFile], root: Path) -> str:
    """Hash of the lengths and each shard's name, size and content; sets each shard's
    ``digest``. Names are relative to the dataset root, so a copy on another node
    fingerprints the same."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
    for shard in shards:
        rel = shard.path.name if shard.path == root else str(shard.path.relative_to(root))
        h.update(f"{rel}:{shard.identity.size}".encode())
        shard.digest = content_digest(shard, h.update)
    return h.hexdigest()
