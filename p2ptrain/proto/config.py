"""Timing and sizing knobs of the control plane, with presets, and the formulas built on them.

Every period, timeout and multiplier that membership and election use lives in `ProtoConfig`
(one comment per field), so a driver, the harness and the simulator tune one object. The
formulas here -- suspicion timeouts, retransmit limits, and the bounds the invariant tests
hold the protocol to -- are pure functions of the config and the member count. Presets follow
memberlist: `LAN` (one site, WiFi/Ethernet), `WAN` (sites joined by Starlink: longer periods),
`LOCAL` (tests and the in-memory harness: short periods, same proportions). Nothing here reads
the clock or holds state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from p2ptrain.options import option


@dataclass(frozen=True, slots=True)
class ProtoConfig:
    # -- failure detection (SWIM) ------------------------------------------------------------
    probe_interval: float = 1.0  # s; one protocol period: each member probes one other per period
    probe_timeout: float = 0.5  # s; wait for a direct ack before asking others to probe
    indirect_probes: int = 3  # members asked to probe a silent target for us
    suspicion_mult: float = 4.0  # min suspicion = mult * max(1, log10(n)) * probe_interval
    suspicion_max_mult: float = 4.0  # max suspicion = this * min; shrinks with confirmations
    outbound_timeout: float = 8.0  # s; silence after which an outbound-only member is suspected
    # -- dissemination ------------------------------------------------------------------------
    retransmit_mult: int = 4  # an update rides on retransmit_mult * ceil(log10(n + 1)) messages
    max_piggyback: int = 16  # updates piggybacked on one message at most
    sync_interval: float = 10.0  # s; full member-list exchange with one random live member
    reconnect_interval: float = 3.0  # s; full exchange with one random dead member (heals splits)
    join_retry: float = 1.0  # s; retry the seeds while no other member is known
    dead_retention: float = 300.0  # s; a dead member is forgotten this long after its death
    # -- election -----------------------------------------------------------------------------
    heartbeat_interval: float = 0.5  # s; the leader renews its lease this often
    lease: float = 2.0  # s; a follower that hears no newer heartbeat for this long sees a lapse
    claim_backoff: float = 0.5  # s per rank; the k-th best live candidate waits k * this
    # a follower's lease stretches to this many times the slow end (90th percentile) of the
    # recent gaps between renewals it heard -- a slow or busy link keeps its leader -- ...
    lease_gap_mult: float = 3.0
    lease_max_mult: float = 6.0  # ... but never past this many times `lease`
    # -- checkpoints --------------------------------------------------------------------------
    checkpoint_interval: float = 60.0  # s; the leader saves a checkpoint this often
    checkpoint_samples: int = 0  # or after this many swarm samples since the last one (0: off)
    # -- trust bounds (what one member may move) ----------------------------------------------
    max_epoch_step: int = option(1 << 16, "a term or incarnation a peer reports may lead the "
                                 "highest this node has seen by at most this much", minimum=1)
    count_burst: int = option(4096, "samples a swarm-count entry may grow by at once beyond "
                              "its rate", minimum=0)
    count_burst_seconds: float = option(30.0, "seconds of its allowed rate a swarm-count "
                                        "entry may grow by at once, on top of count_burst",
                                        minimum=0.001)
    count_rate_margin: float = option(4.0, "a swarm-count entry may grow this many times "
                                      "faster than its observed rate (at least the median)",
                                      minimum=1)
    count_rate_cap: float = option(64.0, "an entry's observed rate counts up to this many "
                                   "times the swarm's median rate", minimum=1)

    def __post_init__(self) -> None:
        positive = ("probe_interval", "probe_timeout", "suspicion_mult", "outbound_timeout",
                    "sync_interval", "reconnect_interval", "join_retry", "dead_retention",
                    "heartbeat_interval", "lease", "checkpoint_interval")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.probe_timeout >= self.probe_interval:
            raise ValueError("probe_timeout must be shorter than probe_interval")
        if self.suspicion_max_mult < 1:
            raise ValueError("suspicion_max_mult must be >= 1")
        if self.claim_backoff < 0:
            raise ValueError("claim_backoff must be >= 0")
        if self.lease <= self.heartbeat_interval:
            raise ValueError("lease must be longer than heartbeat_interval")
        if self.lease_gap_mult < 1 or self.lease_max_mult < 1:
            raise ValueError("lease_gap_mult and lease_max_mult must be >= 1")
        if not isinstance(self.max_epoch_step, int) or not 1 <= self.max_epoch_step <= 2**32:
            raise ValueError("max_epoch_step must be an int in 1..2^32")
        if not isinstance(self.count_burst, int) or self.count_burst < 0:
            raise ValueError("count_burst must be an int >= 0")
        for name in ("count_burst_seconds", "count_rate_margin", "count_rate_cap"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.count_rate_margin < 1 or self.count_rate_cap < 1:
            raise ValueError("count_rate_margin and count_rate_cap must be >= 1")
        for name in ("indirect_probes", "retransmit_mult", "max_piggyback", "checkpoint_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.retransmit_mult < 1 or self.max_piggyback < 1:
            raise ValueError("retransmit_mult and max_piggyback must be >= 1")

    def with_(self, **changes) -> ProtoConfig:
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)

    # -- formulas -----------------------------------------------------------------------------

    def suspicion_min(self, n: int) -> float:
        """Shortest suspicion timeout among n members: reached with enough confirmations."""
        return self.suspicion_mult * max(1.0, math.log10(max(1, n))) * self.probe_interval

    def suspicion_max(self, n: int) -> float:
        """Suspicion timeout with no independent confirmation."""
        return self.suspicion_max_mult * self.suspicion_min(n)

    def retransmit_limit(self, n: int) -> int:
        """How many messages carry one update among n members."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))

    def detection_bound(self, n: int) -> float:
        """Latest time after a crash by which every live member that knew the crashed member
        has declared it dead: its own round-robin reaches the target within 2(n-1) periods, the
        failed period ends, then the longest suspicion runs (plus one period of slack)."""
        return (2 * (n - 1) + 2) * self.probe_interval + self.suspicion_max(n)

    def outbound_detection_bound(self, n: int) -> float:
        """As `detection_bound`, for an outbound-only member (found by its silence; a witness
        that is outbound-only itself waits twice as long)."""
        return 2 * self.outbound_timeout + 2 * self.probe_interval + self.suspicion_max(n)

    def failover_bound(self, rank: int) -> float:
        """Time after a leader dies within which a member of the given rank (0 = best) has
        claimed, unless someone else claimed first: 2 leases plus the rank back-off (on links
        whose renewals arrive within lease / lease_gap_mult of each other, so the lease has
        not stretched)."""
        return 2 * self.lease + rank * self.claim_backoff


LAN = ProtoConfig()
"""One site: WiFi and Ethernet, sub-10 ms round trips."""

WAN = ProtoConfig(
    probe_interval=5.0,
    probe_timeout=3.0,
    suspicion_mult=6.0,
    outbound_timeout=40.0,
    sync_interval=60.0,
    reconnect_interval=30.0,
    join_retry=5.0,
    dead_retention=1800.0,
    heartbeat_interval=2.0,
    lease=8.0,
    claim_backoff=2.0,
    checkpoint_interval=300.0,
)
"""Sites joined by Starlink or the internet: 50-700 ms round trips, bursts of loss."""

LOCAL = ProtoConfig(
    probe_interval=0.5,
    probe_timeout=0.2,
    suspicion_mult=4.0,
    suspicion_max_mult=3.0,
    outbound_timeout=3.0,
    sync_interval=5.0,
    reconnect_interval=1.5,
    join_retry=0.5,
    dead_retention=120.0,
    heartbeat_interval=0.25,
    lease=1.0,
    claim_backoff=0.25,
    checkpoint_interval=2.0,
)
"""Loopback and the in-memory harness: everything short, same proportions as LAN."""

PRESETS = {"lan": LAN, "wan": WAN, "local": LOCAL}
