"""The suspicion timer: how long a suspected member has to refute before it is declared dead.

Lifeguard's rule: the timeout starts at `max` and shrinks toward `min` as independent members
confirm the suspicion, on a log scale, reaching `min` after `k` confirmations. One prober's
bad link therefore cannot kill a member quickly, while a member many peers cannot reach dies
fast. Confirmations count distinct reporters; the first reporter does not count. This file
owns the formula and one timer's bookkeeping; it never reads the clock -- `start` is given.
"""

from __future__ import annotations

import math


def suspicion_timeout(confirmations: int, k: int, min_timeout: float, max_timeout: float) -> float:
    """Timeout after `confirmations` independent confirmations out of `k` expected."""
    if k < 1:
        return min_timeout
    frac = math.log(confirmations + 1.0) / math.log(k + 1.0)
    return max(min_timeout, max_timeout - (max_timeout - min_timeout) * frac)


def expected_confirmations(suspicion_mult: float, n: int) -> int:
    """How many confirmations to wait for among n members: none in tiny clusters, where
    there is nobody independent to ask (as memberlist)."""
    k = int(suspicion_mult) - 2
    return 0 if n - 2 < k else max(0, k)


class Suspicion:
    """One running suspicion of one member at one incarnation."""

    __slots__ = ("start", "k", "min_timeout", "max_timeout", "reporters", "deadline")

    def __init__(self, start: float, reporter: str, k: int, min_timeout: float,
                 max_timeout: float):
        self.start = start  # when this node started suspecting
        self.k = k  # confirmations that bring the timeout down to min_timeout
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout
        self.reporters = {reporter}  # the first reporter, then every confirmer
        self.deadline = start + (min_timeout if k < 1 else max_timeout)

    @property
    def confirmations(self) -> int:
        return len(self.reporters) - 1

    def confirm(self, reporter: str) -> bool:
        """Count `reporter` once; True if it was a new, independent confirmation."""
        if reporter in self.reporters or self.confirmations >= self.k:
            return False
        self.reporters.add(reporter)
        timeout = suspicion_timeout(self.confirmations, self.k, self.min_timeout,
                                    self.max_timeout)
        self.deadline = self.start + timeout
        return True
