"""A training node's knobs beyond the control plane's `ProtoConfig`: the protocol's part of the
[node] section and the [gossip] section (node.py uses them; drivers build them from config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.codecs import DEFAULT_CHUNK
from p2ptrain.options import option
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.mixer import MAX_PEER_CHUNK


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Knobs of a training node beyond the control plane's `ProtoConfig`: the protocol's part
    of the [node] section (fields made with `option`) and the [gossip] section. Constants that
    every driver must agree on (the runtime's outbox, the simulator's network) live here."""

    gossip: GossipConfig = field(default_factory=GossipConfig)  # [gossip]
    min_peers: int = option(1, "peers to find before training starts (or after "
                            "node.join_timeout seconds, alone)", minimum=0)
    join_timeout: float = option(10.0, "seconds to wait for node.min_peers and for a leader "
                                 "to fetch the swarm's checkpoint from before training from the "
                                 "local state", minimum=0)
    join_fetch: bool = option(True, "before the first step, fetch the leader's latest "
                              "checkpoint and adopt its weights when they are newer")
    fetch_attempts: int = option(6, "join-time checkpoint fetches tried (each from the leader "
                                 "of the moment) before training from the local state",
                                 minimum=1)
    fetch_backoff: float = option(1.0, "seconds before the second fetch attempt; doubles after "
                                  "each failure", minimum=0)
    fetch_backoff_max: float = option(30.0, "longest wait between two fetch attempts, seconds",
                                      minimum=0)
    checkpoint_loss_tolerance: float = option(0.25, "a fetched checkpoint whose held-out loss "
                                              "is more than this fraction above the swarm's "
                                              "(else our own replica's) is refused",
                                              minimum=0)
    # Long: on a slow uplink a snapshot takes a minute, and a reply abandoned after its bytes
    # were sent is waste. The floor: a part waits longer on a link measured slow (gossip.
    # average_timeout_margin, up to gossip.average_timeout_max).
    average_timeout: float = option(90.0, "seconds after which an averaging part without a "
                                    "reply is given up, at least (longer on a link measured "
                                    "slow: gossip.average_timeout_margin)", minimum=1)
    bulk_in_flight: int = option(2, "bodies in flight to one peer past which a new gradient "
                                 "push to it is dropped whole (back-pressure, not a queue)",
                                 minimum=1)
    chunk_elems: int = option(DEFAULT_CHUNK, "elements per codec chunk message (peers "
                              "refuse gradient chunks longer than 16,777,216; each chunk a "
                              "peer holds counts 1 KiB against its gossip.queue_bytes)",
                              minimum=1 << 16, maximum=MAX_PEER_CHUNK)
    offender_refusals: int = option(5, "refusals of one member's values within "
                                    "node.offender_window seconds that make it ignored; 0: "
                                    "never", minimum=0)
    offender_window: float = option(60.0, "seconds over which refusals of a member's values "
                                    "are counted", minimum=1)
    offender_cooloff: float = option(300.0, "seconds an offending member is ignored (its "
                                     "messages dropped, never chosen as a partner or source)",
                                     minimum=1)

    def __post_init__(self) -> None:
        if not (self.average_timeout > 0 and self.join_timeout >= 0 and self.min_peers >= 0
                and self.chunk_elems >= 1 and self.bulk_in_flight >= 1):
            raise ValueError("bad node settings")

    @property
    def average_request_timeout(self) -> float:
        """How long a driver lets one averaging request run: a little shorter than the longest
        give-up of a part (it grows with the part's bytes over the measured bandwidth), so the
        driver never cuts a request the protocol still waits for; a reply that lands after
        its part was given up is counted late and ignored."""
        return 0.9 * max(self.average_timeout, self.gossip.average_timeout_max)
