"""The piggyback queue: membership updates waiting to ride on outgoing messages.

Each update is sent on at most `limit` messages (memberlist's retransmit-limited queue), and
the least-sent, then newest, updates go first, so fresh news spreads before old news is
repeated. A new update about the same member (same key) replaces the queued one: only the
latest fact about a member is worth repeating. A heap with lazy deletion keeps `take` at
O(count * log size) even when hundreds of joins are queued. No clock, no randomness.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from p2ptrain.proto.records import Update


class BroadcastQueue:
    """Updates keyed by what they are about, each with a bounded number of transmissions."""

    __slots__ = ("_heap", "_live", "_order")

    def __init__(self) -> None:
        # entries: [transmits, -order, key, update, limit]; stale entries are skipped
        self._heap: list[list] = []
        self._live: dict[Hashable, list] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._live)

    def push(self, key: Hashable, update: Update, limit: int) -> None:
        """Queue `update` for up to `limit` transmissions, replacing any update for `key`."""
        self._order += 1
        entry = [0, -self._order, key, update, limit]
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()

    def discard(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def take(self, count: int) -> tuple[Update, ...]:
        """Up to `count` updates for one message; each counts one transmission."""
        if not self._live:
            return ()
        out: list[Update] = []
        resend: list[list] = []
        heap, live = self._heap, self._live
        while heap and len(out) < count:
            entry = heapq.heappop(heap)
            if live.get(entry[2]) is not entry:
                continue
            out.append(entry[3])
            entry[0] += 1
            if entry[0] < entry[4]:
                resend.append(entry)
            else:
                del live[entry[2]]
        for entry in resend:
            heapq.heappush(heap, entry)
        return tuple(out)

    def peek(self, count: int) -> tuple[Update, ...]:
        """The updates `take` would return, without counting a transmission (for messages
        to members that may be dead: a refutation must not be spent on them)."""
        if not self._live:
            return ()
        out: list[Update] = []
        popped: list[list] = []
        heap, live = self._heap, self._live
        while heap and len(out) < count:
            entry = heapq.heappop(heap)
            if live.get(entry[2]) is entry:
                out.append(entry[3])
                popped.append(entry)
        for entry in popped:
            heapq.heappush(heap, entry)
        return tuple(out)

    def pending(self) -> list[Update]:
        """The queued updates, for inspection (no transmission counted)."""
        return [entry[3] for entry in self._live.values()]

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2]) is e]
        heapq.heapify(self._heap)
