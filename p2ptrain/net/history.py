"""The node's recent past, for the dashboard (`GET /v1/history`): a bounded series of samples
of its status document, traffic rates per member over the last few seconds, and a bounded list
of recent events.

Pure: the driver (watch.py) passes the time in and feeds it status documents and log events;
nothing here reads a clock, sleeps or does I/O. Rates are computed from consecutive samples,
never stored, so thinning the series never leaves a rate that no longer matches its points.
A counter that goes backwards (a node rebuilt under a new incarnation starts its byte counts
again) gives no rate for that interval rather than a negative one.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from typing import Any

# what a point keeps of the status document (cumulative counters and the latest losses)
POINT_KEYS = ("step", "loss", "eval_loss", "average_eval_loss", "samples", "swarm_samples",
              "bytes_in", "bytes_out", "upload_bytes")
# the per-second rates a point carries in the history document: name -> counter it derives from
RATE_OF = {"in_per_s": "bytes_in", "out_per_s": "upload_bytes",
           "samples_per_s": "swarm_samples"}
# events the charts already show, or that repeat every few seconds: never listed
QUIET_EVENTS = frozenset({"progress", "eval", "fetch_progress"})
# an absolute path in a log message: GET /v1/history is open by default, and the node's
# paths (its state directory, the user's home) are not the network's business (routes stay)
_PATH = re.compile(r"(?<![\w/.~:-])/(?!v1/)[^\s'\"()\[\]{},;]+")


def redact(message: str) -> str:
    """`message` with each absolute path cut to its last part (".../step-100")."""
    return _PATH.sub(lambda m: ".../" + (m.group(0).rstrip("/").rsplit("/", 1)[-1] or ""),
                     message)


def rate(earlier: tuple[float, float | None], later: tuple[float, float | None]
         ) -> float | None:
    """Per second between two (time, counter) readings; None without a positive interval,
    a missing reading, or a counter that went backwards."""
    (t0, v0), (t1, v1) = earlier, later
    if v0 is None or v1 is None or t1 <= t0 or v1 < v0:
        return None
    return (v1 - v0) / (t1 - t0)


class Series:
    """At most `capacity` points spaced at least `spacing` seconds apart. When full, every
    other point is dropped and the spacing doubles: the series always spans the whole run, at
    a resolution that halves as the run doubles."""

    def __init__(self, capacity: int = 600, spacing: float = 1.0):
        if capacity < 4:
            raise ValueError(f"a series needs room for 4 points or more, not {capacity}")
        self.capacity, self.spacing = capacity, spacing
        self.points: list[dict[str, Any]] = []  # each {"t": seconds, **POINT_KEYS}

    def add(self, t: float, values: dict[str, Any]) -> bool:
        """Keep a point at time `t` unless it comes sooner than `spacing` after the last one;
        whether it was kept."""
        if self.points and t - self.points[-1]["t"] < self.spacing * 0.999:  # timer jitter
            return False
        if len(self.points) >= self.capacity:
            self.points = self.points[::2]
            self.spacing *= 2
        self.points.append({"t": round(t, 3), **values})
        return True

    def with_rates(self, window: float = 5.0) -> list[dict[str, Any]]:
        """The points, each with its RATE_OF rates: since the last point at least `window`
        seconds before it (the first point, early on; the one before, once points are spaced
        wider), so that counters which move in bursts (gossiped sample counts) still read
        smoothly. None for the first point."""
        out, base = [], 0
        for i, point in enumerate(self.points):
            while base + 1 < i and point["t"] - self.points[base + 1]["t"] >= window:
                base += 1
            before = self.points[base] if base < i else None
            extra = {name: None if before is None else rate(
                (before["t"], before.get(key)), (point["t"], point.get(key)))
                for name, key in RATE_OF.items()}
            out.append({**point, **extra})
        return out


class Rates:
    """Bytes/s received from and sent to each member, over the last `window` seconds of
    readings of their cumulative counters."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self.readings: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()

    def add(self, t: float, counters: dict[str, tuple[int, int]]) -> None:
        """Counters at time t: member id -> (bytes in, bytes out) so far."""
        self.readings.append((t, dict(counters)))
        while len(self.readings) > 2 and self.readings[1][0] <= t - self.window:
            self.readings.popleft()

    def current(self) -> dict[str, dict[str, float | None]]:
        """Member id -> {"in_per_s", "out_per_s"} for members in the first and last reading."""
        if len(self.readings) < 2:
            return {}
        (t0, first), (t1, last) = self.readings[0], self.readings[-1]
        out = {}
        for member, (got, sent) in last.items():
            if member in first:
                was_in, was_out = first[member]
                out[member] = {"in_per_s": rate((t0, was_in), (t1, got)),
                               "out_per_s": rate((t0, was_out), (t1, sent))}
        return out


class Events:
    """The last `capacity` events worth showing a person (not QUIET_EVENTS), absolute paths
    cut to their last part (`redact`). An event that repeats the one before it (same kind
    and message) counts up instead of taking a row.
    Log lines may come from any thread: a lock guards the list."""

    def __init__(self, capacity: int = 100):
        self.rows: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.lock = threading.Lock()

    def add(self, t: float, level: str, event: str, message: str) -> None:
        if event in QUIET_EVENTS:
            return
        message = redact(message)
        with self.lock:
            last = self.rows[-1] if self.rows else None
            if last and (last["event"], last["message"]) == (event, message):
                last["t"], last["repeats"] = t, last["repeats"] + 1
                return
            self.rows.append({"t": t, "level": level, "event": event, "message": message,
                              "repeats": 1})

    def recent(self) -> list[dict[str, Any]]:
        """Oldest first."""
        with self.lock:
            return [dict(row) for row in self.rows]


class History:
    """What the dashboard shows of the past: `sample` a status document now and then (once a
    second), `note` log events as they happen, `document` for GET /v1/history."""

    def __init__(self, capacity: int = 600, window: float = 5.0, events: int = 100):
        self.series = Series(capacity)
        self.rates = Rates(window)
        self.events = Events(events)

    def sample(self, now: float, doc: dict[str, Any]) -> None:
        """One status document (GET /v1/status's). One from a node not started yet (no step)
        is skipped."""
        if doc.get("step") is None:
            return
        self.series.add(now, {key: doc.get(key) for key in POINT_KEYS})
        counters = {m["node_id"]: (m["bytes_in"], m["bytes_out"]) for m in doc["members"]}
        counters[doc["node_id"]] = (doc["bytes_in"], doc["upload_bytes"])  # this node: totals
        self.rates.add(now, counters)

    def note(self, now: float, level: str, event: str, message: str) -> None:
        """One log event."""
        self.events.add(now, level, event, message)

    def document(self, now: float) -> dict[str, Any]:
        """The GET /v1/history document. Times are seconds since the node started; `now` is
        the same clock's present, so a reader can place them on its own clock."""
        return {"now": now, "spacing": self.series.spacing,
                "points": self.series.with_rates(self.rates.window),
                "member_rates": self.rates.current(),
                "events": self.events.recent()}
