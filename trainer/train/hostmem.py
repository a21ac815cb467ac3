"""Host (CPU) allocator policy while the drafter runs in many chunks.

Each drafter chunk allocates and frees activations of 1-32 MB while its small output
stays alive. glibc raises its mmap threshold to 32 MB after the first large free and then
serves such blocks from the heap, which fragments: on CPU, peak RSS grew with the number
of chunks (+0.45 GB at 2,048 anchors, hidden 256), although no tensor outlived its chunk.
A fixed 1 MiB threshold (such blocks are mapped and returned on free) keeps the peak flat,
but costs page faults: about 11% of a tiny-target step that has only two chunks. So the
threshold follows the micro-batch: 1 MiB when it has more than ``MANY_CHUNKS`` chunks,
glibc's own 32 MiB ceiling otherwise. GPU tensors are not host allocations: nothing to do
there. Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MANY_CHUNKS = 4
SMALL_THRESHOLD_BYTES = 1 << 20
DEFAULT_THRESHOLD_BYTES = 32 << 20
_state: dict[str, int] = {}


@cache
def _mallopt() -> Callable[[int, int], int] | None:  # the libc function, or None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def fit_chunks(num_chunks: int) -> int | None:
    """Set the mmap threshold for a CPU micro-batch of ``num_chunks`` drafter chunks;
    returns the threshold in force (None where it cannot be set)."""
    want = SMALL_THRESHOLD_BYTES if num_chunks > MANY_CHUNKS else DEFAULT_THRESHOLD_BYTES
    if _state.get("threshold") == want:
        return want
    mallopt = _mallopt()
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, want):
        return None
    _state["threshold"] = want
    return want
