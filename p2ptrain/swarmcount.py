"""The swarm sample count: a grow-only counter per node id (a G-counter).

Each node only ever raises its own entry; merging takes the maximum per entry, so merges are
commutative, associative and idempotent and the total never runs backwards when a node dies
or a message is replayed. The learning-rate schedule and the end of the run follow `total`.
A node merges what peers report only as far as the protocol's sample guard admits it
(p2ptrain/proto/membership/samples.py): one member cannot end the run with a forged count.
Pure data: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_ENTRIES = 16384  # node ids counted at most: entries past it are ignored (a hostile peer
# could otherwise grow the counter, and every message that carries it, without bound)


class SwarmCount:
    def __init__(self, counts: Mapping[str, int] | None = None):
        self._counts: dict[str, int] = {}
        if counts:
            self.merge(counts)

    def add(self, node_id: str, samples: int) -> None:
        """Credit `samples` new samples to `node_id` (the local node)."""
        if samples < 0:
            raise ValueError("a sample count only grows")
        self._counts[node_id] = self._counts.get(node_id, 0) + int(samples)

    def merge(self, other: Mapping[str, int]) -> None:
        for node_id, n in other.items():
            if not isinstance(node_id, str) or not isinstance(n, int) or n < 0:
                raise ValueError(f"bad swarm count entry {node_id!r}: {n!r}")
            if n > self._counts.get(node_id, 0) and (
                    node_id in self._counts or len(self._counts) < MAX_ENTRIES):
                self._counts[node_id] = n

    def get(self, node_id: str) -> int:
        return self._counts.get(node_id, 0)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)
