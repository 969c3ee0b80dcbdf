"""The swarm's sample rate as one node sees it (`SwarmRate`): what converts the mixer's
staleness bound from seconds to swarm samples (mixer.py). Pure: times are passed in."""

from __future__ import annotations

import math
from collections import deque

RATE_WINDOW = 64  # step boundaries the swarm's sample rate is measured over


class SwarmRate:
    """The swarm's samples per second as one node sees them: the growth of its swarm count (the
    G-counter total) over its last `window` step boundaries, and its own mean step period. A
    count that jumps (a merge that brings old history) inflates the rate -- a looser bound --
    for one window at most; a caller that replaces its replica clears it."""

    def __init__(self, window: int = RATE_WINDOW):
        self._points: deque[tuple[float, int]] = deque(maxlen=max(2, window))

    def observe(self, now: float, total: int) -> None:
        """One step boundary at `now`, when the swarm count was `total`."""
        if not math.isfinite(now) or (self._points and now < self._points[-1][0]):
            raise ValueError(f"bad time {now} for the swarm rate")
        self._points.append((float(now), int(total)))

    def _span(self) -> tuple[float, int] | None:
        if len(self._points) < 2:
            return None
        (t0, c0), (t1, c1) = self._points[0], self._points[-1]
        return (t1 - t0, max(c1 - c0, 0)) if t1 > t0 else None

    @property
    def samples_per_second(self) -> float | None:
        span = self._span()
        return None if span is None else span[1] / span[0]

    @property
    def step_seconds(self) -> float | None:
        span = self._span()
        return None if span is None else span[0] / (len(self._points) - 1)

    def clear(self) -> None:
        self._points.clear()
