"""The guard on parameter averaging (issue 13): which peer snapshots a node refuses to average
with, the way `GradientMixer` guards gradients with a running median norm.

A snapshot is judged by its consensus distance to our replica (RMS of x_peer - x_self over the
covered coordinates, from the two snapshots, before anything is applied; each |x_peer - x_self|
clipped as the exchange would clip it, spread.py: the move the exchange would make):
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

And how many of the node's recent exchanges one peer may start (`crowded`): a member holding
the key may send a request at every step, and each exchange may move a coordinate by the
clip's bound (spread.py) -- in the same direction every time, while the node's honest
partners pull it back only as often as they exchange with it. A peer that started, among the
last SHARE_WINDOW applied exchanges, CROWD_RATIO times as many as the busiest other peer had
(either side starting them) and CROWD_SLACK more has its requests declined until others have
theirs. With two or more honest partners a member's pulls are then matched or outweighed by
theirs; honest partners, drawn at random, rarely get that far ahead of one another. Exchanges
this node started do not count against their peer: a node draws its fastest partner most,
and counting them declined that partner's own requests. Not free: in a core of three fast
servers that each draw one favourite, one server's favourite can be far ahead of the other
(13% of requests declined at seed-100m, the time to target unchanged). With no other peer
among them (a two-node swarm) there is nobody to be fair to, and in a three-node swarm a
member is a third of the swarm. A member running made-up members is not bounded by this:
the key is the swarm's (BENCHMARKS 11). An exchange counts once, whatever its parts.

Pure: no clock, no randomness, no I/O; bounded state (a window, and a count per peer that
only members can add to, forgotten past `MAX_PEERS`).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque

MIN_DISTANCES = 3  # applied exchanges before their median judges anything
MAX_PEERS = 4096  # peers whose refusals in a row are remembered
SHARE_WINDOW = 32  # applied exchanges whose peers `crowded` counts
CROWD_RATIO = 1.5  # a peer with this many times the busiest other's exchanges among them
CROWD_SLACK = 3  # and this many more is declined


class DistanceGuard:
    """Judges averaging snapshots by their distance to our replica; see the module docstring."""

    def __init__(self, multiple: float, window: int, max_distance: float, patience: int,
                 min_distance: float = 0.0):
        self.multiple = multiple
        self.max_distance = max_distance
        self.min_distance = min_distance  # never refused below this
        self.patience = patience
        self.distances: deque[float] = deque(maxlen=window)  # of applied exchanges
        # (peer, whether the peer started it) of the last applied exchanges
        self.partners: deque[tuple[str, bool]] = deque(maxlen=SHARE_WINDOW)
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

    def crowded(self, peer: str) -> bool:
        """Whether `peer` has started far more of the recent applied exchanges than the
        node's busiest other partner has had: its requests are declined (module docstring)."""
        counts = Counter(p for p, _ in self.partners)
        counts.pop(peer, None)
        started = sum(theirs for p, theirs in self.partners if p == peer)
        return bool(counts) and started >= CROWD_RATIO * max(counts.values()) + CROWD_SLACK

    def applied(self, peer: str, distance: float, theirs: bool = False,
                first: bool = True) -> None:
        """An exchange (or a part of one: `first` if it is its first) with `peer` at
        `distance` was applied (`theirs`: the peer started it). An exchange counts once for
        `crowded`: a 1B model's exchange travels as 50 parts."""
        self.distances.append(distance)
        if first:
            self.partners.append((peer, theirs))
        self.refused_run = 0
        self.peer_runs.pop(peer, None)
