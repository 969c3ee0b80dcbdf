"""Failure detection by probing: one target per protocol period, direct then indirect.

Each period the node pings the next member of a shuffled round-robin list (so every live
member is probed within two passes: the bound the tests hold it to). No ack within
`probe_timeout`: it asks `indirect_probes` other members to ping the target and forward the
ack. No ack by the end of the period: it suspects the target and tells the target directly,
so a live target can refute at once; while any member is suspected, one suspect is also
pinged each period, so its refutation comes back in the ack. Members that cannot accept
connections (outbound-only) are never probed and never asked to relay; their liveness is
gossiped instead (members.py). This file owns the probe list, the probe in flight and the
relays it runs for others; it never changes membership except through
`MemberTable.suspect`, and never reads the clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from p2ptrain.proto.config import ProtoConfig
from p2ptrain.proto.membership.table import Member, MemberTable
from p2ptrain.proto.messages import Ack, Notify, Out, Ping, PingReq

MAX_RELAYS = 1024  # indirect probes run for others at once; more requests are ignored


@dataclass(slots=True)
class _Probe:
    target: str
    addr: str
    seq: int
    indirect_at: float  # when to ask others if no direct ack came
    indirect_sent: bool = False
    acked: bool = False


@dataclass(frozen=True, slots=True)
class _Relay:
    origin: str  # who asked us to probe
    origin_addr: str
    origin_seq: int
    target: str
    expires: float


class Prober:
    """The probing half of SWIM for one node."""

    def __init__(self, config: ProtoConfig, table: MemberTable, rng: random.Random, now: float):
        self.config = config
        self.table = table
        self.rng = rng
        self.order: list[str] = []
        self.index = 0
        self.next_period = now + rng.random() * config.probe_interval  # stagger the fleet
        self.current: _Probe | None = None
        self.relays: dict[int, _Relay] = {}
        self.seq = 0
        self.periods = 0  # protocol periods started (the node's liveness beat)

    @staticmethod
    def probeable(m: Member) -> bool:
        return m.live and not m.info.outbound_only

    def added(self, node_id: str) -> None:
        """A member joined: probe it within this pass, at a random place."""
        if self.index < len(self.order):
            self.order.insert(self.rng.randint(self.index, len(self.order)), node_id)
        else:
            self.order.append(node_id)

    def next_deadline(self) -> float:
        deadline = self.next_period
        p = self.current
        if p is not None and not p.acked and not p.indirect_sent:
            deadline = min(deadline, p.indirect_at)
        if self.relays:
            deadline = min(deadline, min(r.expires for r in self.relays.values()))
        return deadline

    def tick(self, now: float, out: list[Out]) -> None:
        p = self.current
        if p is not None and not p.acked and not p.indirect_sent and now >= p.indirect_at:
            self._ask_others(p, out)
        if now >= self.next_period:
            self._end_period(now, out)
            self._start_period(now, out)
            self.next_period += self.config.probe_interval
            if self.next_period <= now:  # the driver slept through periods: do not catch up
                self.next_period = now + self.config.probe_interval
        if self.relays:
            for seq in [s for s, r in self.relays.items() if r.expires <= now]:
                del self.relays[seq]

    def _end_period(self, now: float, out: list[Out]) -> None:
        p, self.current = self.current, None
        if p is None or p.acked:
            return
        if self.table.suspect(p.target, now) is not None:
            out.append(Out(p.target, p.addr, Notify()))  # the suspicion rides in the header

    def _start_period(self, now: float, out: list[Out]) -> None:
        self.periods += 1
        m = self._next_target()
        if m is not None:
            self.seq += 1
            self.current = _Probe(m.info.node_id, m.info.addr, self.seq,
                                  now + self.config.probe_timeout)
            out.append(Out(m.info.node_id, m.info.addr, Ping(self.seq, m.info.node_id)))
        if self.table.suspects:
            # Also ping one suspect each period: its ack carries its refutation, which
            # gossip alone may never bring (it can be spent on dead members, and an
            # outbound-only node hears gossip only in acks).
            node_id = self.rng.choice(sorted(self.table.suspects))
            s = self.table.members[node_id]
            if (m is None or node_id != m.info.node_id) and self.probeable(s):
                self.seq += 1
                out.append(Out(node_id, s.info.addr, Ping(self.seq, node_id)))

    def _next_target(self) -> Member | None:
        members = self.table.members
        for _ in range(2):
            while self.index < len(self.order):
                m = members.get(self.order[self.index])
                self.index += 1
                if m is not None and self.probeable(m):
                    return m
            self.order = [i for i, m in members.items() if self.probeable(m)]
            self.rng.shuffle(self.order)
            self.index = 0
        return None

    def _ask_others(self, p: _Probe, out: list[Out]) -> None:
        p.indirect_sent = True
        k = self.config.indirect_probes
        if k == 0:
            return
        helpers = [m for i, m in self.table.members.items()
                   if i != p.target and m.state == "alive" and not m.info.outbound_only]
        for m in self.rng.sample(helpers, min(k, len(helpers))):
            out.append(Out(m.info.node_id, m.info.addr, PingReq(p.seq, p.target, p.addr)))
        if not helpers:  # nobody to ask: try once more ourselves
            out.append(Out(p.target, p.addr, Ping(p.seq, p.target)))

    # -- messages -----------------------------------------------------------------------------

    def on_ping(self, sender: str, addr: str, body: Ping, out: list[Out]) -> None:
        if body.target == self.table.me.node_id:
            out.append(Out(sender, addr, Ack(body.seq, body.target), reply=True))

    def on_ack(self, body: Ack, out: list[Out]) -> None:
        p = self.current
        if p is not None and body.seq == p.seq and body.target == p.target:
            p.acked = True
            return
        relay = self.relays.pop(body.seq, None)
        if relay is not None and relay.target == body.target:
            out.append(Out(relay.origin, relay.origin_addr, Ack(relay.origin_seq, body.target),
                           reply=True))

    def on_ping_req(self, sender: str, addr: str, body: PingReq, now: float,
                    out: list[Out]) -> None:
        if body.target == self.table.me.node_id:  # asked to probe ourselves: answer directly
            out.append(Out(sender, addr, Ack(body.seq, body.target), reply=True))
            return
        if len(self.relays) >= MAX_RELAYS:
            return
        self.seq += 1
        self.relays[self.seq] = _Relay(sender, addr, body.seq, body.target,
                                       now + self.config.probe_interval)
        out.append(Out(body.target, body.target_addr, Ping(self.seq, body.target)))
