"""A join storm: every machine of the fleet joins at once and fetches its checkpoint file in
chunks -- from the leader alone, or from every holder (issue 14). Traffic only: chunk
requests and chunk replies cross the modelled network (links.py, network.py); no weights.

The rules a fetcher keeps (`FetchPolicy` holds the knobs):

- sources: the leader (it holds every file; a joiner starts with it, as the runtime does)
  and, for `sources = "swarm"`, every other machine fetching the same file that it may
  connect to: never into a CGNAT site from outside it; an outbound-only machine only from
  its own LAN (same site), and only if `lan_serving`.
- at most `in_flight` requests to one source (the runtime's fetch keeps 3), `window` in all.
- which source: by measured chunk latency (request sent to last byte in, an EWMA): a queue
  anywhere on the path -- the source's NIC, an access point's air, a Starlink downlink --
  shows up in it. The fastest source that can serve a missing chunk goes first; one slower
  than `slack` times that is left alone (with `prefer_lan`, those on the fetcher's own LAN
  go before the others within slack). Once every `probe_every` chunks received, the source
  measured least recently (never, first) is asked for one chunk, to learn its latency; this
  one request may go beyond the window.
- which chunk: of those the source holds, the rarest on the fetcher's LAN (so what crosses
  a WAN link is what the LAN lacks), then the rarest over the fleet, then the fetcher's own
  random order; leader-only takes them in order.
- the tail (`endgame`): once every missing chunk is asked for, a free slot asks a second,
  other source for the oldest outstanding one (work stealing). The first copy in wins; the
  other's bytes are counted as wasted (the model cannot cancel a transfer under way, so it
  over-charges the tail).
- a chunk can be served from the moment its last byte is in (xxh3 verification is not
  charged); who holds what is known to every fetcher at once. A lost chunk (Starlink's loss
  rule) is asked for again at once.

Pure: virtual time; randomness from the engine's named streams.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from sims import stormbound
from sims.charge import ModelSize
from sims.fleet import Member, World
from sims.metrics import sig
from sims.scenario import CheckpointSpec, Method, Scenario

# The storm computes nothing; World's batch choice sees a one-parameter model.
NO_MODEL = ModelSize("checkpoint only", params=1, flops_per_token=1.0, ctx_len=1,
                     activation_bytes=0)
EWMA = 0.3  # weight of a new latency sample


@dataclass(frozen=True)
class FetchPolicy:
    """How a joiner fetches (a `fetch` method's knobs)."""

    sources: str = "leader"  # "leader" (the runtime today) or "swarm" (every holder)
    in_flight: int = 3  # requests outstanding to one source (net/fetch.py's IN_FLIGHT)
    window: int = 3  # requests outstanding in all
    slack: float = 1.5  # a source slower than this times the fastest usable one is skipped
    probe_every: int = 64  # chunks received between probes (one chunk from the least recently
    #                        measured source): probes are at most 1/probe_every of the bytes
    prefer_lan: bool = False  # among sources within slack, those on the fetcher's LAN first
    lan_serving: bool = True  # outbound-only machines serve their own LAN
    endgame: bool = False  # ask a second source for the last outstanding chunks

    @classmethod
    def of(cls, method: Method) -> FetchPolicy:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(method.params) - known)
        if unknown:
            raise ValueError(f"fetch method {method.name}: unknown knob(s) {', '.join(unknown)}")
        policy = cls(**method.params)
        if policy.sources not in ("leader", "swarm"):
            raise ValueError(f"fetch method {method.name}: sources is leader or swarm")
        if policy.in_flight < 1 or policy.window < 1 or policy.slack < 1:
            raise ValueError(f"fetch method {method.name}: in_flight, window, slack >= 1")
        return policy


@dataclass(eq=False)
class Fetcher:
    """One joining machine's download."""

    index: int  # the member
    file: str  # the file it fetches
    held: np.ndarray  # bool per chunk: in and verified
    requested: np.ndarray  # bool per chunk: a request is out
    order: np.ndarray  # tie-break rank per chunk
    missing: int  # chunks not yet held
    sources: list[int] = field(default_factory=list)  # whom it may ask
    out: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # chunk -> (source, sent)
    per_source: Counter[int] = field(default_factory=Counter)  # requests out per source
    total: int = 0  # requests out
    latency: dict[int, tuple[float, float]] = field(default_factory=dict)  # source -> (EWMA, at)
    probe: tuple[int, int] | None = None  # (source, chunk) of the probe in flight
    since_probe: int = 1 << 30  # chunks received since the last probe was sent
    done_at: float | None = None


def elect(world: World) -> Member:
    """The leader the election would pick: highest (priority, capability, node id) among the
    members that may claim (outbound-only members never do)."""
    claimants = [m for m in world.members if not m.outbound_only]
    return max(claimants, key=lambda m: world.member_info(m).priority_key())


class FetchStorm:
    """Every joiner fetches its file at once; see the module docstring."""

    def __init__(self, world: World, policy: FetchPolicy, spec: CheckpointSpec):
        self.world, self.engine, self.network = world, world.engine, world.network
        self.policy, self.spec = policy, spec
        self.leader = elect(world).index
        self.chunks = {f: -(-size // spec.chunk_bytes) for f, size in spec.files.items()}
        self.everything = {f: np.ones(n, bool) for f, n in self.chunks.items()}
        self.holders = {f: np.ones(n, np.int64) for f, n in self.chunks.items()}
        self.lan_holders = {(f, site.name): np.zeros(n, np.int64) for f, n in self.chunks.items()
                            for site in world.scenario.sites}
        self.fetchers: dict[int, Fetcher] = {}
        for m in world.members:
            if m.index != self.leader:
                self.fetchers[m.index] = self._fetcher(m)
        self.audience: dict[int, list[Fetcher]] = {i: [] for i in self.fetchers}
        for fx in self.fetchers.values():
            fx.sources = self._sources(fx)
            for s in fx.sources:
                if s != self.leader:
                    self.audience[s].append(fx)
        self.served: Counter[str] = Counter()  # useful bytes by route ("lab wifi -> farm")
        self.wasted = 0  # bytes of duplicate chunks (the tail's second copies)
        self.lost = 0  # requests or chunks lost on the way
        self.requests = 0
        self.unfinished = len(self.fetchers)
        for fx in self.fetchers.values():
            self.engine.at(0.0, self.fill, fx)

    def _fetcher(self, m: Member) -> Fetcher:
        file = self.spec.fetch[m.device.name]
        n = self.chunks[file]
        swarm = self.policy.sources == "swarm"
        order = (self.engine.np_rng(f"storm/{m.index}").permutation(n) if swarm
                 else np.arange(n))
        return Fetcher(m.index, file, np.zeros(n, bool), np.zeros(n, bool), order, n)

    def _sources(self, fx: Fetcher) -> list[int]:
        """The leader first, then (swarm) the peers fetching the same file it may ask."""
        out = [self.leader] if self.network.reachable(fx.index, self.leader) else []
        if self.policy.sources == "leader":
            return out
        peers = []
        for g in self.fetchers.values():
            outbound = self.world.members[g.index].outbound_only
            if (g is not fx and g.file == fx.file and self.network.reachable(fx.index, g.index)
                    and (self.policy.lan_serving or not outbound)):
                peers.append(g.index)
        self.engine.rng(f"storm/{fx.index}").shuffle(peers)  # probe order
        return out + peers

    def _held(self, source: int, file: str) -> np.ndarray:
        return self.everything[file] if source == self.leader else self.fetchers[source].held

    # -- choosing ---------------------------------------------------------------------------

    def fill(self, fx: Fetcher) -> None:
        """Ask for chunks until the window is full or nobody can serve a missing one; then,
        if one is due, a probe (outside the window: a full window must not stop a fetcher
        from learning about a faster source)."""
        while fx.missing and fx.total < self.policy.window:
            pick = self._pick(fx)
            if pick is None:
                break
            self._request(fx, *pick)
        if fx.missing and fx.probe is None and fx.since_probe >= self.policy.probe_every:
            need = ~(fx.held | fx.requested)
            for s in sorted(fx.sources, key=lambda s: fx.latency.get(s, (0.0, -1.0))[1]):
                usable = need & self._held(s, fx.file)
                if fx.per_source[s] == 0 and usable.any():
                    fx.since_probe = 0
                    self._request(fx, s, self._rarest(fx, usable), probe=True)
                    return

    def _pick(self, fx: Fetcher) -> tuple[int, int] | None:
        """(source, chunk) of the next request, or None."""
        need = ~(fx.held | fx.requested)
        if not need.any():
            return self._steal(fx) if self.policy.endgame else None
        for s in self._ranked(fx, need):
            if fx.per_source[s] < self.policy.in_flight:
                return s, self._rarest(fx, need & self._held(s, fx.file))
        return None

    def _ranked(self, fx: Fetcher, need: np.ndarray) -> list[int]:
        """The measured sources that hold a chunk in `need` and are within `slack` of the
        fastest of them, fastest first (same LAN first if `prefer_lan`)."""
        measured = []
        for s in fx.sources:
            seen = fx.latency.get(s)
            if seen is None and s == self.leader:
                seen = (0.0, 0.0)  # where every joiner starts
            if seen is not None and (need & self._held(s, fx.file)).any():
                measured.append((seen[0], s))
        if not measured:
            return []
        fastest = min(measured)[0]
        site = self.world.members[fx.index].site
        lan = self.policy.prefer_lan
        return [s for _, _, s in sorted(
            (lan and self.world.members[s].site != site, latency, s)
            for latency, s in measured if latency <= self.policy.slack * fastest)]

    def _rarest(self, fx: Fetcher, usable: np.ndarray) -> int:
        if self.policy.sources == "leader":
            return int(np.argmax(usable))  # in order, as the runtime fetches
        n = len(usable)
        lan = self.lan_holders[fx.file, self.world.members[fx.index].site]
        score = (lan * len(self.fetchers) + self.holders[fx.file]) * n + fx.order
        return int(np.argmin(np.where(usable, score, np.iinfo(np.int64).max)))

    def _steal(self, fx: Fetcher) -> tuple[int, int] | None:
        """A second source for the oldest chunk still out with one request."""
        waiting = sorted((reqs[0][1], c, reqs[0][0]) for c, reqs in fx.out.items()
                         if len(reqs) == 1 and not fx.held[c])
        for _sent, c, first in waiting:
            one = np.zeros_like(fx.held)
            one[c] = True
            for s in self._ranked(fx, one):
                if s != first and fx.per_source[s] < self.policy.in_flight:
                    return s, c
        return None

    # -- moving chunks ----------------------------------------------------------------------

    def _request(self, fx: Fetcher, source: int, chunk: int, probe: bool = False) -> None:
        sent = self.engine.now
        fx.requested[chunk] = True
        fx.out.setdefault(chunk, []).append((source, sent))
        fx.per_source[source] += 1
        fx.total += 1
        if probe:
            fx.probe = (source, chunk)
        self.requests += 1
        ok = self.network.send(fx.index, source, self.spec.request_bytes,
                               lambda: self._serve(fx, source, chunk, sent),
                               on_lost=lambda: self._lost(fx, source, chunk, sent))
        if not ok:
            self.engine.after(0.0, self._lost, fx, source, chunk, sent)

    def _size(self, file: str, chunk: int) -> int:
        start = chunk * self.spec.chunk_bytes
        return min(self.spec.chunk_bytes, self.spec.files[file] - start)

    def _serve(self, fx: Fetcher, source: int, chunk: int, sent: float) -> None:
        self.network.send(source, fx.index, self._size(fx.file, chunk),
                          lambda: self._arrived(fx, source, chunk, sent), reply=True,
                          bulk=True, on_lost=lambda: self._lost(fx, source, chunk, sent))

    def _route(self, source: int, dest: int) -> str:
        src, dst = self.world.members[source], self.world.members[dest]
        who = "leader" if source == self.leader else f"{src.site} {src.medium}"
        return f"{who} -> {dst.site}"

    def _settle(self, fx: Fetcher, source: int, chunk: int, sent: float) -> None:
        """One request's outcome is known: free its slot."""
        reqs = fx.out[chunk]
        reqs.remove((source, sent))
        if not reqs:
            del fx.out[chunk]
            fx.requested[chunk] = False
        fx.per_source[source] -= 1
        fx.total -= 1
        if fx.probe == (source, chunk):
            fx.probe = None

    def _lost(self, fx: Fetcher, source: int, chunk: int, sent: float) -> None:
        self.lost += 1
        self._settle(fx, source, chunk, sent)
        self.fill(fx)

    def _arrived(self, fx: Fetcher, source: int, chunk: int, sent: float) -> None:
        now = self.engine.now
        self._settle(fx, source, chunk, sent)
        old = fx.latency.get(source)
        sample = now - sent
        fx.latency[source] = (sample if old is None else (1 - EWMA) * old[0] + EWMA * sample,
                              now)
        size = self._size(fx.file, chunk)
        fx.since_probe += 1
        if fx.held[chunk]:
            self.wasted += size
            self.fill(fx)
            return
        fx.held[chunk] = True
        fx.missing -= 1
        self.holders[fx.file][chunk] += 1
        self.lan_holders[fx.file, self.world.members[fx.index].site][chunk] += 1
        self.served[self._route(source, fx.index)] += size
        if fx.missing == 0:
            fx.done_at = now
            self.unfinished -= 1
            if self.unfinished == 0:
                self.engine.stop()
        for g in self.audience[fx.index]:  # a new holder: peers with room may ask it
            if g.missing and g.total < self.policy.window and not (g.held[chunk]
                                                                   or g.requested[chunk]):
                self.fill(g)
        self.fill(fx)


# -- running and reporting --------------------------------------------------------------


def _machines(world: World, leader: int, spec: CheckpointSpec) -> list[stormbound.Machine]:
    return [stormbound.Machine(f"n{m.index}", m.site, m.medium,
                               m.device.nic_bytes_per_second(m.medium),
                               None if m.index == leader else spec.fetch[m.device.name],
                               m.outbound_only) for m in world.members]


def bounds(world: World, policy: FetchPolicy, leader: int, spec: CheckpointSpec,
           demand: list[stormbound.Machine] | None = None) -> list[stormbound.Bound]:
    """The derived lower bounds for `demand` (default: every joiner) under `policy`."""
    fleet = _machines(world, leader, spec)
    demand = [m for m in fleet if m.file is not None] if demand is None else demand
    sites = {s.name: s for s in world.scenario.sites}
    lead = fleet[leader]
    if policy.sources == "leader":
        return stormbound.leader_only(demand, lead, spec.files, sites)
    return stormbound.from_many(demand, fleet, lead, spec.files, sites, policy.lan_serving)


def _bound_row(found: list[stormbound.Bound]) -> dict[str, Any]:
    b = stormbound.binding(found)
    return {"seconds": sig(b.seconds), "resource": b.resource, "why": b.why}


def _last(times: list[float | None]) -> float | None:
    return None if any(t is None for t in times) else sig(max(times, default=0.0))


def _grouped(world: World, storm: FetchStorm, key) -> dict[str, Any]:
    """For each value of `key(member)` among the joiners: when they all hold their file,
    and the bound on that time (only their bytes counted)."""
    fleet = _machines(world, storm.leader, storm.spec)
    out = {}
    for value in sorted({key(world.members[i]) for i in storm.fetchers}):
        picked = [i for i in storm.fetchers if key(world.members[i]) == value]
        found = bounds(world, storm.policy, storm.leader, storm.spec, [fleet[i] for i in picked])
        out[value] = {"all_hold": _last([storm.fetchers[i].done_at for i in picked]),
                      "bound": _bound_row(found)}
    return out


def run_method(scenario: Scenario, method: Method, seed: int) -> dict[str, Any]:
    """One fetch method in a fresh world: when each machine, class and site holds its file,
    the bounds beside it, the busiest link."""
    world = World(scenario, seed, None, NO_MODEL)
    storm = FetchStorm(world, FetchPolicy.of(method), scenario.checkpoint)
    world.engine.run_until(scenario.duration)
    end = world.engine.now
    found = bounds(world, storm.policy, storm.leader, storm.spec)
    done = [fx.done_at for fx in storm.fetchers.values()]
    all_hold = _last(done)
    name, util = world.network.busiest(end)
    return {
        "name": method.name, "kind": method.kind, "params": dict(method.params),
        "all_hold": all_hold, "simulated_seconds": sig(end),
        "by_class": _grouped(world, storm, lambda m: m.device.name),
        "by_site": _grouped(world, storm, lambda m: m.site),
        "bound": _bound_row(found),
        "bounds": [{"resource": b.resource, "seconds": sig(b.seconds), "why": b.why}
                   for b in sorted(found, key=lambda b: (-b.seconds, b.resource))],
        "ratio_to_bound": (sig(all_hold / stormbound.binding(found).seconds)
                           if all_hold is not None else None),
        "busiest_link": name, "busiest_utilisation": sig(util),
        "links": {r.name: sig(r.utilisation(end)) for r in world.network.resources()
                  if r.bytes},
        "bytes_by_route": dict(sorted(storm.served.items())),
        "wasted_bytes": storm.wasted, "lost_messages": storm.lost,
        "requests": storm.requests, "events": world.engine.events_run,
        "finish_times": sorted(sig(t) for t in done if t is not None),
    }


def summary(scenario: Scenario, seed: int) -> dict[str, Any]:
    """The fleet as the storm sees it: files, who fetches which, the leader."""
    world = World(scenario, seed, None, NO_MODEL)
    spec = scenario.checkpoint
    leader = elect(world)
    groups: dict[tuple, dict[str, Any]] = {}
    for m in world.members:
        key = (m.device.name, m.site, m.medium)
        row = groups.setdefault(key, {
            "device": m.device.name, "site": m.site, "medium": m.medium, "count": 0,
            "file": spec.fetch[m.device.name], "outbound_only": m.outbound_only,
            "nic_mbps": sig(m.device.nic_bytes_per_second(m.medium) * 8 / 1e6)})
        row["count"] += 1
    return {"machines": len(world.members), "groups": list(groups.values()),
            "chunk_bytes": spec.chunk_bytes, "request_bytes": spec.request_bytes,
            "files": {f: {"bytes": size, "chunks": -(-size // spec.chunk_bytes)}
                      for f, size in sorted(spec.files.items())},
            "leader": {"index": leader.index, "device": leader.device.name,
                       "site": leader.site, "medium": leader.medium},
            "sites": [{"name": s.name, "uplink": s.uplink.kind, "up_mbps": s.uplink.up_mbps,
                       "down_mbps": s.uplink.down_mbps, "cgnat": s.uplink.cgnat}
                      for s in scenario.sites]}
