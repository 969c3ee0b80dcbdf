"""The bound on the swarm sample G-counter (issue 13): how much one entry may grow, so that no
member can end the run (`train.total_samples`) or stop the LR schedule for everyone with one
forged count.

Every value a peer reports (message headers, member-list exchanges, averaging bodies, a
fetched checkpoint) passes `SampleGuard.admit` before it is merged by max:
- an entry exists only for a current member (or this node); at most `MAX_ENTRIES` of them
  (entries of members the table forgot are dropped to make room);
- a new entry starts with what is left of one burst that all new entries share (refilled at
  `count_burst / count_burst_seconds`), not a burst of its own: a member listing made-up
  members with big counts in one message would otherwise move the swarm's count by a burst
  per made-up id and end the run;
- an entry grows only by the tokens of its own bucket: the bucket refills at the entry's
  allowed rate and holds at most `count_burst` samples plus `count_burst_seconds` of that
  rate. A report above what the tokens allow is admitted up to them (clamped), never beyond;
  so honest entries that are merely ahead of this node (a long partition, a node back from a
  long absence, a fast node measured low at first) catch up at the allowed rate instead of
  being refused for good, while a forged 2^53 or `total_samples` moves an entry by one burst.
- the allowed rate of entry X is `count_rate_margin` times X's own rate as this node observed
  it (admitted growth over local time since first seen, at least `RATE_WINDOW` seconds), but
  at least the swarm's median observed rate (this node's own rate, exact, included) and at
  most `count_rate_cap` times it. Why observed rates rather than the advertised capability:
  capability is a matmul benchmark that a forged member record can set at will, and a fixed
  batch (`--batch`) breaks its proportion to samples per second; observed rates need no
  trust, the median resists a minority of inflated entries, and the cap bounds what an
  entry inflated at its own margin can compound to. Until any rate is observed an entry
  refills at `count_burst / count_burst_seconds`.
- what others read of a member's pace (`rate`: averaging pulls, partner draws, the gradient
  weight cap) is the larger of that lifetime rate and its rate over the last one to two
  `RATE_SPAN`s, so a member back from minutes of fetching a checkpoint (or a pause, a
  restart under the same id) is seen at its training pace within a minute, not after many;
  never more than its admitted growth. The bound above keeps the lifetime rate: a recent
  rate would let a long-standing member compound to the cap in seconds, and one whose
  window holds no step of slow-stepping members reads a median of few or none.
A node's starting count (its resume checkpoint, or the checkpoint a driver started it from)
is its baseline, admitted whole (`baseline`). Pure: no clock (times are passed in), no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from p2ptrain.proto.config import ProtoConfig
from p2ptrain.swarmcount import MAX_ENTRIES

RATE_WINDOW = 2.0  # s an entry must be watched before its observed rate counts
RATE_SPAN = 30.0  # s between the two anchors of an entry's recent rate (see `rate`)


@dataclass(slots=True)
class _Entry:
    high: int  # highest value admitted
    tokens: float  # samples it may still grow by at once
    at: float  # when the tokens were last refilled
    first: int  # value when first seen (its observed rate counts growth from here)
    since: float  # when first seen
    recent: tuple[int, float] = (0, 0.0)  # (value, time): the older anchor of the recent rate
    mark: tuple[int, float] = (0, 0.0)  # the newer anchor, which becomes the older a span on


class SampleGuard:
    """Per-entry token buckets over the swarm sample count; see the module docstring."""

    def __init__(self, config: ProtoConfig, me: str):
        self.config = config
        self.me = me
        self.entries: dict[str, _Entry] = {}
        self.clamped = 0  # reports admitted lower than they claimed
        self.pool = float(config.count_burst)  # the burst new entries share (see above)
        self.pool_at: float | None = None

    def baseline(self, counts: Mapping[str, int], now: float) -> None:
        """This node's starting count: admitted as it is."""
        for node_id, n in counts.items():
            e = self._entry(node_id, now)
            e.high = e.first = max(e.high, int(n))
            e.recent = e.mark = (e.first, e.since)

    def own(self, samples: int, now: float) -> None:
        """This node's own entry, exact (it counts its own training)."""
        e = self._entry(self.me, now)
        if e.since == now and e.high == 0:
            e.first = samples
            e.recent = e.mark = (samples, now)
        e.high = max(e.high, samples)
        self._roll(e, now)

    def admit(self, counts: Mapping[str, int], now: float, members: Collection[str]
              ) -> dict[str, int]:
        """The part of `counts` this node may merge now: entries of current `members` (or
        this node), each at most its admitted high plus the tokens of its bucket."""
        out: dict[str, int] = {}
        rates: float | None = None
        for node_id, n in counts.items():
            e = self.entries.get(node_id)
            new = e is None
            if new:
                if node_id != self.me and node_id not in members:
                    continue
                if len(self.entries) >= MAX_ENTRIES:
                    self._prune(members)
                    if len(self.entries) >= MAX_ENTRIES:
                        continue
                e = self._entry(node_id, now)
                e.tokens = self._pool_now(now)  # one shared burst for every new entry
            grow = 0
            if n > e.high:
                if rates is None:
                    rates = self._median_rate(now, members)
                rate = self._rate(e, now, rates)
                capacity = self.config.count_burst + rate * self.config.count_burst_seconds
                e.tokens = min(capacity, e.tokens + rate * (now - e.at))
                e.at = now
                grow = min(n - e.high, int(e.tokens))
                if grow < n - e.high:
                    self.clamped += 1
                e.tokens -= grow
                e.high += grow
                n = e.high
            if new:  # its observed rate counts growth from its first sight on
                e.first = e.high
                e.recent = e.mark = (e.high, now)
                self.pool -= grow
            else:  # on every report: anchors a span apart, however often rates are read
                self._roll(e, now)
            out[node_id] = n
        return out

    def rate(self, node_id: str, now: float) -> float | None:
        """`node_id`'s observed sample rate: admitted growth per second since first seen or,
        if more, over the last one to two `RATE_SPAN`s (so bounded like its entry); None
        until it has been watched `RATE_WINDOW` seconds."""
        e = self.entries.get(node_id)
        life = None if e is None else self._observed(e, now)
        if e is None or life is None:
            return None
        self._roll(e, now)
        value, at = e.recent
        return max(life, (e.high - value) / (now - at)) if now - at >= RATE_WINDOW else life

    # -- internals ----------------------------------------------------------------------------

    def _pool_now(self, now: float) -> float:
        cfg = self.config
        if self.pool_at is not None:
            self.pool = min(float(cfg.count_burst), self.pool + (now - self.pool_at)
                            * cfg.count_burst / cfg.count_burst_seconds)
        self.pool_at = now
        return self.pool

    def _prune(self, members: Collection[str]) -> None:
        """Forget the entries of members the table forgot (their counts stay merged)."""
        for node_id in [i for i in self.entries if i != self.me and i not in members]:
            del self.entries[node_id]

    def _entry(self, node_id: str, now: float) -> _Entry:
        e = self.entries.get(node_id)
        if e is None:
            e = _Entry(0, float(self.config.count_burst), now, 0, now, (0, now), (0, now))
            self.entries[node_id] = e
        return e

    @staticmethod
    def _roll(e: _Entry, now: float) -> None:
        if now - e.mark[1] >= RATE_SPAN:  # the newer anchor becomes the older; a new one now
            e.recent, e.mark = e.mark, (e.high, now)

    def _observed(self, e: _Entry, now: float) -> float | None:
        watched = now - e.since
        return (e.high - e.first) / watched if watched >= RATE_WINDOW else None

    def _median_rate(self, now: float, members: Collection[str]) -> float | None:
        rates = [r for node_id, e in self.entries.items()
                 if (node_id == self.me or node_id in members)
                 and (r := self._observed(e, now)) is not None and r > 0]
        return statistics.median(rates) if rates else None

    def _rate(self, e: _Entry, now: float, median: float | None) -> float:
        cfg = self.config
        if median is None:
            return cfg.count_burst / cfg.count_burst_seconds
        own = self._observed(e, now) or 0.0
        return cfg.count_rate_margin * min(max(own, median), cfg.count_rate_cap * median)
