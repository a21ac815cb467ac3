"""Fault points: a real ``kill -9`` of this process at a named phase of its work, so the fault
matrix (docs/TRAINER.md, "What survives what") kills each process exactly where it means to,
not wherever a poll happens to land.

``DFLASH_FAULT="POINT[=VALUE][@RANK],..."``: the process SIGKILLs itself the first time it
reaches ``POINT`` (with ``VALUE``, when given: an epoch, a step) on rank ``RANK`` (torchrun's
``RANK``; absent: every rank). Unset, a point costs one dictionary lookup. The points:

* ``plan=EPOCH``: the daemon, as it starts planning an epoch (the first plan, or the next
  epoch's planned ahead at an epoch's end);
* ``step=N``: a trainer rank, as it starts step N (its batches not yet asked for);
* ``checkpoint.write=N``: a trainer rank, with its part of checkpoint N written into
  ``step-N.tmp/`` and rank 0's shared record not yet;
* ``checkpoint.publish=N``: rank 0, with checkpoint N's manifest written and the folder not
  yet renamed.

Both the daemon and the trainer import it (a public module of ``loader_server``).
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DFLASH_FAULT"


def fault_point(point: str, value: object = None) -> None:
    """Kill this process (SIGKILL: no cleanup, no atexit, as a crash) if ``DFLASH_FAULT`` names
    ``point`` here; otherwise return at once."""
    spec = os.environ.get(ENV)
    if spec and _matches(spec, point, value, os.environ.get("RANK", "0")):
        print(f"{ENV}: kill -9 at {point}={value}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _matches(spec: str, point: str, value: object, rank: str) -> bool:
    for item in spec.split(","):
        name, _, at = item.strip().partition("@")
        name, _, want = name.partition("=")
        if name == point and (not want or want == str(value)) and (not at or at == rank):
            return True
    return False
