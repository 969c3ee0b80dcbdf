"""The plain records the control plane trades: who a member is (`MemberInfo`), what changed
about it (`Update`), and whom a node follows (`LeaderView`).

They are frozen, slotted values with a `check()` that raises ValueError on anything a peer
must not send (the wire decoder turns that into a remote error); locally built records are
trusted and not re-checked on the hot path. This file also owns the two orderings the
protocol depends on -- a member's election priority and a claim's key -- and the config
fingerprint comparison that names the differing keys. It never holds mutable state.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

NODE_ID_LEN = 32  # hex characters (identity.node_id_of)
MAX_TERM = 2**53  # terms and counters stay exact in JSON
MAX_EPOCH = 2**52  # terms and incarnations a peer may send: +1 locally never leaves the range
MAX_TEXT = 256  # characters in an address, a device class, a fingerprint field

ALIVE, SUSPECT, DEAD, LEFT, HEARD = "alive", "suspect", "dead", "left", "heard"
MEMBER_STATES = (ALIVE, SUSPECT, DEAD, LEFT)
UPDATE_KINDS = (ALIVE, SUSPECT, DEAD, LEFT, HEARD)
_HEX = frozenset("0123456789abcdef")


def is_node_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == NODE_ID_LEN and _HEX.issuperset(value)


def check_node_id(value: object, what: str = "node id") -> None:
    if not is_node_id(value):
        raise ValueError(f"{what} must be {NODE_ID_LEN} lowercase hex characters")


def check_epoch(value: object, what: str) -> None:
    """A term or incarnation: a count that this node may still increment."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_EPOCH:
        raise ValueError(f"{what} must be an integer in 0..2^52")


def check_count(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TERM:
        raise ValueError(f"{what} must be an integer in 0..2^53")


def check_text(value: object, what: str, limit: int = MAX_TEXT) -> None:
    """A peer's text: printed by `status` and logged, so no control characters (a member's
    device class set the terminal's colours and title)."""
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{what} must be a string of at most {limit} characters")
    if not value.isprintable():
        raise ValueError(f"{what} holds control characters")


def fingerprint_of(fields: Mapping[str, str]) -> str:
    """A short stable hash of the configuration fields that must agree across the swarm."""
    blob = json.dumps(dict(sorted(fields.items())), separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def differing_keys(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The fingerprint fields whose values differ (a key missing on one side differs)."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a member says about itself; fixed for one incarnation."""

    node_id: str  # 32 hex characters
    addr: str  # "host:port" where it accepts requests (informational if outbound-only)
    device_class: str  # e.g. "pi4", "laptop", "server"
    capability: float  # capability score from the hardware benchmark (higher is faster)
    priority: int  # configured election priority (higher wins)
    fingerprint: str  # configuration fingerprint; members must agree on it
    fingerprint_fields: dict[str, str]  # the fields behind it, to name what differs
    outbound_only: bool  # cannot accept connections: starts every exchange, never leads

    def priority_key(self) -> tuple[int, float, str]:
        """Election order: configured priority, then capability, then node id."""
        return (self.priority, self.capability, self.node_id)

    def check(self) -> None:
        check_node_id(self.node_id)
        check_text(self.addr, "addr")
        check_text(self.device_class, "device_class")
        check_text(self.fingerprint, "fingerprint")
        if not math.isfinite(self.capability) or self.capability < 0:
            raise ValueError("capability must be finite and >= 0")
        if not -(2**31) <= self.priority < 2**31:
            raise ValueError("priority must fit in 32 bits")
        if len(self.fingerprint_fields) > 64:
            raise ValueError("too many fingerprint fields")
        for key, value in self.fingerprint_fields.items():
            check_text(key, "fingerprint field name", 64)
            check_text(value, f"fingerprint field {key!r}")


@dataclass(frozen=True, slots=True)
class Update:
    """One fact about a member, gossiped by piggyback and listed in full exchanges.

    alive/suspect/dead/left follow SWIM's incarnation rules; `heard` says an outbound-only
    member was heard from with liveness counter `beat` (it cannot be probed)."""

    kind: str  # one of UPDATE_KINDS
    node_id: str  # the member the fact is about
    incarnation: int  # the member's incarnation the fact refers to
    reporter: str  # who asserts it (suspicion confirmations count distinct reporters)
    info: MemberInfo | None = None  # required with alive, optional otherwise
    beat: int = 0  # with heard: the member's liveness counter

    def check(self) -> None:
        if self.kind not in UPDATE_KINDS:
            raise ValueError(f"unknown update kind {self.kind!r}")
        check_node_id(self.node_id)
        check_node_id(self.reporter, "reporter")
        check_epoch(self.incarnation, "incarnation")
        check_count(self.beat, "beat")
        if self.kind == ALIVE and self.info is None:
            raise ValueError("an alive update must carry the member's info")
        if self.info is not None:
            self.info.check()
            if self.info.node_id != self.node_id:
                raise ValueError("update info is about another node")


@dataclass(frozen=True, slots=True)
class Holding:
    """Which checkpoint a member holds, whole or in part (issue 14: any holder serves): the
    leader's (term, step) that names it, its swarm sample count, and a short hash of its
    signed manifest (`digest`), so fetchers know who can serve the very same bytes."""

    term: int
    step: int
    samples: int
    digest: str  # 16 lowercase hex characters (checkpoint.manifest.Manifest.digest)

    def check(self) -> None:
        check_epoch(self.term, "holding term")
        check_count(self.step, "holding step")
        check_count(self.samples, "holding samples")
        if not (isinstance(self.digest, str) and len(self.digest) == 16
                and _HEX.issuperset(self.digest)):
            raise ValueError("holding digest must be 16 lowercase hex characters")


def holding_doc(h: Holding | None) -> dict[str, object] | None:
    """A holding as plain data (status documents)."""
    return None if h is None else {"term": h.term, "step": h.step, "samples": h.samples,
                                   "digest": h.digest}


@dataclass(frozen=True, slots=True)
class LeaderView:
    """Whom a node follows: a claim (term, priority, capability, leader) and the newest
    heartbeat number heard for it. Every message carries its sender's view, so leases are
    renewed by relay as well as by the leader's own heartbeats."""

    term: int  # election term of the claim
    leader: str  # node id of the claimant
    priority: int  # claimant's configured priority
    capability: float  # claimant's capability score
    seq: int  # heartbeat number within the term; 0 is the claim itself

    def key(self) -> tuple[int, int, float, str]:
        """Claims order by (term, priority, id); capability sits in the priority."""
        return (self.term, self.priority, self.capability, self.leader)

    def check(self) -> None:
        check_epoch(self.term, "term")
        check_count(self.seq, "heartbeat seq")
        check_node_id(self.leader, "leader")
        if not math.isfinite(self.capability) or self.capability < 0:
            raise ValueError("capability must be finite and >= 0")
        if not -(2**31) <= self.priority < 2**31:
            raise ValueError("priority must fit in 32 bits")


def claim_key(term: int, info: MemberInfo) -> tuple[int, int, float, str]:
    """The key a member with `info` claims `term` under (same order as LeaderView.key)."""
    return (term, info.priority, info.capability, info.node_id)
