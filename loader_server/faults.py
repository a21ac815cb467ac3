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

Both the daemon and the trainer import it (a public module of ``loader_server``), and both
check the variable as they start (``check``): a misspelled point, a value that is not an
integer or a rank that is not one is refused, naming the variable and the known points, so
a fault-matrix reproduction cannot pass without its fault.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DFLASH_FAULT"
#: Every fault point and what its value counts (all integers).
POINTS = {"plan": "EPOCH", "step": "N", "checkpoint.write": "N", "checkpoint.publish": "N"}


def check(environ: dict[str, str] | None = None) -> None:
    """ValueError naming ``DFLASH_FAULT`` and the known points unless every item of it is
    ``POINT[=VALUE][@RANK]`` with a known point and integer value and rank (unset: fine)."""
    spec = (os.environ if environ is None else environ).get(ENV)
    if spec is None:
        return
    known = ", ".join(f"{p}={v}" for p, v in POINTS.items())
    for item in spec.split(","):
        why = _problem(item.strip())
        if why:
            raise ValueError(
                f"{ENV}={spec!r}: {item.strip()!r} {why} (items POINT[=VALUE][@RANK], "
                f"comma-separated; the points: {known})"
            )


def _problem(item: str) -> str | None:
    """What is wrong with one item, or None."""
    name, at_sign, rank = item.partition("@")
    name, eq, value = name.partition("=")
    if name not in POINTS:
        return "names no fault point"
    if eq and not value.lstrip("-").isdigit():
        return f"needs an integer {POINTS[name]} after '='"
    if at_sign and not rank.isdigit():
        return "needs a rank (an integer >= 0) after '@'"
    return None


def fault_point(point: str, value: object = None) -> None:
    """Kill this process (SIGKILL: no cleanup, no atexit, as a crash) if ``DFLASH_FAULT`` names
    ``point`` here; otherwise return at once."""
    assert point in POINTS, point  # a point the code names is one of the known ones
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
