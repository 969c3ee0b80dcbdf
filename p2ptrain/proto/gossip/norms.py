"""The norms a gradient mixer judges peer vectors by (mixer.py): a small window of recent
norms -- the own gradient's at its last `norm_window` mixes, and each peer's latest accepted
one (one vote a sender, its last `norm_window` senders: a member that sends many vectors
under distinct counts cannot set the median, down to refuse every honest peer or up to pass
a huge one).

The reference that clips and limits are multiples of is the window's median, but never more
than NORM_SPREAD times the median of the own norms: at a cold start the window holds one own
norm and a single peer's, and that peer alone must not set the clip it is judged by (a first
outer round took a huge pseudo-gradient unclipped). Honest peers' norms differ from the own
by their batch (a Pi's noisier gradient against a server's), well within the spread.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

NORM_SPREAD = 8.0  # the median counts up to this times the own norms' median


class NormWindow:
    """Recent own norms and each peer's latest; `reference()` and `limit()` from them."""

    def __init__(self, window: int, absurd_multiple: float, max_norm: float):
        self.window, self.absurd_multiple, self.max_norm = window, absurd_multiple, max_norm
        self.own: deque[float] = deque(maxlen=window)
        self.peers: dict[bytes, float] = {}  # sender -> its latest, oldest first

    def add_own(self, norm: float) -> None:
        self.own.append(norm)

    def add_peer(self, sender: bytes, norm: float) -> None:
        self.peers.pop(sender, None)  # one vote a sender: its latest
        self.peers[sender] = norm
        if len(self.peers) > self.window:
            del self.peers[next(iter(self.peers))]

    @property
    def norms(self) -> tuple[float, ...]:
        """The own recent norms, oldest first, then each peer's latest, oldest sender first."""
        return (*self.own, *self.peers.values())

    def reference(self) -> float:
        """The median of `norms`, at most NORM_SPREAD times the own norms' median (inf while
        neither is known)."""
        if not self.own and not self.peers:
            return math.inf
        median = statistics.median(self.norms)
        own = statistics.median(self.own) if self.own else 0.0
        return min(median, NORM_SPREAD * own) if own > 0 else median

    def limit(self) -> float:
        """Norms above this are absurd: refused."""
        return min(self.max_norm, self.absurd_multiple * self.reference())
