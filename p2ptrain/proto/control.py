"""The control plane of one node: membership and election behind one sans-IO object.

    ctl = Control(LAN, me, incarnation=identity.incarnation, now=t0, rng=random.Random(seed))
    actions = ctl.handle(now, Discovered("10.0.0.7:7100"))
    ...
    actions = ctl.handle(now, Received(addr, data))   # wire bytes from the transport
    wake_at = ctl.next_deadline()                     # then ctl.handle(wake_at, Tick())

`handle` validates a peer's message completely before changing anything: a malformed or
illegal one (a forged claim from a non-member, a claim whose priority disagrees with the
member's record, a claim, yield or leave more than `max_epoch_step` above the highest term or
incarnation this node has seen) yields a `RemoteError` action and leaves every bit of state as
it was. What a message relays about others is bounded the same way, without refusing the
relay: a view naming a non-member leader is ignored, and a relayed view or update too far
ahead moves this node's term or incarnation ceiling by one step only (election.py,
table.py), so no value a peer can send takes a counter where `+1` leaves the range peers
accept, and honest relays that lag behind an attacker's steps still catch up. A
caller error (time going backwards, an unknown event) raises `LocalProtocolError`. Every
outgoing message gets the same header: sender, incarnation, fingerprint, the leader view this
node follows (so leases renew by relay), and piggybacked membership updates -- `wrap` gives
the same to bodies other layers own (gradient gossip), so membership rides on their traffic.

This file owns the composition and the envelope; the rules live in members.py, probe.py,
membership.py and election.py. It never does I/O, reads the clock or uses global randomness.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from p2ptrain.proto import wire
from p2ptrain.proto.config import ProtoConfig
from p2ptrain.proto.election import Election
from p2ptrain.proto.errors import LocalProtocolError, RemoteProtocolError
from p2ptrain.proto.events import (
    Action,
    Deliver,
    Discovered,
    Event,
    Leave,
    Progress,
    Received,
    RemoteError,
    Send,
    Tick,
)
from p2ptrain.proto.membership.swim import Membership
from p2ptrain.proto.messages import (
    CONTROL_BODIES,
    OPEN_BODIES,
    PROTOCOL_VERSION,
    Ack,
    Body,
    Claim,
    Envelope,
    Header,
    Heartbeat,
    Out,
    Refuse,
    Resign,
    ToAll,
    Yield,
)
from p2ptrain.proto.messages import Leave as LeaveBody
from p2ptrain.proto.records import ALIVE, LeaderView, MemberInfo


class Control:
    """Membership + election for one node; see the module docstring."""

    def __init__(self, config: ProtoConfig, me: MemberInfo, *, incarnation: int, now: float,
                 rng: random.Random, term_floor: int = 0):
        try:
            me.check()
        except (ValueError, TypeError, AttributeError) as exc:
            raise LocalProtocolError(f"bad MemberInfo: {exc}") from None
        if not isinstance(rng, random.Random):
            raise LocalProtocolError("rng must be a seeded random.Random")
        for name, value in (("incarnation", incarnation), ("term_floor", term_floor)):
            if not isinstance(value, int) or value < 0:
                raise LocalProtocolError(f"{name} must be an int >= 0")
        self.config = config
        self.me = me
        self.now = _check_time(now, -math.inf)
        self._wake: float | None = None  # the deadline asked for after the last event
        self.resumes = 0  # pauses noticed (woken more than a lease late)
        # the owner's part of a pause noticed: on_resume(now, seconds late), before the event
        self.on_resume: Callable[[float, float], None] = lambda now, late: None
        self.membership = Membership(config, me, incarnation, now, rng)
        self.election = Election(config, me, now, term_floor)
        self.stopped = False
        self._step = -1
        self._samples = 0
        self._swarm = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.me.node_id

    @property
    def incarnation(self) -> int:
        return self.membership.table.incarnation

    @property
    def is_leader(self) -> bool:
        return self.election.leading

    @property
    def leader(self) -> str | None:
        return self.election.leader

    @property
    def term(self) -> int:
        return self.election.term

    def member_state(self, node_id: str) -> str | None:
        """alive/suspect/dead/left, or None if unknown."""
        return self.membership.table.state_of(node_id)

    def member(self, node_id: str) -> tuple[str, int, MemberInfo] | None:
        """(state, incarnation, info) of one known member, or None."""
        m = self.membership.table.members.get(node_id)
        return None if m is None else (m.state, m.incarnation, m.info)

    def members(self) -> dict[str, tuple[str, int, MemberInfo]]:
        """node id -> (state, incarnation, info) for every known member but this node."""
        return {i: (m.state, m.incarnation, m.info)
                for i, m in self.membership.table.members.items()}

    def status(self) -> list[dict[str, Any]]:
        """Every known member, this node first, as plain data (for /v1/status)."""
        table, samples = self.membership.table, self.membership.samples
        rows = [(self.me, "left" if table.leaving else "alive", table.incarnation)]
        rows += [(m.info, m.state, m.incarnation) for m in table.members.values()]
        return [{"node_id": info.node_id, "addr": info.addr, "state": state,
                 "incarnation": inc, "device_class": info.device_class,
                 "capability": info.capability, "priority": info.priority,
                 "outbound_only": info.outbound_only, "samples": samples.get(info.node_id),
                 "leader": info.node_id == self.leader}
                for info, state, inc in rows]

    def sample_counts(self) -> dict[str, int]:
        """The swarm sample G-counter as the control plane knows it (headers, syncs)."""
        return self.membership.samples.as_dict()

    def merge_samples(self, counts: dict[str, int]) -> None:
        """Fold in G-counter entries learnt elsewhere (averaging bodies, a checkpoint), so
        member-list exchanges spread them: as far as the sample guard admits them now (issue
        13), merged by max: nothing ever decreases. This node's own entry is its own
        training's count (the learner's), exact."""
        own = counts.get(self.me.node_id)
        if own is not None:
            self.membership.sample_guard.own(own, self.now)
        self.membership.samples.merge(self.admit_samples(counts))

    def admit_samples(self, counts: dict[str, int]) -> dict[str, int]:
        """The part of a G-counter from a peer (or a fetched checkpoint) this node may merge
        now: entries of current members only, each grown by at most what its rate and burst
        allow (membership/samples.py). Spends the allowance: merge what it returns."""
        return self.membership.admit_samples(counts, self.now)

    def sample_rate(self, node_id: str) -> float | None:
        """`node_id`'s sample rate as this node observed its entry grow (None: not yet)."""
        return self.membership.sample_guard.rate(node_id, self.now)

    def life_of(self, node_id: str) -> int | None:
        """A member's incarnation while it is alive or suspect (None: dead, left, unknown)."""
        m = self.membership.table.members.get(node_id)
        return m.incarnation if m is not None and m.live else None

    def baseline_samples(self, counts: dict[str, int]) -> None:
        """This node's starting G-counter (its resume checkpoint, or the one its driver
        started it from): admitted whole, the base later reports are bounded against."""
        self.membership.sample_guard.baseline(counts, self.now)

    def live_members(self) -> list[MemberInfo]:
        return [m.info for m in self.membership.table.members.values() if m.live]

    # -- the state machine --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        if self.stopped:
            return None
        deadline = self.membership.next_deadline()
        election = self.election.next_deadline()
        return deadline if election is None or deadline < election else election

    def notice(self, now: float) -> list[Action]:
        """Before any event (the owner's too: a step that ended, a request given up): woken or
        handed anything more than a lease after the deadline we asked for, the process was
        paused (SIGSTOP, a suspended laptop, a stalled loop). What we knew of the leader is
        stale: learn whether it lives before claiming, lead nothing meanwhile, and tell the
        owner (`on_resume`). More than a heartbeat late: a stall (`Election.stalled`).
        Counted once: the deadline asked moves to what is due now."""
        late = 0.0 if self._wake is None else now - self._wake
        actions: list[Action] = []
        if late <= self.config.heartbeat_interval or self.stopped:
            return actions
        if late > self.config.lease:
            self.resumes += 1
            self.election.resumed(now, actions)
            self.on_resume(now, late)
        else:
            self.election.stalled(now)
        deadline = self.next_deadline()
        self._wake = None if deadline is None else max(deadline, now)
        return actions

    def handle(self, now: float, event: Event) -> list[Action]:
        """Process one event at time `now` (never earlier than the previous call)."""
        if type(now) is not float and type(now) is not int or not self.now <= now < math.inf:
            _check_time(now, self.now)  # raises with the reason
        kind = type(event)
        if kind not in _EVENT_TYPES:
            raise LocalProtocolError(f"unknown event {event!r}")
        if kind is Progress:
            self._check_progress(event)
        self.now = now
        if self.stopped:
            return []
        msgs: list[Out | ToAll] = []
        actions = self.notice(now)
        if kind is Received:
            self._received(now, event, msgs, actions)
        elif kind is Tick:
            self.membership.tick(now, msgs, actions)
            self.election.tick(now, self._rank, msgs, actions)
        elif kind is Discovered:
            self.membership.discovered(now, event.addr, msgs)
        elif kind is Progress:
            self._step, self._samples, self._swarm = event.step, event.samples, event.swarm_samples
            self.membership.set_own_samples(event.samples, now)
            self.election.progress(now, event.step, event.swarm_samples, event.finished, actions)
        else:
            self.election.resign(msgs, actions)
            self.membership.leave(now, msgs)
            self.stopped = True
        if msgs:
            self._emit(msgs, actions)
        deadline = self.next_deadline()  # a deadline already past means "call me at once"
        self._wake = None if deadline is None else max(deadline, now)
        return actions

    def wrap(self, to: str | None, addr: str, body: Body, reply: bool = False) -> Send:
        """A Send for a body another layer owns, with this node's header and piggyback."""
        return Send(to, addr, Envelope(self._header(to, body), body), reply)

    # -- internals ----------------------------------------------------------------------------

    def _check_progress(self, event: Progress) -> None:
        for name in ("step", "swarm_samples", "samples"):
            value = getattr(event, name)
            if not isinstance(value, int) or value < 0:
                raise LocalProtocolError(f"Progress.{name} must be an int >= 0")
        if event.step < self._step or event.samples < self._samples:
            raise LocalProtocolError("Progress.step and Progress.samples never decrease")

    def _received(self, now: float, event: Received, msgs: list, actions: list[Action]) -> None:
        message = event.message
        if type(message) is Envelope:
            pass
        elif isinstance(message, bytes | bytearray | memoryview):
            try:
                message = wire.decode(message)
            except RemoteProtocolError as exc:
                actions.append(RemoteError(event.addr, None, exc.reason))
                return
        else:
            raise LocalProtocolError("Received.message must be bytes or an Envelope")
        header, body = message.header, message.body
        reason = self._refusal(header, body)
        if reason is not None:  # a member we do not know yet is no offender: honest lag (its
            # pushes start as soon as it knows us, maybe before our list has it)
            actions.append(RemoteError(event.addr, header.sender, reason, offence=isinstance(
                body, OPEN_BODIES) or header.sender in self.membership.table.members))
            return
        membership = self.membership
        if header.fingerprint != self.me.fingerprint:  # another swarm: nothing it says counts
            if type(body) is Refuse:  # ... except why it will not have us
                membership.on_body(now, header, body, event.addr, msgs, actions)
            else:
                membership.refuse(header, body, event.addr, msgs, actions)
            return
        table = membership.table
        known = header.sender in table.members  # a joiner's view waits a message
        table.limit = table.ceiling + self.config.max_epoch_step  # one step per message
        try:
            self._apply(now, event.addr, message, known, msgs, actions)
        finally:
            table.limit = math.inf

    def _apply(self, now: float, addr: str, message: Envelope, known: bool, msgs: list,
               actions: list[Action]) -> None:
        """Act on a message `_refusal` admitted from a member of this swarm."""
        header, body, membership = message.header, message.body, self.membership
        membership.on_header(now, header, actions)
        view = header.view
        if view is not None and known and self._followable(view, header.sender):
            self.election.observe(now, view, header.sender, addr, msgs, actions)
        if isinstance(body, Resign):
            self.election.on_resign(now, header.sender, body.term)
        elif isinstance(body, Yield):
            self.election.on_yield(now, body, msgs, actions)
        elif isinstance(body, CONTROL_BODIES):
            membership.on_body(now, header, body, addr, msgs, actions)
        else:
            actions.append(Deliver(message, addr))

    def _refusal(self, header: Header, body: Body) -> str | None:
        """Why a message must be refused without effect, or None. Reads state only."""
        if header.version != PROTOCOL_VERSION:
            return f"protocol version {header.version} is not {PROTOCOL_VERSION}"
        if header.sender == self.me.node_id:
            return "message claims to come from this node"
        known = self.membership.table.members.get(header.sender)
        if known is None and not isinstance(body, OPEN_BODIES):
            return f"{type(body).__name__} from {header.sender}, which is not a member"
        view = header.view
        claims = isinstance(body, Claim | Heartbeat)
        if claims and (view is None or view.leader != header.sender):
            return f"{type(body).__name__} without the sender's own claim"
        step, term = self.config.max_epoch_step, self.election.term
        if isinstance(body, Yield) and max(body.term, body.winner_term) > term + step:
            return f"yield of term {body.term}: more than {step} above term {term}"
        ceiling = self.membership.table.ceiling
        if isinstance(body, LeaveBody) and header.incarnation > ceiling + step:
            return (f"leave at incarnation {header.incarnation}: more than {step} above "
                    f"incarnation {ceiling}")
        if view is not None and view.leader == header.sender and known is not None:
            # (a newer life is judged by its own record, which its header may be bringing: a
            # member that once went outbound-only and restarted accepting connections)
            if known.info.outbound_only and header.incarnation <= known.incarnation:
                return "an outbound-only member cannot lead"
            if header.incarnation == known.incarnation and (
                view.priority != known.info.priority
                or view.capability != known.info.capability
            ):
                return "claim priority disagrees with the member's record"
        return None

    def _followable(self, view: LeaderView, sender: str) -> bool:
        """Whether a header's view may reach the election: it names this node, its sender (the
        claim itself, checked by `_refusal`), or by relay a member that can lead and whose
        record it agrees with -- and, to renew the claim followed now, a live one. A relay
        naming an outbound-only, misdescribed or dead member would keep followers renewing a
        leader that never leads."""
        if view.leader == self.me.node_id or view.leader == sender:
            return True
        m = self.membership.table.members.get(view.leader)
        if m is None or m.info.outbound_only or view.priority != m.info.priority \
                or view.capability != m.info.capability:
            return False
        cur = self.election.view
        return m.live or cur is None or (cur.term, cur.leader) != (view.term, view.leader)

    def hold_claims(self, held: bool) -> None:
        """While `held`, this node claims no leadership, whatever lapses (Election.claims_held:
        a joiner whose replica is behind the swarm's)."""
        self.election.claims_held = bool(held)

    def _rank(self) -> int:
        """Live members that could lead and outrank this node (the lapsed leader excluded)."""
        lapsed = self.election.view.leader if self.election.view is not None else None
        mine = self.me.priority_key()
        return sum(1 for i, m in self.membership.table.members.items()
                   if m.live and not m.info.outbound_only and i != lapsed
                   and m.info.priority_key() > mine)

    def _emit(self, msgs: list[Out | ToAll], actions: list[Action]) -> None:
        members = self.membership.table.members
        for out in msgs:
            if type(out) is ToAll:
                for node_id, m in members.items():
                    if m.live and not m.info.outbound_only:
                        actions.append(self.wrap(node_id, m.info.addr, out.body))
                continue
            addr = out.addr
            if not addr:  # election names a node; look its address up
                m = members.get(out.to) if out.to else None
                if m is None:
                    continue
                addr = m.info.addr
            actions.append(self.wrap(out.to, addr, out.body, out.reply))

    def _header(self, to: str | None, body: Body) -> Header:
        membership = self.membership
        table = membership.table
        limit = self.config.max_piggyback
        m = table.members.get(to) if to is not None else None
        if m is not None and m.state != ALIVE:  # may be dead: do not spend retransmissions
            updates = table.queue.peek(limit)
        else:
            updates = table.queue.take(limit)
        if type(body) is Ack and self.now - table.refuted_at <= self.config.suspicion_max(
                table.live_count):
            # A prober may still suspect us and hear from us only in acks (outbound-only
            # probers, or our refutation was spent on dead members): carry it to every ack.
            me = self.me.node_id
            updates = (table.self_update(), *(u for u in updates if u.node_id != me))[:limit]
        return Header(PROTOCOL_VERSION, self.me.node_id, table.incarnation, self.me.addr,
                      self.me.fingerprint, self._samples, membership.prober.periods,
                      table.live_count, self.election.view, updates, membership.holdings.mine)

    def snapshot(self) -> dict[str, Any]:
        """All protocol state as plain data (tests compare it before and after input)."""
        membership, election = self.membership, self.election
        table, prober = membership.table, membership.prober
        return {
            "incarnation": table.incarnation,
            "members": {i: (m.state, m.incarnation, m.info, m.since, m.beat, m.heard_at,
                            None if m.suspicion is None else
                            (m.suspicion.deadline, sorted(m.suspicion.reporters)))
                        for i, m in table.members.items()},
            "queue": sorted(repr(u) for u in table.queue.pending()),
            "queue_state": sorted(repr(e) for e in table.queue._live.values()),
            "samples": membership.samples.as_dict(),
            "seeds": list(membership.seeds),
            "prober": (prober.order, prober.index, prober.next_period, repr(prober.current),
                       dict(prober.relays), prober.seq),
            "timers": (membership.next_sync, membership.next_reconnect, membership.next_join),
            "election": {k: getattr(election, k) for k in (
                "term", "view", "leading", "lease_until", "lapse_reported", "claim_at",
                "next_heartbeat", "yield_term", "yield_to", "step", "swarm_samples",
                "last_checkpoint_step")},
            "progress": (self._step, self._samples, self._swarm),
        }


_EVENT_TYPES = frozenset((Tick, Received, Discovered, Progress, Leave))


def _check_time(now: Any, previous: float) -> float:
    if not isinstance(now, int | float) or not math.isfinite(now):
        raise LocalProtocolError(f"now must be a finite number, got {now!r}")
    if now < previous:
        raise LocalProtocolError(f"time went backwards: {now} < {previous}")
    return float(now)
