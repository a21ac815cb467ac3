"""How long a client waits before each new attempt to reach a daemon that went away.

Jittered exponential backoff: the nominal wait starts at ``INITIAL_S`` and grows by
``FACTOR`` per attempt up to ``CAP_S``; each actual wait is a random 1 - ``JITTER`` to 100%
of it, so the ranks of a job that lost the same daemon do not all knock at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

#: The first wait: a daemon that restarts (systemd ``Restart=``, a corpus reload) is back
#: within a fraction of a second, so the first retry comes as soon as the old fixed pause.
INITIAL_S = 0.2
#: Each wait doubles: a daemon that stays away costs a few attempts, not hundreds.
FACTOR = 2.0
#: The longest wait: a daemon that comes back is found at most this late (ZeroMQ's own
#: reconnect keeps trying underneath, so an attempt already under way sees it at once).
CAP_S = 2.0
#: Each wait is 50-100% of its nominal value: ranks that lost the daemon together spread
#: over half of each interval, and the waits still grow.
JITTER = 0.5


class Backoff:
    """The waits before successive attempts of one outage (a new outage: a new Backoff).

    ``draw`` gives the jitter, uniform in [0, 1): the ``random`` module's by default (it is
    reseeded in a forked child, so ranks forked from one parent do not wait in step); pass
    a seeded ``random.Random(seed).random`` for a repeatable sequence.
    """

    def __init__(
        self,
        initial_s: float = INITIAL_S,
        factor: float = FACTOR,
        cap_s: float = CAP_S,
        jitter: float = JITTER,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError(f"need 0 < initial_s <= cap_s, got {initial_s} and {cap_s}")
        if factor < 1:
            raise ValueError(f"factor must be >= 1 (waits never shrink), got {factor}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        self.factor = factor
        self.cap_s = cap_s
        self.jitter = jitter
        self._nominal = initial_s
        self._draw = draw

    def next_wait(self) -> float:
        """Seconds to wait before the next attempt."""
        wait = self._nominal * (1 - self.jitter * self._draw())
        # Growth stops at the cap, so the nominal wait never overflows however long it runs.
        self._nominal = min(self.cap_s, self._nominal * self.factor)
        return wait
