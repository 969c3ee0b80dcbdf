"""What a node measures about each peer's link, and the choice of gossip targets from it.

`PeerStats` is one peer's record: bytes each way, an RTT estimate and a bandwidth estimate
(exponentially weighted moving averages of observations the driver reports), and when it was
last heard from. `PeerTable` keeps the records; `choose_peers` picks `fanout` distinct targets
at random among the eligible ones, each with probability proportional to 1 / (expected time
to deliver a message of the given size) = 1 / (rtt + bytes / bandwidth), so fast, near links
are preferred without starving the others: every eligible peer keeps at least `explore` times
the mean weight, so slow links are still sampled (their estimates stay fresh, and the swarm
stays one well-mixed graph). Peers never measured are given the median of the measured ones.

`give_up_seconds` is how long a request/response with a peer may take before it is given up
(an averaging part): a margin times its expected time from the same estimates, between a floor
(all that is used while nothing is measured) and a ceiling (whatever a peer does, nobody waits
longer). A request given up is evidence too: `with_shortfall` lowers the peer's bandwidth to
what the unfinished transfer proves at most, so the next give-up is longer (by the margin, per
shortfall in a row, up to the ceiling) and the peer is chosen less often meanwhile.

Which peers are eligible (alive, not suspect, compatible, not ourselves) is the caller's
decision. Times are passed in (seconds on any monotonic clock); randomness comes from the
caller's `np.random.Generator`. No I/O, no clock, no global random state.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RTT = 0.05  # seconds assumed when no peer has been measured yet
DEFAULT_BANDWIDTH = 1.25e6  # bytes/s assumed when no peer has been measured (10 Mbit/s)
RATE_BIAS_CAP = 4.0  # a peer's rate weighs at most this many times the upper quartile
MIN_BANDWIDTH_BYTES = 16 << 10  # smaller transfers say little about bandwidth: RTT dominates


@dataclass(frozen=True, slots=True)
class PeerStats:
    """One peer's link measurements. Updates return a new record."""

    bytes_in: int = 0  # bytes received from the peer
    bytes_out: int = 0  # bytes sent to the peer
    rtt: float | None = None  # round-trip time EWMA, seconds (None: never measured)
    bandwidth: float | None = None  # throughput EWMA, bytes/s (None: never measured)
    last_seen: float | None = None  # when the peer was last heard from (caller's clock)

    def seen(self, now: float) -> PeerStats:
        last = now if self.last_seen is None else max(self.last_seen, now)
        return dataclasses.replace(self, last_seen=last)

    def with_rtt(self, seconds: float, now: float, alpha: float) -> PeerStats:
        """Fold in one round trip of `seconds` (e.g. a probe and its answer)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"rtt must be finite and >= 0, got {seconds}")
        return dataclasses.replace(self.seen(now), rtt=_ewma(self.rtt, seconds, alpha))

    def with_transfer(self, sent: int, received: int, seconds: float, now: float,
                      alpha: float) -> PeerStats:
        """Fold in one request/response that moved `sent` + `received` bytes in `seconds`.
        Transfers of MIN_BANDWIDTH_BYTES or more also update the bandwidth, from the time
        left after one RTT (at least a quarter of the total, so a noisy RTT cannot make it
        explode)."""
        if sent < 0 or received < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"bad transfer: {sent}+{received} bytes in {seconds} s")
        record = dataclasses.replace(self.seen(now), bytes_in=self.bytes_in + received,
                                     bytes_out=self.bytes_out + sent)
        moved = sent + received
        if moved < MIN_BANDWIDTH_BYTES or seconds <= 0:
            return record
        busy = max(seconds - (self.rtt or 0.0), 0.25 * seconds)
        return dataclasses.replace(record, bandwidth=_ewma(self.bandwidth, moved / busy, alpha))

    def with_shortfall(self, moved: int, seconds: float) -> PeerStats:
        """A request/response of `moved` bytes (both ways) did not finish in `seconds`: the
        link carried less than moved / seconds, so the bandwidth is lowered to that at most
        (not averaged: the bound is certain). Nothing was heard: `last_seen` stays."""
        if moved < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"bad shortfall: {moved} bytes in {seconds} s")
        if moved < MIN_BANDWIDTH_BYTES or seconds <= 0:
            return self
        bound = moved / seconds
        if self.bandwidth is not None and self.bandwidth <= bound:
            return self
        return dataclasses.replace(self, bandwidth=bound)


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    """The first sample sets the average; later ones move it by alpha of the difference."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return sample if old is None else old + alpha * (sample - old)


class PeerTable:
    """The link records of every peer a node talks to, keyed by node id."""

    def __init__(self, alpha: float = 0.2):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha  # EWMA weight of a new observation
        self._stats: dict[str, PeerStats] = {}

    def get(self, peer: str) -> PeerStats:
        return self._stats.get(peer, PeerStats())

    def __contains__(self, peer: object) -> bool:
        return peer in self._stats

    def __len__(self) -> int:
        return len(self._stats)

    def items(self) -> Iterable[tuple[str, PeerStats]]:
        return self._stats.items()

    def seen(self, peer: str, now: float) -> None:
        self._stats[peer] = self.get(peer).seen(now)

    def observe_rtt(self, peer: str, seconds: float, now: float) -> None:
        self._stats[peer] = self.get(peer).with_rtt(seconds, now, self.alpha)

    def observe_transfer(self, peer: str, sent: int, received: int, seconds: float,
                         now: float) -> None:
        self._stats[peer] = self.get(peer).with_transfer(sent, received, seconds, now,
                                                         self.alpha)

    def observe_shortfall(self, peer: str, moved: int, seconds: float) -> None:
        self._stats[peer] = self.get(peer).with_shortfall(moved, seconds)

    def give_up(self, peer: str, message_bytes: int, *, floor: float, margin: float,
                ceiling: float) -> float:
        return give_up_seconds(self._stats, peer, message_bytes, floor=floor, margin=margin,
                               ceiling=ceiling)

    def forget(self, peer: str) -> None:
        self._stats.pop(peer, None)

    def choose(self, eligible: Iterable[str], fanout: int, rng: np.random.Generator,
               message_bytes: int, explore: float = 0.1,
               rates: Mapping[str, float | None] | None = None,
               power: float = 1.0) -> tuple[str, ...]:
        return choose_peers(eligible, self._stats, fanout, rng, message_bytes, explore, rates,
                            power)

    def choose_partner(self, partners: Iterable[str], rng: np.random.Generator,
                       message_bytes: int, explore: float,
                       rates: Mapping[str, float | None] | None, power: float,
                       known_only: bool) -> str | None:
        """The one averaging partner of an exchange, drawn as `choose` draws (rates weighed
        if given); with `known_only` and `rates`, only among the partners whose rate is known
        (None: none is yet, no exchange now)."""
        if rates is not None and known_only:
            partners = [p for p in partners if rates.get(p) is not None]
        picks = self.choose(partners, 1, rng, message_bytes, explore, rates, power)
        return picks[0] if picks else None


def delivery_seconds(stats: Mapping[str, PeerStats], peers: Iterable[str],
                     message_bytes: int) -> dict[str, float]:
    """Expected seconds to deliver `message_bytes` to each peer: rtt + bytes / bandwidth,
    with the median of the measured peers (else the defaults) for what is unknown."""
    peers = list(peers)
    known = [stats[p] for p in peers if p in stats]
    rtts = [s.rtt for s in known if s.rtt is not None]
    bws = [s.bandwidth for s in known if s.bandwidth is not None and s.bandwidth > 0]
    rtt_prior = statistics.median(rtts) if rtts else DEFAULT_RTT
    bw_prior = statistics.median(bws) if bws else DEFAULT_BANDWIDTH
    out = {}
    for p in peers:
        s = stats.get(p, PeerStats())
        rtt = s.rtt if s.rtt is not None else rtt_prior
        bw = s.bandwidth if s.bandwidth is not None and s.bandwidth > 0 else bw_prior
        out[p] = rtt + max(message_bytes, 0) / bw
    return out


def give_up_seconds(stats: Mapping[str, PeerStats], peer: str, message_bytes: int, *,
                    floor: float, margin: float, ceiling: float) -> float:
    """Seconds to wait for a request/response moving `message_bytes` (both ways together)
    with `peer` before giving it up: `margin` x (rtt + bytes / bandwidth), from the peer's
    estimates, else the median of the measured peers' (a new peer on a slow network is no
    faster than the others); at least `floor`, and exactly `floor` while no bandwidth is
    measured; at most `ceiling` (a ceiling below the floor leaves the floor)."""
    if not (math.isfinite(floor) and floor > 0 and math.isfinite(ceiling)
            and math.isfinite(margin) and margin >= 1 and message_bytes >= 0):
        raise ValueError(f"bad give-up bounds: floor {floor}, margin {margin}, ceiling "
                         f"{ceiling}, {message_bytes} bytes")
    own = stats.get(peer, PeerStats())
    bandwidth, rtt = own.bandwidth, own.rtt
    if bandwidth is None or bandwidth <= 0:
        measured = [s.bandwidth for s in stats.values() if s.bandwidth and s.bandwidth > 0]
        bandwidth = statistics.median(measured) if measured else None
    if rtt is None:
        rtts = [s.rtt for s in stats.values() if s.rtt is not None]
        rtt = statistics.median(rtts) if rtts else 0.0
    if bandwidth is None:
        return floor
    expected = rtt + message_bytes / bandwidth
    return max(floor, min(ceiling, margin * expected))


def fast_pair(mine: float | None, theirs: float | None, others: Iterable[float | None],
              share: float = 0.5) -> bool:
    """Whether two members are both among the swarm's fastest: each one's observed sample
    rate (`mine`, `theirs`; None: not yet observed) is at least `share` of the fastest
    observed among them and `others` -- the fastest counted at most `RATE_BIAS_CAP` x the
    rates' upper quartile, as in a draw, so one inflated count cannot make every pair of a
    fleet slow (in a swarm of a handful the quartile is near the top and it still can)."""
    if mine is None or theirs is None or not (mine > 0 and theirs > 0):
        return False
    known = [mine, theirs, *(r for r in others if r is not None and r > 0)]
    top = min(max(known), RATE_BIAS_CAP * upper_quartile(known))
    return min(mine, theirs) >= share * top


def fast_partners(me: str, partners: Sequence[tuple[str, str]],
                  rate_of: Callable[[str], float | None]) -> list[tuple[str, str]]:
    """The (id, addr) of `partners` that make a `fast_pair` with `me`: none unless `me` is
    one of the fastest itself."""
    rates = {p: rate_of(p) for p, _ in partners}
    mine = rate_of(me)
    return [(p, a) for p, a in partners
            if fast_pair(mine, rates[p], (r for q, r in rates.items() if q != p))]


def upper_quartile(values: Sequence[float]) -> float:
    """The 75th percentile of `values` (the lower of the two ranks around it, so never the
    largest of two or more values): what a peer's rate counts at most `RATE_BIAS_CAP` times
    in a draw. Not the median: in a fleet of half Pis the median is a Pi's rate, and 4x it
    held a server's weight to a desktop's; a minority of members cannot move it far."""
    ordered = sorted(values)
    return ordered[int(0.75 * (len(ordered) - 1))]


def choose_peers(eligible: Iterable[str], stats: Mapping[str, PeerStats], fanout: int,
                 rng: np.random.Generator, message_bytes: int, explore: float = 0.1,
                 rates: Mapping[str, float | None] | None = None,
                 power: float = 1.0) -> tuple[str, ...]:
    """`fanout` distinct peers from `eligible` (all of them, in random order, if fewer),
    drawn without replacement with probability proportional to 1 / delivery time -- times
    the peer's sample rate to the `power` if `rates` are given (unknown or 0: the median of
    the known; at most `RATE_BIAS_CAP` x their upper quartile before the power, so an
    inflated count cannot take every draw) -- floored at `explore` x the mean weight. The
    result depends only on the set of eligible ids, the stats, the rates and the generator's
    state, not on the order the ids are given in."""
    if fanout < 0 or not 0.0 <= explore <= 1.0 or not 1.0 <= power <= 16.0:
        raise ValueError(f"fanout must be >= 0, explore in [0, 1] and power in [1, 16]: "
                         f"{fanout}, {explore}, {power}")
    peers = sorted(set(eligible))
    if fanout == 0 or not peers:
        return ()
    seconds = delivery_seconds(stats, peers, message_bytes)
    weights = np.array([1.0 / max(seconds[p], 1e-9) for p in peers])
    rates = rates or {}
    known = [r for p in peers if (r := rates.get(p)) is not None and r > 0]
    if known:
        mid, top = statistics.median(known), upper_quartile(known)
        # relative to the quartile (a known rate: it weighs 1): at most 4^power, and never
        # all zero by underflow, whatever the rates; at power 1 the rates as they are
        scale = top if power != 1.0 else 1.0
        weights *= [(min(rates.get(p) or mid, RATE_BIAS_CAP * top) / scale) ** power
                    for p in peers]
    np.maximum(weights, explore * weights.mean(), out=weights)
    picks = rng.choice(len(peers), size=min(fanout, len(peers)), replace=False,
                       p=weights / weights.sum())
    return tuple(peers[int(i)] for i in picks)
