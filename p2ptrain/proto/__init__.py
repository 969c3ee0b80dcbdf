"""The protocol: wire messages, SWIM-like membership (membership/), lease-based leader
election, gossip training (gossip/: gradient pushes, push-pull averaging) composed with the
learner in one `Node`. This module is the one import surface for the drivers (net/, sims/);
the test harness lives in tests/cluster/.

Pure code (sans-IO): nothing in this package reads the clock, sleeps, uses global random state
or touches sockets, asyncio, aiohttp or zeroconf. Time and seeded generators are arguments.

    from p2ptrain.proto import Control, LAN, MemberInfo, Tick, Received
    ctl = Control(LAN, me, incarnation=1, now=0.0, rng=random.Random(7))
    actions = ctl.handle(now, Received(addr, data))
"""

from p2ptrain.proto import messages, wire  # noqa: E402  (modules of the surface)
from p2ptrain.proto.config import LAN, LOCAL, PRESETS, WAN, ProtoConfig
from p2ptrain.proto.control import Control
from p2ptrain.proto.errors import LocalProtocolError, RemoteProtocolError
from p2ptrain.proto.events import (
    Action,
    AdoptCheckpoint,
    CheckpointFetched,
    Deliver,
    Discovered,
    Evaluated,
    Event,
    FetchCheckpoint,
    Finished,
    Holds,
    Joined,
    LeaderChanged,
    Leave,
    MemberDown,
    MemberUp,
    Offender,
    Progress,
    Reading,
    Received,
    Refused,
    RemoteError,
    RunStep,
    SaveCheckpoint,
    Send,
    StepDone,
    Tick,
    Unanswered,
)
from p2ptrain.proto.gossip.averaging import consensus_distance
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.messages import (
    GOSSIP_BODIES,
    AverageReply,
    AverageRequest,
    GradientPush,
    GradientReply,
    TrackAck,
    TrackPush,
)
from p2ptrain.proto.gossip.mixer import PlainEncoder
from p2ptrain.proto.gossip.peers import PeerTable
from p2ptrain.proto.gossip.plan import AveragingPlan
from p2ptrain.proto.messages import BODY_TYPES, PROTOCOL_VERSION, Body, Envelope, Header, register
from p2ptrain.proto.node import Node, NodeConfig
from p2ptrain.proto.records import (
    Holding,
    LeaderView,
    MemberInfo,
    Update,
    differing_keys,
    fingerprint_of,
)
from p2ptrain.proto.wire import decode, encode

__all__ = [
    "BODY_TYPES", "GOSSIP_BODIES", "LAN", "LOCAL", "PRESETS", "PROTOCOL_VERSION", "WAN", "Action",
    "AdoptCheckpoint", "AverageReply", "AverageRequest", "AveragingPlan", "Body",
    "CheckpointFetched", "Control", "Deliver", "Discovered", "Envelope", "Evaluated", "Event",
    "FetchCheckpoint", "Finished", "GossipConfig", "GradientPush", "GradientReply", "Header",
    "Holding", "Holds", "Joined", "LeaderChanged", "LeaderView", "Leave", "LocalProtocolError",
    "MemberDown", "MemberInfo", "MemberUp", "Node", "NodeConfig", "Offender", "PeerTable",
    "PlainEncoder",
    "Progress", "ProtoConfig", "Reading", "Received", "Refused", "RemoteError",
    "RemoteProtocolError", "RunStep", "SaveCheckpoint", "Send", "StepDone", "Tick", "TrackAck",
    "TrackPush", "Unanswered", "Update",
    "consensus_distance", "decode", "differing_keys", "encode", "fingerprint_of", "messages",
    "register", "wire",
]
