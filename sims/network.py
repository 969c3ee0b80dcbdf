"""The fleet's network: sites, WiFi access points, wired NICs, the links between sites
(Starlink or fibre), NAT, partitions, and per-node traffic counts.

Each site has one WiFi access point (one airtime `Resource` shared by all its stations, both
directions) and a non-blocking wired switch; wired nodes have a transmit and a receive
resource at their NIC rate. A site reaches the other sites through its `Uplink`: one resource
per direction at the uplink's rate, a one-way latency with jitter, and -- for Starlink -- the
satellite reconfiguration every 15 s (a latency spike and a loss burst) and carrier-grade NAT
(nodes at that site cannot be reached from another site: their requests go out, and only the
replies to them come back; within the site they are reachable). Paths:

    wifi -> wifi, same site:   air(src rate), air(dst rate)            (the air, twice)
    wired -> wifi, same site:  src tx, air(dst rate)
    any -> any, other site:    src leg, src site up, dst site down, dst leg

Messages cross a path by the rules of links.py; a small message that is not bulk (a
heartbeat, a claim, a SWIM probe: at most `CONTROL_BYTES`) waits at most `CONTROL_WAIT` for
the backlog at each resource, as packets interleave on a real link. Like the runtime's
outbox, a gradient push (`droppable`) is dropped when two bulk messages to the same peer are
already in flight.
A partition splits nodes into groups that cannot talk (checked at send and at delivery).
Byte counts per node and per resource are kept for the reports. Pure: no clock, no sockets,
randomness from the engine's "network" stream.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from p2ptrain.proto import NodeConfig
from sims.engine import Engine
from sims.links import Hop, Resource, Transfer, constant, never_lost, transmit

# gradient pushes in flight per pair beyond which more are dropped, as the runtime's outbox
MAX_BULK_IN_FLIGHT = NodeConfig().bulk_in_flight
MBIT = 1e6 / 8
# The most a small (not bulk) message waits for the bulk backlog at a resource. A resource
# here serves whole messages first come, first served, but a real link interleaves packets:
# measured in the calibration lab (a namespace's eth0 under `tc tbf rate 30mbit burst 32kb
# latency 50ms`), 1-byte TCP echoes took 4 ms (median; at most 9 ms) during a 40 MiB upload
# that took 11.4 s, where a FIFO of whole messages would have held them up to 11 s. The
# queue's own bound (tbf's latency, an access point's buffer) is what they wait at most;
# the real node's pacer sends them on a control lane ahead of its own bulk (BENCHMARKS §11).
CONTROL_WAIT = 0.05
CONTROL_BYTES = 64 << 10  # a message this small and not bulk is a control message
RETRANSMIT_SECONDS = 0.2  # TCP's retransmission timeout (Linux's minimum RTO)


@dataclass(frozen=True, slots=True)
class Uplink:
    """A site's link to the other sites."""

    kind: str  # "starlink", "fibre", ...
    up_mbps: float  # site -> other sites
    down_mbps: float  # other sites -> site
    latency_ms: float  # one-way, site to the meeting point of the sites
    jitter_ms: float = 0.0  # standard deviation of the latency (normal, floored at half)
    cgnat: bool = False  # carrier-grade NAT: nodes here accept no inbound connections
    loss: float = 0.0  # chance that a message crossing is lost, outside bursts
    reconfig_period: float = 0.0  # s between reconfigurations (0: none)
    reconfig_offset: float = 0.0  # s; time of the first reconfiguration
    burst_seconds: float = 0.0  # how long each reconfiguration disturbs the link
    burst_loss: float = 0.0  # chance that a message crossing during a burst is lost
    burst_latency_ms: float = 0.0  # extra one-way latency during a burst
    queue_limit: float = math.inf  # s of backlog the modem buffers before dropping

    def in_burst(self, start: float, end: float) -> bool:
        """Whether [start, end] meets a reconfiguration window."""
        period = self.reconfig_period
        if period <= 0 or self.burst_seconds <= 0:
            return False
        k = math.floor((end - self.reconfig_offset) / period)
        return k >= 0 and k * period + self.reconfig_offset + self.burst_seconds >= start

    def latency(self, t: float, rng: random.Random) -> float:
        base = self.latency_ms / 1e3
        value = base
        if self.jitter_ms:
            value = max(0.5 * base, base + rng.gauss(0.0, self.jitter_ms / 1e3))
        if self.in_burst(t, t):
            value += self.burst_latency_ms / 1e3
        return value

    def lost(self, start: float, end: float, rng: random.Random) -> bool:
        if self.loss and rng.random() < self.loss:
            return True
        return bool(self.burst_loss) and self.in_burst(start, end) and (
            rng.random() < self.burst_loss)


STARLINK = Uplink("starlink", up_mbps=15.0, down_mbps=100.0, latency_ms=25.0, jitter_ms=5.0,
                  cgnat=True, loss=0.001, reconfig_period=15.0, reconfig_offset=12.0,
                  burst_seconds=0.5, burst_loss=0.5, burst_latency_ms=100.0)
"""Ookla 2024 medians (FIELD-NOTES.md): ~100/15 Mbit/s, ~50 ms RTT; reconfiguration every
15 s (at :12, :27, :42, :57) with latency spikes and loss bursts; CGNAT."""

FIBRE = Uplink("fibre", up_mbps=1000.0, down_mbps=1000.0, latency_ms=2.0, jitter_ms=0.5)
UPLINKS = {"starlink": STARLINK, "fibre": FIBRE}


@dataclass(frozen=True, slots=True)
class Site:
    name: str
    uplink: Uplink = FIBRE
    wifi_latency_ms: float = 2.0  # one air crossing: contention, retries, the AP's forwarding
    wired_latency_ms: float = 0.1  # NIC and switch
    lan_queue_limit: float = math.inf  # s of backlog before tail drop (inf: TCP back-pressure)


@dataclass(eq=False)
class Endpoint:
    """A node's attachment: its site, medium and NIC rate (bytes/s)."""

    key: int
    site: Site
    medium: str  # "wifi" or "wired"
    rate: float
    tx: Resource | None = None  # wired only
    rx: Resource | None = None  # wired only

    @property
    def outbound_only(self) -> bool:
        return self.site.uplink.cgnat


@dataclass
class Traffic:
    """Bytes and messages per node."""

    sent: Counter[int] = field(default_factory=Counter)  # bytes handed to the network
    received: Counter[int] = field(default_factory=Counter)  # bytes delivered
    refused: int = 0  # sends refused outright (NAT, partition)
    dropped: int = 0  # messages lost on the way (queue full, loss, in-flight limit)


class Network:
    """Sites, endpoints and message delivery; see the module docstring."""

    def __init__(self, engine: Engine, sites: Iterable[Site]):
        self.engine = engine
        self.rng = engine.rng("network")
        self.sites = {s.name: s for s in sites}
        self.air = {n: Resource(f"{n}:wifi-air", 1.0, "air") for n in self.sites}
        self.up = {n: Resource(f"{n}:{s.uplink.kind}-up", s.uplink.up_mbps * MBIT, "uplink")
                   for n, s in self.sites.items()}
        self.down = {n: Resource(f"{n}:{s.uplink.kind}-down", s.uplink.down_mbps * MBIT,
                                 "downlink") for n, s in self.sites.items()}
        self.endpoints: dict[int, Endpoint] = {}
        self.groups: dict[int, int] = {}  # partition group per node (absent: 0)
        self.in_flight: Counter[tuple[int, int]] = Counter()
        self.traffic = Traffic()
        self._paths: dict[tuple[int, int], list[Hop]] = {}

    def attach(self, key: int, site: str, medium: str, rate: float) -> Endpoint:
        """Attach node `key` at `site` by `medium` ("wifi"/"wired") at `rate` bytes/s."""
        if site not in self.sites:
            raise ValueError(f"unknown site {site!r}")
        if medium not in ("wifi", "wired"):
            raise ValueError(f"unknown medium {medium!r}")
        ep = Endpoint(key, self.sites[site], medium, rate)
        if medium == "wired":
            ep.tx = Resource(f"n{key}:tx", rate, "nic")
            ep.rx = Resource(f"n{key}:rx", rate, "nic")
        self.endpoints[key] = ep
        self._paths.clear()
        return ep

    # -- paths ----------------------------------------------------------------------------

    def _leg(self, ep: Endpoint, outgoing: bool) -> Hop:
        site = ep.site
        if ep.medium == "wifi":
            return Hop(self.air[site.name], ep.rate, constant(site.wifi_latency_ms / 1e3),
                       queue_limit=site.lan_queue_limit)
        nic = ep.tx if outgoing else ep.rx
        return Hop(nic, None, constant(site.wired_latency_ms / 1e3),
                   queue_limit=site.lan_queue_limit)

    def path(self, src: int, dst: int) -> list[Hop]:
        """The hops a message from node src to node dst crosses (cached)."""
        cached = self._paths.get((src, dst))
        if cached is not None:
            return cached
        a, b = self.endpoints[src], self.endpoints[dst]
        hops = [self._leg(a, True)]
        if a.site.name != b.site.name:
            for site, resources in ((a.site, self.up), (b.site, self.down)):
                link = site.uplink
                hops.append(Hop(resources[site.name], None, link.latency,
                                link.lost if (link.loss or link.burst_loss) else never_lost,
                                link.queue_limit))
        hops.append(self._leg(b, False))
        self._paths[(src, dst)] = hops
        return hops

    def reachable(self, src: int, dst: int, reply: bool = False) -> bool:
        """Whether a message can be sent now: same partition group, and not a request into
        a NATed site from outside it."""
        if self.groups.get(src, 0) != self.groups.get(dst, 0):
            return False
        a, b = self.endpoints[src], self.endpoints[dst]
        return reply or not b.outbound_only or a.site.name == b.site.name

    # -- sending --------------------------------------------------------------------------

    def send(self, src: int, dst: int, size: int, deliver: Callable[[], None], *,
             reply: bool = False, droppable: bool = False, bulk: bool = False,
             on_lost: Callable[[], None] | None = None,
             on_cut: Callable[[], None] | None = None) -> bool:
        """Hand `size` bytes from src to dst; `deliver()` runs when they arrive (if they do),
        `on_lost()` if they are lost on the way (a lossy link: TCP would resend them),
        `on_cut()` if a partition came between the two ends meanwhile (the connection
        fails). False if refused at once (unreachable, or a droppable push over the
        in-flight limit)."""
        if not self.reachable(src, dst, reply):
            self.traffic.refused += 1
            return False
        pair = (src, dst)
        bulk = bulk or droppable
        if droppable and self.in_flight[pair] >= MAX_BULK_IN_FLIGHT:
            self.traffic.dropped += 1
            return False
        if bulk:
            self.in_flight[pair] += 1
        self.traffic.sent[src] += size

        def arrived(_t: Transfer) -> None:
            if bulk:
                self.in_flight[pair] -= 1
            if self.groups.get(src, 0) != self.groups.get(dst, 0):
                self.traffic.dropped += 1
                if on_cut is not None:
                    on_cut()
                return
            self.traffic.received[dst] += size
            deliver()

        def lost(_t: Transfer) -> None:
            if bulk:
                self.in_flight[pair] -= 1
            self.traffic.dropped += 1
            if on_lost is not None:
                on_lost()

        transmit(self.engine, self.path(src, dst), size, self.rng, arrived, lost,
                 CONTROL_WAIT if not bulk and size <= CONTROL_BYTES else math.inf)
        return True

    # -- partitions -----------------------------------------------------------------------

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """Split: nodes in different groups cannot talk; unlisted nodes form group 0."""
        self.groups = {}
        for g, members in enumerate(groups, start=1):
            for key in members:
                self.groups[key] = g

    def heal(self) -> None:
        self.groups = {}

    # -- reports --------------------------------------------------------------------------

    def resources(self) -> list[Resource]:
        out: list[Resource] = []
        for name in self.sites:
            out += [self.air[name], self.up[name], self.down[name]]
        for ep in self.endpoints.values():
            if ep.tx is not None:
                out += [ep.tx, ep.rx]
        return [r for r in out if r is not None]

    def busiest(self, until: float) -> tuple[str, float]:
        """(name, utilisation over [0, until]) of the most used resource."""
        best = ("-", 0.0)
        for r in self.resources():
            u = r.utilisation(until)
            if u > best[1]:
                best = (r.name, u)
        return best
