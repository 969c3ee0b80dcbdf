"""The guard on parameter averaging (issue 13): which peer snapshots a node refuses to average
with, the way `GradientMixer` guards gradients with a running median norm.

A snapshot is judged by its consensus distance to our replica (RMS of x_peer - x_self over the
covered coordinates, from the two snapshots, before anything is applied):
- refused above `distance_multiple` times the median distance of the last `distance_window`
  exchanges this node applied (one buggy or hostile peer cannot drag a replica far, and a
  replica it wrecked is refused by the others in turn);
- always refused above the absolute bound `max_distance` (e.g. all values 65,504), never
  below `min_distance` (early in a run replicas drift apart faster than a median follows:
  the learning rate warms up);
- judged by the absolute bound alone while fewer than `MIN_DISTANCES` exchanges were applied
  (no median yet; a zero median counts as none), after the last `distance_patience` exchanges
  were all refused, or after the last `distance_patience` snapshots of that peer were: honest
  replicas that drifted apart (a partition, a restart from an older checkpoint) are refused a
  few times, then averaged with again, and so drawn back together -- never refused for good.
  Each such judgement is counted (`fallbacks`), the node's log of it.
Refusals are counted per peer (`refused`), so a repeat offender can be named.

Pure: no clock, no randomness, no I/O; bounded state (a window, and a count per peer that
only members can add to, forgotten past `MAX_PEERS`).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque

MIN_DISTANCES = 3  # applied exchanges before their median judges anything
MAX_PEERS = 4096  # peers whose refusals in a row are remembered


class DistanceGuard:
    """Judges averaging snapshots by their distance to our replica; see the module docstring."""

    def __init__(self, multiple: float, window: int, max_distance: float, patience: int,
                 min_distance: float = 0.0):
        self.multiple = multiple
        self.max_distance = max_distance
        self.min_distance = min_distance  # never refused below this
        self.patience = patience
        self.distances: deque[float] = deque(maxlen=window)  # of applied exchanges
        self.refused_run = 0  # exchanges refused in a row, with any peer
        self.peer_runs: dict[str, int] = {}  # peer -> its snapshots refused in a row
        self.refused: Counter[str] = Counter()  # peer -> snapshots refused, ever
        self.fallbacks = 0  # snapshots judged by the absolute bound alone

    def limit(self, peer: str) -> tuple[float, bool]:
        """(the distance above which `peer`'s snapshot is refused now, whether that is the
        absolute bound alone)."""
        median = statistics.median(self.distances) if len(
            self.distances) >= MIN_DISTANCES else 0.0
        if (median <= 0.0 or self.refused_run >= self.patience
                or self.peer_runs.get(peer, 0) >= self.patience):
            return self.max_distance, True
        return min(self.max_distance, max(self.min_distance, self.multiple * median)), False

    def judge(self, peer: str, distance: float) -> str | None:
        """Why `peer`'s snapshot at `distance` is refused (counted), or None if it may be
        applied. Accepting records nothing: call `applied` once it was."""
        limit, absolute = self.limit(peer)
        self.fallbacks += absolute
        if distance <= limit:  # NaN is refused too
            return None
        self.refused[peer] += 1
        self.refused_run += 1
        if peer not in self.peer_runs and len(self.peer_runs) >= MAX_PEERS:
            self.peer_runs.clear()
        self.peer_runs[peer] = self.peer_runs.get(peer, 0) + 1
        bound = "the absolute bound" if absolute else (
            f"{self.multiple:g} x the median of recent exchanges")
        return (f"averaging snapshot too far from this replica: RMS distance {distance:.4g} "
                f"above {limit:.4g} ({bound})")

    def applied(self, peer: str, distance: float) -> None:
        """An exchange with `peer` at `distance` was applied."""
        self.distances.append(distance)
        self.refused_run = 0
        self.peer_runs.pop(peer, None)
