"""The member table: what this node believes about every other member, and SWIM's rules for
changing that belief.

Rules (SWIM with Lifeguard's suspicion, as memberlist):
- alive(i) replaces anything older than incarnation i; a dead member comes back only so.
- suspect(i) replaces alive(<=i) and suspect(<i); a suspect(i) from another reporter is a
  confirmation that shrinks the timer; when the timer runs out the member is dead.
- dead(i)/left(i) replace alive/suspect(<=i) and are final for that incarnation.
- anything said about this node at its own incarnation or above is refuted: the node moves to
  a higher incarnation and gossips alive (a refuted suspicion wins).
- heard(beat) refreshes an outbound-only member, which nobody can probe: a beat above the
  one of its own last message here (a relay of a made-up higher beat stops nothing).
- a member whose configuration fingerprint differs is never added: it is refused, with the
  differing keys named; nor is a new member while the table holds MAX_MEMBERS (dead ones
  are forgotten after `dead_retention`, making room).
- bounded steps (issue 13): while a message is applied (`limit` set by Control), an update
  whose incarnation is above the highest this node had seen (`ceiling`) plus
  `max_epoch_step` is skipped, and the ceiling grows by that one step at most: one member
  cannot push an incarnation to where `+1` leaves the range peers accept, while honest
  relays that lag an attacker's steps still catch up, one step per message.
Every accepted change is queued for piggybacking. This file owns the table, the suspicion and
retention timers and the piggyback queue; it never sends anything itself and never reads the
clock (`now` is passed in).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from p2ptrain.proto.config import ProtoConfig
from p2ptrain.proto.events import Action, MemberDown, MemberUp, Refused
from p2ptrain.proto.membership.broadcast import BroadcastQueue
from p2ptrain.proto.membership.suspicion import Suspicion, expected_confirmations
from p2ptrain.proto.records import (
    ALIVE,
    DEAD,
    HEARD,
    LEFT,
    SUSPECT,
    MemberInfo,
    Update,
    differing_keys,
)

MAX_REFUSED = 1024  # (node id, incarnation) pairs already refused and reported
MAX_MEMBERS = 4096  # other members known at once: a member may list made-up ones (issue 13)


@dataclass(slots=True)
class Member:
    """This node's belief about one other member."""

    info: MemberInfo
    incarnation: int
    state: str  # alive, suspect, dead or left
    since: float  # when the state last changed
    suspicion: Suspicion | None = None
    beat: int = 0  # newest liveness counter heard (outbound-only members)
    told: int = 0  # the counter of its own last message to this node
    heard_at: float = 0.0  # when that counter (or a new incarnation) was heard
    entry: Update | None = None  # cached listing entry; None after any change

    @property
    def live(self) -> bool:
        return self.state == ALIVE or self.state == SUSPECT


class MemberTable:
    """Members other than this node, plus this node's own incarnation."""

    def __init__(self, config: ProtoConfig, me: MemberInfo, incarnation: int):
        self.config = config
        self.me = me
        self.incarnation = incarnation
        self.members: dict[str, Member] = {}
        self.queue = BroadcastQueue()
        self.leaving = False
        self.live_count = 1  # live members including this node
        self._timers: list[tuple[float, str]] = []  # (suspicion deadline, node id), lazy
        self._forget: list[tuple[float, str]] = []  # (retention end, node id), lazy
        self._refused: set[tuple[str, int]] = set()
        self.fresh: list[str] = []  # members that became live since the owner last looked
        self.outbound_ids: set[str] = set()  # known members that are outbound-only
        self.refuted_at = -math.inf  # when this node last refuted a suspicion
        self.suspects: set[str] = set()  # members now suspected
        self.ceiling = incarnation  # highest incarnation seen, of any member or this node
        self.limit = math.inf  # incarnations above this are skipped (set per message)
        self.skipped = 0  # updates skipped for an incarnation too far ahead
        self.full = 0  # new members not added: the table held MAX_MEMBERS

    # -- facts about this node ----------------------------------------------------------------

    def self_update(self) -> Update:
        me = self.me
        return Update(LEFT if self.leaving else ALIVE, me.node_id, self.incarnation,
                      me.node_id, me)

    def refute(self, accused: int, now: float) -> None:
        """Move above incarnation `accused` and gossip that this node is alive."""
        self.incarnation = max(self.incarnation, accused) + 1
        self.ceiling = max(self.ceiling, self.incarnation)
        self.refuted_at = now
        self._gossip(self.self_update())

    def announce(self) -> None:
        """Queue this node's own current state (at start, on leave, after a change)."""
        self._gossip(self.self_update())

    # -- applying updates ---------------------------------------------------------------------

    def apply(self, u: Update, now: float, out: list[Action]) -> None:
        """Apply one (validated) update; append resulting notifications to `out`."""
        if u.incarnation > self.limit:  # too far ahead: the ceiling moves one step instead
            self.skipped += 1
            self.ceiling = max(self.ceiling, int(self.limit))
            return
        if u.incarnation > self.ceiling:
            self.ceiling = u.incarnation
        if u.node_id == self.me.node_id:
            self._about_me(u, now)
        elif u.kind == ALIVE:
            self._alive(u, now, out)
        elif u.kind == SUSPECT:
            self._suspect(u, now)
        elif u.kind == HEARD:
            self._heard(u, now)
        else:
            self._dead(u, now, out)

    def merge_listing(self, entries: tuple[Update, ...], now: float, out: list[Action]) -> None:
        """Merge a full member list. A remote `dead` becomes a local suspicion (as memberlist:
        a node on the far side of a partition must not kill live members outright)."""
        for u in entries:
            if u.kind == DEAD:
                u = Update(SUSPECT, u.node_id, u.incarnation, u.reporter, u.info)
            self.apply(u, now, out)

    def suspect(self, node_id: str, now: float) -> Update | None:
        """This node's own probe failed: suspect the member. Returns the update, if any."""
        m = self.members.get(node_id)
        if m is None or not m.live:
            return None
        u = Update(SUSPECT, node_id, m.incarnation, self.me.node_id)
        self._suspect(u, now)
        return u

    def heard(self, node_id: str, incarnation: int, beat: int, now: float) -> None:
        """A message came straight from `node_id`: gossip its beat if it is outbound-only."""
        m = self.members.get(node_id)
        if m is not None and m.info.outbound_only:
            self._heard(Update(HEARD, node_id, incarnation, self.me.node_id, beat=beat), now,
                        direct=True)

    def _about_me(self, u: Update, now: float) -> None:
        if self.leaving or u.kind == HEARD:
            return
        if u.kind == ALIVE:
            if u.incarnation > self.incarnation or (
                u.incarnation == self.incarnation and u.info != self.me
            ):
                self.refute(u.incarnation, now)
        elif u.incarnation >= self.incarnation:
            self.refute(u.incarnation, now)

    def _alive(self, u: Update, now: float, out: list[Action]) -> None:
        info = u.info
        assert info is not None
        m = self.members.get(u.node_id)
        if m is not None and u.incarnation <= m.incarnation:
            return
        if info.fingerprint != self.me.fingerprint:
            if (u.node_id, u.incarnation) not in self._refused:
                if len(self._refused) >= MAX_REFUSED:  # bounded: forget, maybe say again
                    self._refused.clear()
                self._refused.add((u.node_id, u.incarnation))
                keys = differing_keys(self.me.fingerprint_fields, info.fingerprint_fields)
                out.append(Refused(info.addr, u.node_id, tuple(keys) or ("fingerprint",),
                                   "configuration fingerprint differs", by_peer=False))
            return
        if m is None:
            if len(self.members) >= MAX_MEMBERS:  # bounded (made-up members in a listing)
                self.full += 1
                return
            m = Member(info, u.incarnation, ALIVE, now, heard_at=now)
            self.members[u.node_id] = m
            self.live_count += 1
            self.fresh.append(u.node_id)
            out.append(MemberUp(info, u.incarnation))
        else:
            was_live = m.live
            m.info, m.incarnation, m.suspicion, m.entry = info, u.incarnation, None, None
            m.beat, m.told, m.heard_at = 0, 0, now
            if m.state != ALIVE:
                m.state, m.since = ALIVE, now
            if not was_live:
                self.live_count += 1
                self.fresh.append(u.node_id)
                out.append(MemberUp(info, u.incarnation))
        self.suspects.discard(u.node_id)
        if info.outbound_only:
            self.outbound_ids.add(u.node_id)
        else:
            self.outbound_ids.discard(u.node_id)
        self._gossip(u)

    def _suspect(self, u: Update, now: float) -> None:
        m = self.members.get(u.node_id)
        if m is None or u.incarnation < m.incarnation or not m.live:
            return
        if m.state == SUSPECT and u.incarnation == m.incarnation:
            assert m.suspicion is not None
            if m.suspicion.confirm(u.reporter):
                heapq.heappush(self._timers, (m.suspicion.deadline, u.node_id))
                self._gossip(u)
            return
        cfg, n = self.config, self.live_count
        m.incarnation, m.state, m.since, m.entry = u.incarnation, SUSPECT, now, None
        m.suspicion = Suspicion(now, u.reporter, expected_confirmations(cfg.suspicion_mult, n),
                                cfg.suspicion_min(n), cfg.suspicion_max(n))
        self.suspects.add(u.node_id)
        heapq.heappush(self._timers, (m.suspicion.deadline, u.node_id))
        self._gossip(u)

    def _dead(self, u: Update, now: float, out: list[Action]) -> None:
        m = self.members.get(u.node_id)
        if m is None or u.incarnation < m.incarnation or not m.live:
            return
        m.incarnation, m.state, m.since, m.suspicion, m.entry = (
            u.incarnation, u.kind, now, None, None)
        self.live_count -= 1
        self.suspects.discard(u.node_id)
        heapq.heappush(self._forget, (now + self.config.dead_retention, u.node_id))
        out.append(MemberDown(u.node_id, u.incarnation, left=u.kind == LEFT))
        self._gossip(u)

    def _heard(self, u: Update, now: float, direct: bool = False) -> None:
        """A beat of an outbound-only member, from itself (`direct`) or relayed. It lives if
        the beat is above what it last told us itself (`told`), not only above the highest
        relayed (`beat`, what is gossiped on): a member relaying a beat of 2^53 made every
        later one look old, the member's own messages too, and it was suspected while it
        spoke to us. Its own message says its count (a relayed one more than that is news
        again), and one in its name with a made-up count is undone by its next."""
        m = self.members.get(u.node_id)
        if m is None or not m.live or u.incarnation != m.incarnation:
            return
        news = u.beat > m.told  # (from itself: gossiped on even under a made-up higher beat)
        if direct:
            m.told = u.beat
        if direct or news:
            m.heard_at = now
        if u.beat > m.beat or (direct and news):
            m.beat = max(m.beat, u.beat)
            self.queue.push((HEARD, u.node_id), u, self.config.retransmit_limit(self.live_count))

    def _gossip(self, u: Update) -> None:
        self.queue.push(u.node_id, u, self.config.retransmit_limit(self.live_count))

    # -- timers -------------------------------------------------------------------------------

    def expire(self, now: float, out: list[Action]) -> None:
        """Suspicions that ran out become deaths; long-dead members are forgotten."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, node_id = heapq.heappop(timers)
            m = self.members.get(node_id)
            if m is not None and m.state == SUSPECT and m.suspicion.deadline == deadline:
                self._dead(Update(DEAD, node_id, m.incarnation, self.me.node_id), now, out)
        forget = self._forget
        while forget and forget[0][0] <= now:
            _, node_id = heapq.heappop(forget)
            m = self.members.get(node_id)
            if m is not None and not m.live and m.since + self.config.dead_retention <= now:
                del self.members[node_id]
                self.queue.discard(node_id)
                self.outbound_ids.discard(node_id)

    def next_deadline(self) -> float | None:
        if not self._timers and not self._forget:
            return None
        self._drop_stale()
        if self._timers:
            if self._forget:
                return min(self._timers[0][0], self._forget[0][0])
            return self._timers[0][0]
        return self._forget[0][0] if self._forget else None

    def _drop_stale(self) -> None:
        timers = self._timers
        while timers:
            deadline, node_id = timers[0]
            m = self.members.get(node_id)
            if m is not None and m.state == SUSPECT and m.suspicion.deadline == deadline:
                break
            heapq.heappop(timers)
        forget = self._forget
        while forget:
            end, node_id = forget[0]
            m = self.members.get(node_id)
            if m is not None and not m.live and m.since + self.config.dead_retention == end:
                break
            heapq.heappop(forget)

    # -- views --------------------------------------------------------------------------------

    def listing(self) -> tuple[Update, ...]:
        """Every known member (this node first) as list entries, for a full exchange."""
        me = self.me.node_id
        out = [self.self_update()]
        for node_id, m in self.members.items():
            if m.entry is None:
                m.entry = Update(m.state, node_id, m.incarnation, me, m.info)
            out.append(m.entry)
        return tuple(out)

    def state_of(self, node_id: str) -> str | None:
        if node_id == self.me.node_id:
            return LEFT if self.leaving else ALIVE
        m = self.members.get(node_id)
        return None if m is None else m.state
