"""The discrete-event core: a virtual clock and one seeded, deterministic event queue.

    engine = Engine(seed=7)
    engine.at(1.5, deliver, message)          # call deliver(message) at t = 1.5 s
    timer = engine.after(0.2, tick)           # 0.2 s from now; timer.cancel() drops it
    engine.run_until(60.0)

Events are ordered by (time, sequence number): two events at the same instant run in the
order they were scheduled, so a run depends only on the seed and on what the callbacks do.
Time never runs backwards; scheduling in the past is a caller error. Randomness comes only
from `engine.rng(name)`: one `random.Random` per named stream, derived from the run's seed
and the name, so adding a consumer of randomness in one part of the model does not shift
the draws of another. `engine.np_rng(name)` is the numpy equivalent.

This file owns the clock, the queue and the seed streams. It never reads the wall clock,
sleeps, opens a socket or touches global random state.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np


class SimulationError(RuntimeError):
    """The model misused the engine (an event in the past, a non-finite time)."""


def stream_seed(seed: int, name: str) -> int:
    """A 64-bit seed for the stream `name` of run `seed`, stable across Python versions."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class Timer:
    """A handle on a scheduled event; `cancel()` makes it a no-op when its time comes."""

    __slots__ = ("cancelled", "time")

    def __init__(self, time: float):
        self.time = time
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """Virtual clock + event queue; see the module docstring."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.now = 0.0
        self.events_run = 0  # callbacks executed so far
        self._queue: list[tuple[float, int, Timer, Callable[..., Any], tuple]] = []
        self._seq = 0
        self._streams: dict[str, random.Random] = {}
        self._np_streams: dict[str, np.random.Generator] = {}
        self._stopped = False

    # -- randomness -----------------------------------------------------------------------

    def rng(self, name: str) -> random.Random:
        """The named random stream of this run (created on first use)."""
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = random.Random(stream_seed(self.seed, name))
        return stream

    def np_rng(self, name: str) -> np.random.Generator:
        """The named numpy random stream of this run (created on first use)."""
        stream = self._np_streams.get(name)
        if stream is None:
            stream = np.random.default_rng(stream_seed(self.seed, "np/" + name))
            self._np_streams[name] = stream
        return stream

    # -- scheduling -----------------------------------------------------------------------

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Call fn(*args) at virtual time `time` (>= now)."""
        if not math.isfinite(time):
            raise SimulationError(f"event time {time!r} is not finite")
        if time < self.now:
            raise SimulationError(f"event at {time} is before now ({self.now})")
        timer = Timer(float(time))
        self._seq += 1
        heapq.heappush(self._queue, (timer.time, self._seq, timer, fn, args))
        return timer

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Call fn(*args) `delay` seconds from now (delay >= 0)."""
        if not delay >= 0:
            raise SimulationError(f"negative or undefined delay {delay!r}")
        return self.at(self.now + delay, fn, *args)

    # -- running --------------------------------------------------------------------------

    def step(self) -> bool:
        """Run the next event (skipping cancelled ones); False if the queue is empty."""
        queue = self._queue
        while queue:
            time, _, timer, fn, args = heapq.heappop(queue)
            if timer.cancelled:
                continue
            self.now = time
            self.events_run += 1
            fn(*args)
            return True
        return False

    def run_until(self, time: float) -> None:
        """Run every event due at or before `time`, then set the clock to `time` (unless
        `stop()` was called, which leaves the clock at the stopping event)."""
        queue = self._queue
        self._stopped = False
        while queue and queue[0][0] <= time and not self._stopped:
            self.step()
        if not self._stopped:
            self.now = max(self.now, float(time))

    def run(self, max_events: int | None = None) -> None:
        """Run until the queue is empty, `stop()` is called, or `max_events` have run."""
        self._stopped = False
        count = 0
        while not self._stopped and (max_events is None or count < max_events):
            if not self.step():
                break
            count += 1

    def stop(self) -> None:
        """Make the running `run`/`run_until` return after the current event."""
        self._stopped = True

    def pending(self) -> int:
        """Scheduled events not yet run (cancelled ones included until they are popped)."""
        return len(self._queue)

    def next_time(self) -> float | None:
        """Time of the next scheduled event that is not cancelled, or None."""
        queue = self._queue
        while queue and queue[0][2].cancelled:
            heapq.heappop(queue)
        return queue[0][0] if queue else None
