"""The typed messages of the control plane and the one table that maps them to wire ids.

A message is an `Envelope`: a `Header` every message carries (sender, incarnation,
fingerprint, the sender's leader view, piggybacked membership updates) and a body, a frozen
slotted dataclass registered here under a one-byte type id. Bodies of the control plane use
ids 1-31; gradient gossip and parameter averaging take 32-63; 64-255 are free. Registering a
body (`@register(id)`) compiles its wire schema at import and refuses a taken id or a field
type the wire cannot carry, so a mistake fails at once. A body may define `check()` to refuse
field values a peer must not send (ValueError); the decoder calls it.

This file owns the message shapes and the registry; field conversion lives in `schema.py`,
framing in `wire.py`. It never does I/O and holds no state besides the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass

from p2ptrain.proto import schema
from p2ptrain.proto.records import (
    MAX_TERM,
    Holding,
    LeaderView,
    MemberInfo,
    Update,
    check_count,
    check_epoch,
    check_node_id,
    check_text,
)

PROTOCOL_VERSION = 6  # bumped on any incompatible change to shapes or meaning (6: pair keys)


class Body:
    """Base of every message body: subclasses are frozen slotted dataclasses."""

    __slots__ = ()

    def check(self) -> None:
        """Raise ValueError if a field holds a value a peer must not send."""


BODY_TYPES: dict[int, type[Body]] = {}  # wire id -> body class
TYPE_IDS: dict[type[Body], int] = {}  # body class -> wire id


def register(type_id: int) -> Callable[[type[Body]], type[Body]]:
    """Class decorator: give a body class its wire id (1..255, unique)."""

    def add(cls: type[Body]) -> type[Body]:
        if not isinstance(type_id, int) or not 1 <= type_id <= 255:
            raise TypeError(f"{cls.__name__}: type id must be in 1..255")
        if type_id in BODY_TYPES or cls in TYPE_IDS:
            raise TypeError(f"{cls.__name__}: type id {type_id} or class already registered")
        if not is_dataclass(cls) or not issubclass(cls, Body):
            raise TypeError(f"{cls.__name__} must be a dataclass subclassing Body")
        schema.compile_class(cls)  # refuses field types the wire cannot carry
        BODY_TYPES[type_id] = cls
        TYPE_IDS[cls] = type_id
        return cls

    return add


@dataclass(frozen=True, slots=True)
class Header:
    """What every message carries besides its body."""

    version: int  # PROTOCOL_VERSION of the sender
    sender: str  # node id
    incarnation: int  # sender's incarnation when it sent
    addr: str  # where the sender accepts requests
    fingerprint: str  # sender's configuration fingerprint
    samples: int  # samples the sender has processed (its entry of the swarm G-counter)
    beat: int  # sender's liveness counter (protocol periods); gossiped for outbound-only nodes
    live: int  # live members the sender knows, itself included (a cheap membership digest)
    view: LeaderView | None  # whom the sender follows, with the newest heartbeat it heard
    updates: tuple[Update, ...]  # piggybacked membership updates
    holds: Holding | None = None  # the checkpoint the sender holds (and serves), if any

    def check(self) -> None:
        if self.version != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {self.version}, this node speaks "
                             f"{PROTOCOL_VERSION}")
        check_node_id(self.sender, "sender")
        check_epoch(self.incarnation, "incarnation")
        check_count(self.samples, "samples")
        check_count(self.beat, "beat")
        check_count(self.live, "live")
        check_text(self.addr, "addr")
        check_text(self.fingerprint, "fingerprint")
        if self.view is not None:
            self.view.check()
        if len(self.updates) > 1024:
            raise ValueError("too many piggybacked updates")
        for update in self.updates:
            update.check()
        if self.holds is not None:
            self.holds.check()


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message: header plus a registered body."""

    header: Header
    body: Body


# -- failure detection -----------------------------------------------------------------------


@register(1)
@dataclass(frozen=True, slots=True)
class Ping(Body):
    """Are you alive? Answered by an Ack with the same seq."""

    seq: int  # the prober's probe number
    target: str  # node id the prober means (an address may have changed hands)

    def check(self) -> None:
        check_count(self.seq, "seq")
        check_node_id(self.target, "target")


@register(2)
@dataclass(frozen=True, slots=True)
class Ack(Body):
    """`target` is alive: the answer to Ping(seq), or forwarded for a PingReq."""

    seq: int
    target: str  # node id that answered the probe

    def check(self) -> None:
        check_count(self.seq, "seq")
        check_node_id(self.target, "target")


@register(3)
@dataclass(frozen=True, slots=True)
class PingReq(Body):
    """Probe `target` for me and forward its Ack (indirect probe)."""

    seq: int
    target: str
    target_addr: str

    def check(self) -> None:
        check_count(self.seq, "seq")
        check_node_id(self.target, "target")
        check_text(self.target_addr, "target_addr")


@register(4)
@dataclass(frozen=True, slots=True)
class Notify(Body):
    """No body: carries the header's view and updates (suspicion notices, leader notices)."""


@register(5)
@dataclass(frozen=True, slots=True)
class SyncRequest(Body):
    """Full member-list exchange (push-pull), also how a node joins: here is all I know."""

    members: tuple[Update, ...]  # one entry per known member, the sender's own included
    samples: dict[str, int]  # the swarm sample G-counter as the sender knows it
    holdings: dict[str, Holding] = field(default_factory=dict)  # member -> what it holds

    def check(self) -> None:
        _check_listing(self.members, self.samples, self.holdings)


@register(6)
@dataclass(frozen=True, slots=True)
class SyncReply(Body):
    """The answer to SyncRequest: all the responder knows."""

    members: tuple[Update, ...]
    samples: dict[str, int]
    holdings: dict[str, Holding] = field(default_factory=dict)

    def check(self) -> None:
        _check_listing(self.members, self.samples, self.holdings)


@register(7)
@dataclass(frozen=True, slots=True)
class Refuse(Body):
    """You cannot be a member here: `reason`, with my fingerprint fields to compare."""

    reason: str
    fingerprint_fields: dict[str, str]

    def check(self) -> None:
        check_text(self.reason, "reason", 1024)
        for key, value in self.fingerprint_fields.items():
            check_text(key, "fingerprint field name", 64)
            check_text(value, "fingerprint field")


@register(8)
@dataclass(frozen=True, slots=True)
class Leave(Body):
    """The sender is shutting down (its own `left` update rides in the header)."""


# -- election ---------------------------------------------------------------------------------


@register(16)
@dataclass(frozen=True, slots=True)
class Claim(Body):
    """The sender claims leadership; the claim is the header's view (seq 0)."""


@register(17)
@dataclass(frozen=True, slots=True)
class Heartbeat(Body):
    """The leader renews its lease; the header's view carries the new seq."""


@register(18)
@dataclass(frozen=True, slots=True)
class Resign(Body):
    """The leader of `term` steps down (shutdown): followers may claim at once."""

    term: int

    def check(self) -> None:
        check_epoch(self.term, "term")


@register(19)
@dataclass(frozen=True, slots=True)
class Yield(Body):
    """I led (or knew of) `term` and now follow you at `winner_term`: move to a term above
    both, so that checkpoint (term, step) keeps growing after two leaders meet."""

    term: int
    winner_term: int

    def check(self) -> None:
        check_epoch(self.term, "term")
        check_epoch(self.winner_term, "winner_term")


def _check_listing(members: tuple[Update, ...], samples: dict[str, int],
                   holdings: dict[str, Holding]) -> None:
    if len(members) > 65536 or len(samples) > 65536 or len(holdings) > 65536:
        raise ValueError("member list too long")
    seen: set[str] = set()
    for update in members:
        update.check()
        if update.info is None:
            raise ValueError("a member list entry must carry the member's info")
        if update.node_id in seen:
            raise ValueError(f"member {update.node_id} listed twice")
        seen.add(update.node_id)
    for node_id, count in samples.items():
        check_node_id(node_id, "sample counter key")
        check_count(count, "sample count")
    for node_id, holding in holdings.items():
        check_node_id(node_id, "holdings key")
        holding.check()


CONTROL_BODIES: tuple[type[Body], ...] = (Ping, Ack, PingReq, Notify, SyncRequest, SyncReply,
                                          Refuse, Leave, Claim, Heartbeat, Resign, Yield)
# Bodies a node accepts from a sender it does not know as a member: joining and probing.
OPEN_BODIES: tuple[type[Body], ...] = (Ping, Ack, SyncRequest, SyncReply, Refuse)



@dataclass(frozen=True, slots=True)
class Out:
    """A body the state machines want sent; Control wraps it in an Envelope (header, piggyback)
    and turns it into a Send action."""

    to: str | None  # node id, or None for a bare address (a seed)
    addr: str
    body: Body
    reply: bool = False  # answers a request from `to`


@dataclass(frozen=True, slots=True)
class ToAll:
    """A body for every live member that accepts connections (heartbeats, claims)."""

    body: Body


__all__ = ["BODY_TYPES", "CONTROL_BODIES", "MAX_TERM", "PROTOCOL_VERSION", "TYPE_IDS", "Ack",
           "Body", "Claim", "Envelope", "Header", "Heartbeat", "LeaderView", "Leave",
           "MemberInfo", "Notify", "Out", "Ping", "PingReq", "Refuse", "Resign", "SyncReply",
           "SyncRequest", "ToAll", "Update", "Yield", "register"]
