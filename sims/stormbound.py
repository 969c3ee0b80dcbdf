"""Lower bounds on a join storm's time, derived from the link model's own parameters.

Every machine but the leader fetches one checkpoint file; the leader holds every file. A
bound is the least time some resource of network.py needs for the bytes it must carry,
whatever the schedule: the leader's NIC, a wired machine's NIC, a site's WiFi airtime (each
frame at its station's rate, so a station-to-station relay costs airtime at both ends), a
site's uplink or downlink. The run cannot finish before the largest of them (latencies,
a few tens of ms, are left out).

- leader-only: every byte leaves the leader, so its NIC carries all of them, each site's
  downlink carries all its machines' bytes, and each WiFi site's air carries them once at
  the receiver's rate.
- from-many: the leader must still send one copy of each file somebody needs; a site's
  downlink must carry one copy of each file needed there; the air still carries every byte
  once at the receiver's rate. Behind a downlink the two trade: a byte relayed by a machine
  of the site saves the downlink but costs the relay's airtime too (nothing if the relay is
  wired). The least time over every split (relaying first through the cheapest relay) is the
  site's joint bound. Outbound-only machines relay only if `lan_serving` (they accept
  connections from their own LAN, never from outside).

`demand` is the machines whose completion is bounded (all, one device class, one site);
`fleet` is every machine that may relay. Pure arithmetic: no engine, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

from sims.network import MBIT, Site


@dataclass(frozen=True, slots=True)
class Machine:
    """One machine as the bounds see it."""

    name: str  # "n12": its NIC resources are "n12:tx" and "n12:rx"
    site: str  # its LAN
    medium: str  # "wifi" or "wired"
    rate: float  # bytes/s of its NIC or WiFi station
    file: str | None  # the file it fetches (None: the leader, which holds every file)
    outbound_only: bool  # behind carrier-grade NAT: accepts connections from its LAN only


@dataclass(frozen=True, slots=True)
class Bound:
    """The least time one resource (or two of them, jointly) needs."""

    resource: str  # network.py resource name(s)
    seconds: float  # the least time
    why: str  # what it must carry, in words


def _gb(size: float) -> str:
    return f"{size / 1e9:.3g} GB"


def _air(demand: list[Machine], site: str, sizes: dict[str, int]) -> float:
    """Airtime the site's WiFi stations of `demand` need to receive their files once."""
    return sum(sizes[m.file] / m.rate for m in demand
               if m.site == site and m.medium == "wifi" and m.file is not None)


def _inbound(demand: list[Machine], site: str, sizes: dict[str, int]) -> dict[str, int]:
    """Bytes per file that machines of `demand` at `site` must receive."""
    out: dict[str, int] = {}
    for m in demand:
        if m.site == site and m.file is not None:
            out[m.file] = out.get(m.file, 0) + sizes[m.file]
    return out


def _common(demand: list[Machine], leader: Machine, sizes: dict[str, int],
            sites: dict[str, Site], carried: dict[str, float]) -> list[Bound]:
    """Bounds both strategies share: the wired receivers' NICs and every WiFi site's air
    (with the leader's own sending airtime if it is on WiFi: `carried` bytes per site)."""
    out = []
    wired = [m for m in demand if m.medium == "wired" and m.file is not None]
    if wired:
        slowest = max(wired, key=lambda m: sizes[m.file] / m.rate)
        out.append(Bound(f"{slowest.name}:rx", sizes[slowest.file] / slowest.rate,
                         f"its {_gb(sizes[slowest.file])} into a wired NIC"))
    for site in sites:
        air = _air(demand, site, sizes)
        if leader.medium == "wifi" and leader.site == site:
            air += carried[site] / leader.rate
        if air:
            out.append(Bound(f"{site}:wifi-air", air,
                             "every byte once over the air at its receiver's rate"))
    return out


def leader_only(demand: list[Machine], leader: Machine, sizes: dict[str, int],
                sites: dict[str, Site]) -> list[Bound]:
    """Bounds when the leader alone serves every chunk."""
    total = sum(sizes[m.file] for m in demand if m.file is not None)
    out = _common(demand, leader, sizes, sites, {s: total for s in sites})
    if leader.medium == "wired":
        out.append(Bound(f"{leader.name}:tx", total / leader.rate,
                         f"{_gb(total)}, every byte, from the leader's NIC"))
    away = 0
    for name, site in sites.items():
        inbound = sum(_inbound(demand, name, sizes).values())
        if name != leader.site and inbound:
            away += inbound
            link = site.uplink
            out.append(Bound(f"{name}:{link.kind}-down", inbound / (link.down_mbps * MBIT),
                             f"{_gb(inbound)}, every byte its machines fetch"))
    if away:
        link = sites[leader.site].uplink
        out.append(Bound(f"{leader.site}:{link.kind}-up", away / (link.up_mbps * MBIT),
                         f"{_gb(away)} to the other sites"))
    return out


def _joint(site: Site, inbound: dict[str, int], air: float, relays: dict[str, float],
           sizes: dict[str, int]) -> float:
    """Least time of a site behind a downlink: bytes beyond one copy of a file may come
    from a relay of the site at `relays[file]` s of airtime per byte instead."""
    down_rate = site.uplink.down_mbps * MBIT
    down = sum(inbound.values()) / down_rate
    for cost, file in sorted((c, f) for f, c in relays.items() if f in inbound):
        if down <= air:
            break
        moved = min(inbound[file] - sizes[file], (down - air) / (1 / down_rate + cost))
        down -= moved / down_rate
        air += moved * cost
    return max(down, air)


def from_many(demand: list[Machine], fleet: list[Machine], leader: Machine,
              sizes: dict[str, int], sites: dict[str, Site], lan_serving: bool) -> list[Bound]:
    """Bounds when every holder serves (the leader, and machines that hold a chunk)."""
    needed = {m.file for m in demand if m.file is not None}
    one_copy = sum(sizes[f] for f in needed)
    carried = {s: one_copy for s in sites}
    out = _common(demand, leader, sizes, sites, carried)
    if leader.medium == "wired":
        out.append(Bound(f"{leader.name}:tx", one_copy / leader.rate,
                         f"{_gb(one_copy)}, one copy of each file, from the leader's NIC"))
    away: set[str] = set()
    for name, site in sites.items():
        inbound = _inbound(demand, name, sizes)
        if name == leader.site or not inbound:
            continue
        away |= set(inbound)
        link = site.uplink
        down = f"{name}:{link.kind}-down"
        copies = sum(sizes[f] for f in inbound)
        out.append(Bound(down, copies / (link.down_mbps * MBIT),
                         f"{_gb(copies)}, one copy of each file needed there"))
        relays: dict[str, float] = {}
        for m in fleet:
            if m.site != name or m.file is None or (m.outbound_only and not lan_serving):
                continue
            cost = 0.0 if m.medium == "wired" else 1 / m.rate
            relays[m.file] = min(cost, relays.get(m.file, cost))
        air = _air(demand, name, sizes)
        out.append(Bound(f"{down} + {name}:wifi-air", _joint(site, inbound, air, relays, sizes),
                         "downlink and air jointly: a byte relayed in the site spares the "
                         "downlink but costs the relay's airtime too"))
    if away:
        link = sites[leader.site].uplink
        copies = sum(sizes[f] for f in away)
        out.append(Bound(f"{leader.site}:{link.kind}-up", copies / (link.up_mbps * MBIT),
                         f"{_gb(copies)}, one copy of each file needed elsewhere"))
    return out


def binding(bounds: list[Bound]) -> Bound:
    """The largest bound: the resource that limits the run."""
    return max(bounds, key=lambda b: (b.seconds, b.resource))
