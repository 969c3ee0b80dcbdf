"""Link arithmetic: FIFO resources with a rate, and how a message crosses a path of them.

A `Resource` is anything that carries bytes one message at a time at a rate: a wired NIC's
transmit or receive side, the airtime of a WiFi access point (shared by all its stations, in
both directions), one direction of a site's Starlink link. It serves messages first come,
first served: a message of `size` bytes that reaches it at `t` starts at
`max(t, busy_until)` and keeps it busy for `size / rate` seconds. The rate may be given per
message: an access point's air serves each frame at the rate of the station involved, so a
slow station takes more airtime for the same bytes (and traffic between two stations of one
access point crosses the air twice, once at each station's rate).

A message crosses a path of `Hop`s (a resource, a latency after it, a loss rule) cut-through,
not store-and-forward: at each hop it may start as soon as its first byte arrives
(`start_i = max(start_{i-1} + latency_{i-1}, busy_until_i)`) but it cannot finish before
the previous hop has passed its last byte (`end_i = max(start_i + size / rate_i,
end_{i-1} + latency_{i-1})`), and the resource is booked only for its own work
(`size / rate_i`), so a fast receiver fed by a slow sender stays free for other traffic. One
message alone on a path of equal rates therefore takes `size / rate + sum(latencies)`; on an
idle path it takes `size / min(rate) + sum(latencies)`.

A message may be given a `wait_cap` (a small control message, network.py): at each hop it
waits at most that long for the backlog ahead of it -- on a real link its packets go between
the bulk transfers' packets, delayed by the queue's depth, not by whole messages -- and the
backlog is pushed back by its own work.

A hop may drop a message: when its backlog would exceed `queue_limit` seconds (a full
buffer, tail drop), or by its `loss` rule (a function of the interval the message occupies
it, e.g. a Starlink reconfiguration burst). A dropped message still used the hops before.
Pure arithmetic plus the engine's events: no clock, no I/O, randomness from a given stream.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from sims.engine import Engine

LossRule = Callable[[float, float, random.Random], bool]  # (start, end, rng) -> dropped
LatencyRule = Callable[[float, random.Random], float]  # (time, rng) -> seconds


@dataclass(eq=False)
class Resource:
    """A FIFO byte server (one NIC side, an access point's air, a Starlink direction)."""

    name: str
    rate: float  # bytes/s when the message names no rate of its own
    kind: str = "link"  # nic, air, uplink, downlink: for reports
    busy_until: float = 0.0  # when the last booked message leaves
    busy_time: float = 0.0  # seconds of work booked so far
    bytes: int = 0  # bytes booked so far
    messages: int = 0  # messages booked so far
    dropped: int = 0  # messages refused by this resource (queue full or loss)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"resource {self.name}: rate must be > 0")

    def backlog(self, now: float) -> float:
        """Seconds of booked work still ahead of a message arriving now."""
        return max(0.0, self.busy_until - now)

    def serve(self, arrival: float, size: int, rate: float | None = None,
              wait_cap: float = math.inf) -> tuple[float, float]:
        """Book `size` bytes arriving at `arrival`; returns (start, end of its work). A
        message given a `wait_cap` waits at most that long for the backlog ahead of it (it
        goes between the bulk messages' packets) and pushes that backlog back by its work."""
        work = size / (rate or self.rate)
        start = arrival + min(max(0.0, self.busy_until - arrival), wait_cap)
        self.busy_until = max(self.busy_until, start) + work
        self.busy_time += work
        self.bytes += size
        self.messages += 1
        return start, start + work

    def utilisation(self, until: float) -> float:
        """Share of [0, until] this resource was busy (work booked past `until` excluded:
        it is one contiguous stretch, because every booking starts at or after its arrival)."""
        if until <= 0:
            return 0.0
        return max(0.0, self.busy_time - max(0.0, self.busy_until - until)) / until


def constant(seconds: float) -> LatencyRule:
    """A latency rule that always gives `seconds`."""
    return lambda _t, _rng: seconds


def never_lost(_start: float, _end: float, _rng: random.Random) -> bool:
    return False


@dataclass(frozen=True, eq=False)
class Hop:
    """One resource on a path, at a given rate, followed by a latency."""

    resource: Resource
    rate: float | None = None  # this message's rate here (None: the resource's)
    latency: LatencyRule = field(default=constant(0.0))
    loss: LossRule = never_lost
    queue_limit: float = math.inf  # s of backlog beyond which a message is dropped


@dataclass(slots=True)
class Transfer:
    """What happened to one message (filled in as it crosses)."""

    size: int
    sent: float  # when it entered the first hop
    delivered: float | None = None  # when its last byte reached the receiver
    dropped_at: str | None = None  # the resource that dropped it
    wait_cap: float = math.inf  # the most it waits for the backlog at a hop


def transmit(engine: Engine, path: list[Hop], size: int, rng: random.Random,
             on_delivered: Callable[[Transfer], None],
             on_dropped: Callable[[Transfer], None] | None = None,
             wait_cap: float = math.inf) -> Transfer:
    """Send `size` bytes along `path` now; `on_delivered(transfer)` runs when the last byte
    arrives (an empty path delivers at once). `wait_cap`: the most it waits for the backlog
    at each hop (see `Resource.serve`)."""
    transfer = Transfer(size, engine.now, wait_cap=wait_cap)
    if not path:
        transfer.delivered = engine.now
        on_delivered(transfer)
        return transfer
    _cross(engine, path, 0, engine.now, transfer, rng, on_delivered, on_dropped)
    return transfer


def _cross(engine: Engine, path: list[Hop], i: int, prev_end: float, transfer: Transfer,
           rng: random.Random, on_delivered: Callable[[Transfer], None],
           on_dropped: Callable[[Transfer], None] | None) -> None:
    """The message's first byte reaches hop i now; its last byte left hop i-1 at prev_end."""
    hop = path[i]
    resource = hop.resource
    now = engine.now
    if resource.backlog(now) > hop.queue_limit:
        _drop(resource, transfer, on_dropped)
        return
    start, work_end = resource.serve(now, transfer.size, hop.rate, transfer.wait_cap)
    end = max(work_end, prev_end)
    if hop.loss(start, end, rng):
        _drop(resource, transfer, on_dropped)
        return
    delay = hop.latency(start, rng)
    if i + 1 == len(path):
        engine.at(end + delay, _arrive, engine, transfer, on_delivered)
    else:
        engine.at(start + delay, _cross, engine, path, i + 1, end + delay, transfer, rng,
                  on_delivered, on_dropped)


def _arrive(engine: Engine, transfer: Transfer,
            on_delivered: Callable[[Transfer], None]) -> None:
    transfer.delivered = engine.now
    on_delivered(transfer)


def _drop(resource: Resource, transfer: Transfer,
          on_dropped: Callable[[Transfer], None] | None) -> None:
    resource.dropped += 1
    transfer.dropped_at = resource.name
    if on_dropped is not None:
        on_dropped(transfer)
