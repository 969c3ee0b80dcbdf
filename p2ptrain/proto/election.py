"""Leader election by lease and rank-ordered claims (DESIGN.md, "Membership ... election").

- The leader holds a lease that its heartbeats renew; every message relays its sender's view
  (term, leader, newest heartbeat seq), so a follower renews on any newer seq it hears while
  its lease holds (after a lapse, only the leader's own messages renew it). A crashed
  leader's last heartbeat therefore lapses everywhere within about 2 leases.
- The lease adapts to the link: a follower stretches it to `lease_gap_mult` times the slow
  end of the recent gaps between renewals it heard (at most `lease_max_mult` leases), so
  heartbeats that arrive late over a busy WiFi or a Starlink uplink do not look like a dead
  leader; on a quick link it stays `lease`.
- A follower whose lease lapses -- the lapse, not the failure detector's verdict -- waits
  `rank * claim_backoff` (rank: live members that could lead and outrank it, the lapsed
  leader excluded) and then claims the next term, unless a claim arrived meanwhile.
- Claims order by (term, priority, capability, id). Any leader that hears a higher claim
  steps down at once and sends the winner `Yield` until it has moved to a term above both
  (also said by a restarted member that knew a later term); a leader that hears another
  leader directly, or one of its own term by relay, moves up at once. So checkpoint
  (term, step) keeps growing when a partition heals. Outbound-only members never claim, nor
  does a member while `claims_held` (the node sets it from its join's first checkpoint fetch
  until the join ends: its replica is behind, and a lapse meanwhile is for members that
  trained).
- Bounded steps (issue 13): a view more than `max_epoch_step` above this node's term, relayed
  or the claimant's own, is not followed; the term grows by that one step instead. So one
  message moves a term by at most a step, and a node whose term got far ahead of its peers'
  (a member pushed it there) still leads them: each of its messages brings them a step
  closer until they follow. Nothing refuses a member's traffic for its term (a refused
  leader was declared dead by peers that went on without it: two leaders for good).
- A relayed view reaches the election only when it names a live member that can lead, as
  its record describes it (Control); the leader's own newer heartbeats renew its lease
  whatever seq relays carried, so a relay of a made-up later heartbeat cannot make followers
  deaf to the real ones. A Yield moves the leader up by at most a step; moving up keeps the
  checkpoint schedule (repeated Yields must not postpone every checkpoint), and so does
  leading again: a member holding the key that claimed the next term every few seconds and
  never sent a heartbeat unseated the leader each time, and each new claim restarted the
  schedule -- no checkpoint at all. A node that led before keeps its deadline (passed: it
  writes once it leads again), whoever led meanwhile.
- The leader decides checkpoints: every `checkpoint_interval` seconds (or
  `checkpoint_samples` swarm samples), only for a step above its last one in the term, so
  two checkpoints never share (term, leader, step).

This file owns the election state and the checkpoint schedule; it never reads membership
(Control passes the rank and validates claims), never reads the clock, and never sends
anything itself: it returns bodies to send.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from p2ptrain.proto.config import ProtoConfig
from p2ptrain.proto.events import Action, LeaderChanged, SaveCheckpoint
from p2ptrain.proto.messages import Claim, Heartbeat, Notify, Out, Resign, ToAll, Yield
from p2ptrain.proto.records import LeaderView, MemberInfo

Outgoing = list[Out | ToAll]
RENEWAL_WINDOW = 32  # renewals whose gaps the lease adapts to


class Election:
    """One node's view of who leads, and its own leadership when it leads."""

    def __init__(self, config: ProtoConfig, me: MemberInfo, now: float, term_floor: int = 0):
        self.config = config
        self.me = me
        self.term = term_floor  # highest term seen or claimed (persisted by the driver)
        self.view: LeaderView | None = None  # whom we follow (ourselves when leading)
        self.leading = False
        self.lease_until = now + config.lease  # at start: time to hear of an existing leader
        self.renewed_at: float | None = None  # when the followed claim was last renewed
        self.leader_seq = -1  # newest heartbeat seq heard from the followed leader itself
        self.gaps: deque[float] = deque(maxlen=RENEWAL_WINDOW)  # recent gaps between renewals
        self.lapse_reported = False
        self.claim_at: float | None = None
        self.stall_grace = False  # a stall's grace was given since the last renewal
        self.claims_held = False  # no claim now, lapse or not (set by the node; see above)
        self.next_heartbeat = 0.0
        self.yield_term = 0  # the term we led (or knew) when we started yielding
        self.yield_to: LeaderView | None = None  # the winner we yield to, until it moves up
        self.next_yield = 0.0
        # checkpoint schedule (meaningful while leading)
        self.step: int | None = None
        self.swarm_samples = 0
        self.finished = False
        self.next_checkpoint = 0.0
        self.led = False  # whether this node has led: its schedule then outlives the lead
        self.last_checkpoint_step = -1
        self.last_checkpoint_swarm = 0

    @property
    def leader(self) -> str | None:
        """The leader followed now (None while the lease has lapsed)."""
        return None if self.view is None or self.lapse_reported else self.view.leader

    # -- input --------------------------------------------------------------------------------

    def observe(self, now: float, v: LeaderView, sender: str, addr: str, msgs: Outgoing,
                actions: list[Action]) -> None:
        """A view from a member's message header (validated by Control when the sender is the
        claimant itself)."""
        me = self.me.node_id
        step = self.config.max_epoch_step
        if v.term > self.term + step:  # relayed from too far ahead: not followed; the term
            self.term += step  # grows one bounded step, so lagging relays still catch up
            return
        if v.leader == me:  # our own view relayed back, or a claim of a previous life
            self.term = max(self.term, v.term)
            return
        cur = self.view
        if cur is not None and v.term == cur.term and v.leader == cur.leader:  # the same claim
            # Once the lease has lapsed only the leader itself renews it: a late relay of an
            # old heartbeat must not postpone the fail-over (the 2-lease bound).
            direct = sender == v.leader and v.seq > self.leader_seq
            if direct or (v.seq > cur.seq and (now < self.lease_until or self.me.outbound_only)):
                if sender == v.leader:
                    self.leader_seq = v.seq
                if v.seq > cur.seq:
                    self.view = v
                if self.renewed_at is not None:
                    self.gaps.append(now - self.renewed_at)
                self._renew(now, actions)
        elif cur is None or v.key() > cur.key():
            if self.leading:  # two leaders met: step down, and have the winner move up
                self.leading = False
                self._start_yield(now, cur.term, v)
            self._follow(now, v, actions)
        elif v.leader == sender:  # another leader, with a lower claim, speaks to us directly
            if self.leading and v.term >= self.term:  # move above both, once: later messages
                self._claim(now, max(self.term, v.term) + 1, msgs, actions)  # of the loser
            msgs.append(Out(sender, addr, Notify(), reply=True))  # still carry its old claim
        elif self.leading and v.term == cur.term:  # a rival of our own term, heard by relay
            self._claim(now, self.term + 1, msgs, actions)

    def on_yield(self, now: float, body: Yield, msgs: Outgoing, actions: list[Action]) -> None:
        """A member that led (or knew) `body.term` now follows us: move above both, once."""
        if self.leading and self.view.term == body.winner_term:
            step = self.config.max_epoch_step  # peers at our term accept up to a step above
            self._claim(now, min(max(self.term, body.term) + 1, self.term + step), msgs, actions)

    def on_resign(self, now: float, sender: str, term: int) -> None:
        v = self.view
        if v is not None and not self.leading and v.leader == sender and v.term == term:
            self.lease_until = min(self.lease_until, now)  # lapse now: claims start at once

    def resumed(self, now: float, actions: list[Action]) -> None:
        """The driver ran nothing for longer than a lease (the process was paused): our view
        is stale. A follower gives the leader a fresh lease to show itself before its lapse
        leads to a claim -- heartbeats queued meanwhile, or the next ones, renew it -- so a
        waking node learns whether the leader lives instead of taking over (and if it does
        not, the ranks, priority first, decide who claims). A leader steps down at once,
        without a word and without a checkpoint in its old term: another may lead by now; if
        none does, it claims again, in a higher term, once its lease runs out."""
        if self.leading:
            self.leading = False
            self.lapse_reported = True
            actions.append(LeaderChanged(self.term, None))
        self.lease_until = max(self.lease_until, now + self.config.lease)
        self.claim_at = None

    def stalled(self, now: float) -> None:
        """The driver ran late by more than a heartbeat (a stall shorter than a lease): a
        follower reads the renewals that wait before it claims -- once per renewal."""
        if not self.leading and not self.stall_grace:
            self.stall_grace = True
            self.lease_until = max(self.lease_until, now + self.config.heartbeat_interval)
            if self.claim_at is not None:  # (a claim due before the lease ends: no busy wake)
                self.claim_at = max(self.claim_at, self.lease_until)

    def progress(self, now: float, step: int, swarm_samples: int, finished: bool,
                 actions: list[Action]) -> None:
        self.step, self.swarm_samples = step, swarm_samples
        self.finished = self.finished or finished
        if self.leading:
            self._maybe_checkpoint(now, actions)

    def resign(self, msgs: Outgoing, actions: list[Action]) -> None:
        """Shutdown: a leader announces its step-down so another claims at once."""
        if self.leading:
            self.leading = False
            msgs.append(ToAll(Resign(self.term)))
            actions.append(LeaderChanged(self.term, None))

    # -- timers -------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        if self.leading:
            return min(self.next_heartbeat, self.next_checkpoint)
        deadlines = []
        if self.yield_to is not None:
            deadlines.append(self.next_yield)
        if self.claim_at is not None:
            deadlines.append(self.claim_at)
        elif not self.lapse_reported or not (self.me.outbound_only or self.claims_held):
            deadlines.append(self.lease_until)
        return min(deadlines) if deadlines else None

    def tick(self, now: float, rank: Callable[[], int], msgs: Outgoing,
             actions: list[Action]) -> None:
        cfg = self.config
        if self.leading:
            if now >= self.next_heartbeat:
                self.view = replace(self.view, seq=self.view.seq + 1)
                msgs.append(ToAll(Heartbeat()))
                self.next_heartbeat += cfg.heartbeat_interval
                if self.next_heartbeat <= now:  # slept through beats: do not catch up
                    self.next_heartbeat = now + cfg.heartbeat_interval
            self._maybe_checkpoint(now, actions)
            return
        if self.yield_to is not None and now >= self.next_yield:
            v = self.view
            if v is None or v.key() != self.yield_to.key():  # the winner moved up, or fell
                self.yield_to = None
            else:
                msgs.append(Out(v.leader, "", Yield(self.yield_term, v.term)))
                self.next_yield = now + cfg.heartbeat_interval
        if now >= self.lease_until:
            if not self.lapse_reported:
                self.lapse_reported = True
                if self.view is not None:
                    actions.append(LeaderChanged(self.term, None))
            if self.claims_held or self.me.outbound_only:
                self.claim_at = None  # held: back-off counts from the lapse once released
            elif self.claim_at is None:
                self.claim_at = self.lease_until + rank() * cfg.claim_backoff
            if self.claim_at is not None and now >= self.claim_at:
                self._claim(now, self.term + 1, msgs, actions)

    # -- internals ----------------------------------------------------------------------------

    def _start_yield(self, now: float, term: int, winner: LeaderView) -> None:
        """Tell `winner` (until it moves up) that `term` existed."""
        self.yield_term, self.yield_to, self.next_yield = term, winner, now

    def _follow(self, now: float, v: LeaderView, actions: list[Action]) -> None:
        self.gaps.clear()  # another leader: its link is another
        self.renewed_at = None
        self.leader_seq = -1
        if self.term > v.term and self.yield_to is None:
            self._start_yield(now, self.term, v)  # we knew a later term (a restart's floor)
        self.view = v
        self.term = max(self.term, v.term)
        self.lapse_reported = True  # force the announcement below
        self._renew(now, actions)

    def lease(self) -> float:
        """The lease a follower grants now: `lease`, stretched on a slow link (see above)."""
        cfg = self.config
        if len(self.gaps) < RENEWAL_WINDOW // 4:
            return cfg.lease
        slow = sorted(self.gaps)[int(0.9 * (len(self.gaps) - 1))]
        return min(cfg.lease * cfg.lease_max_mult, max(cfg.lease, cfg.lease_gap_mult * slow))

    def _renew(self, now: float, actions: list[Action]) -> None:
        # An outbound-only node hears the leader only in replies to its own requests and
        # never claims: it gives the lease more time before it reports a lapse.
        self.renewed_at = now
        self.stall_grace = False
        self.lease_until = now + self.lease() * (3 if self.me.outbound_only else 1)
        self.claim_at = None
        if self.lapse_reported:
            self.lapse_reported = False
            actions.append(LeaderChanged(self.view.term, self.view.leader))

    def _claim(self, now: float, term: int, msgs: Outgoing, actions: list[Action]) -> None:
        me = self.me
        self.term = term
        self.view = LeaderView(term, me.node_id, me.priority, me.capability, 0)
        self.claim_at, self.yield_to, self.lapse_reported = None, None, False
        self.next_heartbeat = now + self.config.heartbeat_interval
        if not self.leading and not self.led:  # moving up keeps the schedule (see the
            self.next_checkpoint = now + self.config.checkpoint_interval  # module docstring),
            self.last_checkpoint_swarm = self.swarm_samples  # and so does leading again
        self.leading = self.led = True
        self.last_checkpoint_step = -1  # a new term: (term, step) stays unique
        msgs.append(ToAll(Claim()))
        actions.append(LeaderChanged(term, me.node_id))

    def _maybe_checkpoint(self, now: float, actions: list[Action]) -> None:
        cfg = self.config
        due = now >= self.next_checkpoint or self.finished or (
            cfg.checkpoint_samples > 0
            and self.swarm_samples - self.last_checkpoint_swarm >= cfg.checkpoint_samples)
        if not due:
            return
        if self.step is not None and self.step > self.last_checkpoint_step:
            actions.append(SaveCheckpoint(self.term, self.step, self.swarm_samples,
                                          self.me.node_id, final=self.finished))
            self.last_checkpoint_step = self.step
            self.last_checkpoint_swarm = self.swarm_samples
        if now >= self.next_checkpoint:
            self.next_checkpoint = now + cfg.checkpoint_interval
