"""The corpus is immutable while it is served: notice when it is not.

A corpus truncated under the daemon makes the next read of a vanished page raise SIGBUS
(the fill turns that into ``CorpusFaultError``), and one rewritten in place (``rsync
--inplace``, a tokenizer re-run into the same path) would silently serve other rows. The
watcher ``fstat``s the inode of every shard the daemon maps (``ShardFile.fd``) on a timer,
before an epoch is planned and after a fault: a change of size or mtime is a change; a
change of ctime alone (a write that restored the mtime, or only a chmod) is one if the
shard's content digest changed too. What changed is said in one line, and the server then
stops serving that corpus (``LoaderServer.corpus_error``) until it is reloaded (SIGHUP) or
the daemon restarts.

A new file renamed over a shard's path (atomic replacement) is not a change: the daemon
keeps serving the inode it opened, and logs once that the path now holds another file.
The cost is one ``fstat`` per shard per check (every 0.5 s by default); rows served between
an in-place write and its detection may be affected, which the message says.
"""

from __future__ import annotations

import logging
import os
import time

from loader_server.data.shards import Identity, ShardFile, content_digest

log = logging.getLogger(__name__)


class CorpusWatch:
    """Compares each shard's inode with what it was when the dataset was opened."""

    def __init__(self, shards: list[ShardFile]) -> None:
        self._shards = shards
        self._replaced: set[int] = set()  # shards whose path now names another file
        self.last_good = time.time()  # wall clock of the last check that found nothing

    def check(self) -> str | None:
        """None if every shard is as opened; else one line saying what changed."""
        for k, shard in enumerate(self._shards):
            why = self._changed(shard)
            if why is not None:
                since = time.strftime("%H:%M:%S", time.localtime(self.last_good))
                return (
                    f"corpus file {shard.path} {why} while being served (batches produced "
                    f"after {since} may hold changed rows)"
                )
            self._note_replaced(k, shard)
        self.last_good = time.time()
        return None

    def _changed(self, shard: ShardFile) -> str | None:
        if shard.fd < 0:
            return None
        old = shard.identity
        new = Identity.of(os.fstat(shard.fd))
        if new.size != old.size:
            kind = "was truncated" if new.size < old.size else "grew"
            return f"{kind} ({old.size:,} -> {new.size:,} bytes)"
        if new.mtime_ns != old.mtime_ns:
            return f"was modified in place (mtime {_when(old.mtime_ns)} -> {_when(new.mtime_ns)})"
        if new.ctime_ns != old.ctime_ns:
            if content_digest(shard) != shard.digest:
                return "was rewritten in place (same size and mtime, other content)"
            shard.identity = new  # a chmod/chown/touch -c: the content is what was opened
            log.info("%s: metadata changed, content unchanged; still serving it", shard.path)
        return None

    def _note_replaced(self, k: int, shard: ShardFile) -> None:
        try:
            st = os.stat(shard.path)
            replaced = (st.st_dev, st.st_ino) != (shard.identity.dev, shard.identity.ino)
        except FileNotFoundError:
            replaced = True
        if replaced and k not in self._replaced:
            self._replaced.add(k)
            log.warning(
                "%s now names another file (replaced or removed); the daemon keeps serving "
                "the file it opened until it restarts or gets SIGHUP",
                shard.path,
            )


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns % 10**9:09d}"
