"""Membership: SWIM probing, piggybacked gossip, full exchanges, joining and rejoining.

It composes the member table (the rules), the prober (failure detection) and three timers:
a full member-list exchange with one random live member every `sync_interval` (push-pull
anti-entropy: knowledge spreads in O(log N) exchanges), one with a random *dead* member or
unanswered seed every `reconnect_interval` (so the halves of a healed partition, or two groups
that booted apart, find each other again), and,
while the node knows nobody, a retry of its seeds every `join_retry`. Outbound-only members
cannot be probed: whoever hears from one gossips its liveness beat, and a member silent for
`outbound_timeout` is suspected like a failed probe. Every header says how many live members
its sender knows; one that knows more is asked for its list next period, and an exchange
whose two lists differed is repeated next period, so a forming swarm converges in O(log N)
rounds. The swarm sample G-counter rides along; what a peer reports of it is bounded by
`SampleGuard` (samples.py) before it is merged.

This file owns those timers and the membership bodies (Ping, Ack, PingReq, Sync*, Refuse,
Leave); it never touches election state, never wraps envelopes (Control does), and never
reads the clock or global randomness.
"""

from __future__ import annotations

import random

from p2ptrain.proto.config import ProtoConfig
from p2ptrain.proto.events import Action, Refused
from p2ptrain.proto.membership.holdings import Holdings
from p2ptrain.proto.membership.probe import Prober
from p2ptrain.proto.membership.samples import SampleGuard
from p2ptrain.proto.membership.table import MemberTable
from p2ptrain.proto.messages import (
    Ack,
    Body,
    Header,
    Leave,
    Out,
    Ping,
    PingReq,
    Refuse,
    SyncReply,
    SyncRequest,
)
from p2ptrain.proto.records import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    MemberInfo,
    Update,
    differing_keys,
)
from p2ptrain.swarmcount import SwarmCount

MAX_SEEDS = 64  # discovered addresses kept (the most recent)

class Membership:
    """One node's membership protocol."""

    def __init__(self, config: ProtoConfig, me: MemberInfo, incarnation: int, now: float,
                 rng: random.Random):
        self.config = config
        self.rng = rng
        self.table = MemberTable(config, me, incarnation)
        self.prober = Prober(config, self.table, rng, now)
        self.samples = SwarmCount()  # samples processed per node id (grow-only, merged by max)
        self.sample_guard = SampleGuard(config, me.node_id)  # what one entry may grow by
        self.holdings = Holdings(me.node_id)  # who holds which checkpoint
        self.seeds: dict[str, None] = {}  # addresses discovered, in order (a set that keeps order)
        # The first exchange comes one period after start; it is repeated every period for as
        # long as exchanges teach something new (a forming swarm), then every sync_interval.
        self.next_sync = now + config.probe_interval * (1.0 + rng.random())
        self.next_reconnect = now + config.reconnect_interval * (0.5 + 0.5 * rng.random())
        self.next_join: float | None = None
        self.pull_from: tuple[str, str] | None = None  # a member that knows more than we do
        # whom the last sync pulled from on such a hint: its next hint waits a sync (a
        # member whose every header claimed 2^53 members took every sync, random ones none)
        self.pulled: str | None = None
        self.table.announce()

    @property
    def me(self) -> MemberInfo:
        return self.table.me

    # -- timers -------------------------------------------------------------------------------

    def next_deadline(self) -> float:
        deadline = self.prober.next_deadline()
        if self.next_sync < deadline:
            deadline = self.next_sync
        if self.next_reconnect < deadline:
            deadline = self.next_reconnect
        table_deadline = self.table.next_deadline()
        if table_deadline is not None and table_deadline < deadline:
            deadline = table_deadline
        if self.next_join is not None and self.next_join < deadline:
            deadline = self.next_join
        return deadline

    def tick(self, now: float, msgs: list[Out], actions: list[Action]) -> None:
        table, cfg = self.table, self.config
        table.expire(now, actions)
        periods = self.prober.periods
        self.prober.tick(now, msgs)
        if self.prober.periods != periods:
            self._check_outbound(now)
        if now >= self.next_sync:
            self.next_sync = now + cfg.sync_interval
            pull, self.pull_from = self.pull_from, None
            m = table.members.get(pull[0]) if pull is not None else None
            if m is not None and m.live and not m.info.outbound_only:
                self._sync(m.info.node_id, m.info.addr, msgs)
                self.pulled = m.info.node_id
            else:
                self._sync_random(msgs, lambda m: m.state == ALIVE)
                self.pulled = None
        if now >= self.next_reconnect:
            self.next_reconnect = now + cfg.reconnect_interval
            self._reconnect(msgs)
        if self.next_join is not None and now >= self.next_join:
            self.next_join = None
            if table.live_count == 1 and self.seeds:
                self._sync(None, self.rng.choice(list(self.seeds)), msgs)
        self._after_change(now)

    def _after_change(self, now: float) -> None:
        table = self.table
        for node_id in table.fresh:
            self.prober.added(node_id)
        table.fresh.clear()
        if (self.next_join is None and table.live_count == 1 and self.seeds
                and not table.leaving):
            self.next_join = now + self.config.join_retry

    def _check_outbound(self, now: float) -> None:
        """Suspect outbound-only members nobody has heard from for `outbound_timeout` (twice
        that if this node is outbound-only too: it hears gossip only in replies)."""
        table = self.table
        limit = now - self.config.outbound_timeout * (2 if self.me.outbound_only else 1)
        for node_id in sorted(table.outbound_ids):  # not hash order: runs must repeat
            m = table.members.get(node_id)
            if m is not None and m.state == ALIVE and m.heard_at < limit:
                table.suspect(node_id, now)

    def _reconnect(self, msgs: list[Out]) -> None:
        """Full exchange with a random dead member or a seed that is no live member: how the
        halves of a partition, or two swarms that booted apart, find each other again."""
        members = self.table.members.values()
        known = {m.info.addr for m in members if m.live or m.info.outbound_only}
        targets = [(m.info.node_id, m.info.addr) for m in members
                   if m.state == DEAD and not m.info.outbound_only]
        known.update(addr for _, addr in targets)
        targets += [(None, a) for a in self.seeds if a not in known]
        if targets:
            self._sync(*self.rng.choice(targets), msgs)

    def _sync_random(self, msgs: list[Out], wanted) -> None:
        peers = [m for m in self.table.members.values()
                 if wanted(m) and not m.info.outbound_only]
        if peers:
            m = self.rng.choice(peers)
            self._sync(m.info.node_id, m.info.addr, msgs)

    def _sync(self, to: str | None, addr: str, msgs: list[Out]) -> None:
        msgs.append(Out(to, addr, SyncRequest(self.table.listing(), self.samples.as_dict(),
                                              self.holdings.listing(self.table.members))))

    # -- driver input -------------------------------------------------------------------------

    def discovered(self, now: float, addr: str, msgs: list[Out]) -> None:
        """A new address: join through it unless it is a live member already."""
        if addr == self.me.addr or self.table.leaving:
            return
        self.seeds.pop(addr, None)
        self.seeds[addr] = None  # most recent last
        while len(self.seeds) > MAX_SEEDS:  # announcements are unauthenticated (mDNS): bound
            del self.seeds[next(iter(self.seeds))]
        if any(m.info.addr == addr and m.live for m in self.table.members.values()):
            return
        self._sync(None, addr, msgs)
        self._after_change(now)

    def set_own_samples(self, samples: int, now: float) -> None:
        self.sample_guard.own(samples, now)
        self.samples.merge({self.me.node_id: samples})

    def admit_samples(self, counts: dict[str, int], now: float) -> dict[str, int]:
        """The part of a peer's counter this node may merge now (samples.py)."""
        return self.sample_guard.admit(counts, now, self.table.members)

    def leave(self, now: float, msgs: list[Out]) -> None:
        """Announce departure to every live member that accepts connections."""
        table = self.table
        table.leaving = True
        table.announce()
        self.next_join = None
        for node_id, m in table.members.items():
            if m.live and not m.info.outbound_only:
                msgs.append(Out(node_id, m.info.addr, Leave()))

    # -- messages -----------------------------------------------------------------------------

    def on_header(self, now: float, header: Header, actions: list[Action]) -> None:
        """Everything a message says besides its body: liveness, samples, piggyback."""
        table = self.table
        sender = header.sender
        if sender in table.outbound_ids:
            table.heard(sender, header.incarnation, header.beat, now)
        if header.samples > self.samples.get(sender):
            self.samples.merge(self.admit_samples({sender: header.samples}, now))
        for update in header.updates:
            table.apply(update, now, actions)
        if header.live > table.live_count and self.pull_from is None and sender != self.pulled:
            # The sender knows members we do not: pull its list next period.
            self.pull_from = (sender, header.addr)
            self.next_sync = min(self.next_sync, now + self.config.probe_interval)
        m = table.members.get(sender)
        if m is not None and m.incarnation > header.incarnation and m.live:
            # A restarted member still speaks with its new, lower incarnation: tell it what
            # we believe, so it refutes and moves above its previous life.
            table.queue.push(sender, Update(ALIVE, sender, m.incarnation,
                                            self.me.node_id, m.info),
                             self.config.retransmit_limit(table.live_count))
        self.holdings.heard(sender, header.holds, table.members)
        if table.fresh:
            self._after_change(now)

    def on_body(self, now: float, header: Header, body: Body, addr: str, msgs: list[Out],
                actions: list[Action]) -> None:
        kind = type(body)
        sender = header.sender
        if kind is Ping:
            self.prober.on_ping(sender, addr, body, msgs)
        elif kind is Ack:
            self.prober.on_ack(body, msgs)
        elif kind is PingReq:
            self.prober.on_ping_req(sender, addr, body, now, msgs)
        elif kind is SyncRequest or kind is SyncReply:
            live = self.table.live_count
            self.table.merge_listing(body.members, now, actions)
            self.samples.merge(self.admit_samples(body.samples, now))
            self.holdings.merge(body.holdings, self.table.members)
            theirs = sum(1 for u in body.members if u.kind == ALIVE or u.kind == SUSPECT)
            if self.table.live_count > live or theirs != self.table.live_count:
                # The two lists differed: exchange again next period, not next interval.
                # While a swarm forms this is push-pull every round (O(log N) rounds to full
                # membership); once lists agree, exchanges fall back to sync_interval.
                self.next_sync = min(self.next_sync, now + self.config.probe_interval)
            if kind is SyncRequest:
                msgs.append(Out(sender, addr, SyncReply(
                    self.table.listing(), self.samples.as_dict(),
                    self.holdings.listing(self.table.members)), reply=True))
            self._after_change(now)
        elif kind is Refuse:
            keys = differing_keys(self.me.fingerprint_fields, body.fingerprint_fields)
            actions.append(Refused(addr, sender, tuple(keys), body.reason, by_peer=True))
        elif kind is Leave:
            self.table.apply(Update(LEFT, sender, header.incarnation, sender), now, actions)
            self._after_change(now)

    def refuse(self, header: Header, body: Body, addr: str, msgs: list[Out],
               actions: list[Action]) -> None:
        """The sender's configuration differs: refuse it, naming the keys when we can."""
        theirs = None
        if isinstance(body, SyncRequest | SyncReply):
            theirs = next((u.info.fingerprint_fields for u in body.members
                           if u.node_id == header.sender and u.info is not None), None)
        keys = (tuple(differing_keys(self.me.fingerprint_fields, theirs)) if theirs is not None
                else ("fingerprint",))
        reason = f"configuration differs: {', '.join(keys)}"
        actions.append(Refused(addr, header.sender, keys, reason, by_peer=False))
        if not isinstance(body, Refuse | Ack | SyncReply):  # answer requests only
            msgs.append(Out(header.sender, addr, Refuse(reason, dict(self.me.fingerprint_fields)),
                            reply=True))
