"""A training node: the control plane, gossip training and the learner behind one sans-IO
object -- the only thing a driver (the asyncio runtime, the simulator, a test) touches.

    node = Node(LAN, me, learner, NodeConfig(), incarnation=1, now=t0, rng=random.Random(s))
    for action in node.handle(now, event):      # Tick, Received, Discovered, StepDone, ...
        RunStep  -> loss = learner.compute_gradient() off the loop (thread / modelled time),
                    then node.handle(later, StepDone(action.step, loss))
        Send     -> wire.encode(action.envelope), POST it (reply=True: in the response);
                    an AverageRequest's POST over, its response's frames handled:
                    node.handle(now, Unanswered(to, seed, part, timed_out))
        SaveCheckpoint, LeaderChanged, Finished, MemberUp/Down, RemoteError ... as for Control
    wake at node.next_deadline() with Tick()

Rules it keeps:
- One step at a time: `RunStep(k)` is emitted when training may go on and no step is
  outstanding; `StepDone(k, loss)` must answer it. Meanwhile every other event is handled as
  usual (heartbeats, probes, averaging requests are answered; gradients are queued), and the
  learner's parameters are not written until the StepDone (trainer.py holds the results), nor
  while the driver reads them (`Reading`: a checkpoint written from them; StepDone waits).
- After a StepDone: the swarm sample G-counter known to the control plane is merged into the
  learner's (by max, so the LR schedule never runs backwards), the gradient is pushed, mixed
  and applied, the control plane gets `Progress`, and a `Finished` action ends training when
  the swarm count reaches the run's total.
- Gossip bodies are checked completely *before* the control plane sees their header: a
  malformed one yields `RemoteError` and leaves membership, election, the learner's
  parameters and optimiser state as they were. A caller error raises `LocalProtocolError`.
- Joining (joining.py): until the join is over the node declines averaging and lets nothing
  it hears move the learner's counters or weights; it asks the driver to `FetchCheckpoint`
  from the leader and, given `CheckpointFetched`, emits `AdoptCheckpoint` when the checkpoint
  is newer than the replica it started with (the driver loads it before the next event), then
  `Joined`. From its first fetch until then it claims no leadership. It takes no step, but
  for one case (`_trains_while_joining`): a node with fresh weights that has heard from
  peers none of whom knows a leader -- a swarm starting together, which waits a lease before
  anyone claims -- trains alone meanwhile (no pushes, no exchanges), and then fetches only
  a checkpoint far ahead of those steps (joining.py). If the join adopts one, those steps
  go (weights replaced, optimiser moments reset, as a fresh joiner's); a checkpoint fetched
  during such a step is taken up after its StepDone (a load must not meet a step in flight).
- Push targets and averaging partners are members the control plane holds *alive* (never
  suspect or dead) that accept connections (not outbound-only).

`status()` is the `/v1/status` document. This file owns the composition, the phase, the step
hand-off and per-peer traffic counts; no I/O, no clock, no global random state.
"""

from __future__ import annotations

import math
import numbers
import random
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ptrain.codecs import CodecError
from p2ptrain.codecs.kernels import finite_norm
from p2ptrain.proto import wire
from p2ptrain.proto.config import ProtoConfig
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
    Finished,
    Holds,
    Joined,
    Leave,
    Offender,
    Progress,
    Reading,
    Received,
    RemoteError,
    RunStep,
    Send,
    StepDone,
    Tick,
    Unanswered,
)
from p2ptrain.proto.gossip.messages import (
    GOSSIP_BODIES,
    TRACK_REFUSED,
    AverageReply,
    AverageRequest,
    TrackAck,
    TrackPush,
)
from p2ptrain.proto.gossip.trainer import GossipTrainer, TooFar
from p2ptrain.proto.joining import FETCHING, Join, median_loss, preferred, sources
from p2ptrain.proto.messages import Ack, Envelope, Out, Ping
from p2ptrain.proto.nodeconfig import NodeConfig
from p2ptrain.proto.nodestatus import forget_gone, node_status
from p2ptrain.proto.offenders import Offenders
from p2ptrain.proto.records import ALIVE, MemberInfo

if TYPE_CHECKING:
    from p2ptrain.learner import Learner

JOINING, TRAINING, FINISHED, STOPPED = "joining", "training", "finished", "stopped"
MAX_PINGS_TIMED = 256  # probes awaiting their ack for the RTT, at most
MAX_SOURCES = 16  # addresses a join fetches from at once (the leader's first)


class Node:
    """Control plane + gossip training + learner for one machine; see the module docstring."""

    def __init__(self, proto: ProtoConfig, me: MemberInfo, learner: Learner,
                 config: NodeConfig | None = None, *, incarnation: int, now: float,
                 rng: random.Random, term_floor: int = 0, joined: bool = False,
                 secret: bytes = b""):
        if learner.node_id != me.node_id:
            raise LocalProtocolError("the learner trains under another node id")
        self.config = config = config or NodeConfig()
        self.control = Control(proto, me, incarnation=incarnation, now=now, rng=rng,
                               term_floor=term_floor)
        self.learner = learner
        self.control.baseline_samples(learner.count.as_dict())  # the start state: trusted
        self.trainer = GossipTrainer(config.gossip, learner, np.random.default_rng(
            rng.getrandbits(64)), average_timeout=config.average_timeout,
            chunk_elems=config.chunk_elems, secret=secret)
        self.trainer.rate_of = self.trainer.mixer.rate_of = self.control.sample_rate
        self.trainer.life_of = self.control.life_of  # an exchange with a partner gone ends
        # joining: averaging requests are declined (no peer is pulled toward weights this node
        # may be about to drop) and nothing received moves the learner's counters or weights
        self.join = Join(now=now, own_samples=learner.count.total,
                         timeout=config.join_timeout, attempts=config.fetch_attempts,
                         backoff=config.fetch_backoff, backoff_max=config.fetch_backoff_max,
                         loss_tolerance=config.checkpoint_loss_tolerance,
                         enabled=config.join_fetch and not joined)
        self.phase = JOINING if config.min_peers > 0 or not self.join.done else TRAINING
        # fresh weights may train while the join waits for a leader (`_trains_while_joining`)
        self.fresh = (learner.count.total == 0 and learner.step == 0
                      and config.gossip.outer_every == 0)  # outer steps keep round state
        self.join_steps = 0  # steps taken while joining (they go if a checkpoint is adopted)
        self.leader_heard = False  # a header heard while joining named a leader
        self._fetched_late: CheckpointFetched | None = None  # arrived during such a step
        self.offenders = Offenders(config.offender_refusals, config.offender_window,
                                   config.offender_cooloff)
        self.started = float(now)  # (a pause noticed while joining moves it: `_resumed`)
        self.control.on_resume = self._resumed
        self.outstanding: int | None = None  # step number of the RunStep in flight
        self.loss: float | None = None  # training loss of the last applied step
        self.eval_loss: float | None = None  # last held-out loss the driver reported
        self.skipped = 0  # steps discarded for a non-finite loss or gradient
        self.bytes_in: Counter[str] = Counter()  # wire bytes received, per member
        self.bytes_out: Counter[str] = Counter()  # wire bytes sent, per node id (or address)
        self.bytes_gone = [0, 0]  # bytes in and out of ids forgotten (nodestatus.forget_gone)
        self._pings: dict[tuple[str, int], float] = {}  # (target, seq) -> when it was sent

    # -- queries ------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.control.node_id

    @property
    def is_leader(self) -> bool:
        return self.control.is_leader

    def alive_peers(self) -> list[tuple[str, str]]:
        """(node id, addr) of members held alive that accept connections, sorted by id."""
        now = self.control.now
        return sorted((i, info.addr) for i, (state, _, info) in self.control.members().items()
                      if state == ALIVE and not info.outbound_only
                      and not self.offenders.ignored(now, i))

    def _alive_count(self) -> int:
        return sum(1 for state, _, _ in self.control.members().values() if state == ALIVE)

    def next_deadline(self) -> float | None:
        if self.phase == STOPPED:
            return None
        deadlines = [self.control.next_deadline(), self.trainer.next_deadline()]
        if self.phase == JOINING:  # the join's own timer, then the wait for min_peers
            deadlines.append(self.started + self.config.join_timeout if self.join.done
                             else self.join.next_deadline())
        known = [d for d in deadlines if d is not None]
        return min(known) if known else None

    # -- the state machine --------------------------------------------------------------------

    def handle(self, now: float, event: Event) -> list[Action]:
        """Process one event at `now` (never earlier than the previous call)."""
        if not isinstance(now, int | float) or not self.control.now <= now < math.inf:
            raise LocalProtocolError(f"bad time {now!r} (last {self.control.now})")
        kind = type(event)
        msgs: list[Out] = []
        paused = self.control.notice(now)  # first: a pause is ours, whatever woke us
        if kind is StepDone:
            actions = self._step_done(now, event, msgs)
        elif kind is Received:
            actions = self._received(now, event, msgs)
        elif kind is CheckpointFetched:
            if self.outstanding is not None:  # a step taken while joining runs: after it
                self._fetched_late, actions = event, []
            else:
                actions = self._fetched(now, event)
        elif kind is Reading:  # a driver's read of the learner: the trainer holds every write
            actions = self.trainer.read(event.active, stepping=self.outstanding is not None)
        elif kind is Evaluated:
            if not (isinstance(event.eval_loss, numbers.Real) and event.eval_loss >= 0):
                raise LocalProtocolError("Evaluated.eval_loss must be a number >= 0")
            self.eval_loss = float(event.eval_loss)
            actions = []
        elif kind is Holds:
            self.control.membership.holdings.own(event.holding)
            actions = []
        elif kind is Unanswered:  # an averaging request's reply cannot come any more
            self.trainer.unanswered(now, event.peer, event.seed, event.part, event.timed_out)
            actions = []
        elif kind in (Tick, Discovered, Leave):
            actions = self.control.handle(now, event)
            if kind is Tick:
                self.trainer.tick(now)
                forget_gone(self)
            elif kind is Leave:
                self.phase = STOPPED
                self.trainer.close()
        elif kind is Progress:
            raise LocalProtocolError("a training Node reports its own Progress")
        else:
            raise LocalProtocolError(f"unknown event {event!r}")
        actions[:0] = paused  # (a leader that was paused steps down first)
        for out in msgs:
            actions.append(self.control.wrap(out.to, out.addr, out.body, out.reply))
        for action in actions:
            if type(action) is Send:
                self.bytes_out[action.to or action.addr] += wire.size(action.envelope)
                body = action.envelope.body
                if type(body) is Ping and body.target == action.to:
                    self._time_ping(now, body.target, body.seq)
        if not self.join.done and self.phase == JOINING:
            held, members = self.control.membership.holdings, self.control.members
            actions += self.join.advance(
                now, self.node_id, self.control.leader, self.sources_of,
                self._swarm_loss(self.control.leader),
                lambda lead: preferred(lead, self._addr_of, held, members()), held.listings,
                self.learner.count.total if self.join_steps else 0, held.of)
        self.control.hold_claims(not self.join.done and self.join.attempt > 0)
        if self.join_steps:  # the start log says what became of the steps taken alone
            n = self.join_steps
            actions[:] = [Joined(f"{a.reason}; {n} step{'s' * (n != 1)} taken alone while no "
                                 f"leader was known") if type(a) is Joined else a
                          for a in actions]
        for action in list(actions):
            if (type(action) is RemoteError and action.offence and action.sender
                    and action.sender != self.node_id):
                self._offended(now, action.sender, action.reason, actions)
        self._maybe_step(now, actions)
        if self.phase == JOINING and self.join.done:  # joined, yet no step until min_peers
            wait = max(0.0, self.started + self.config.join_timeout - now)
            actions[:] = [Joined(f"{a.reason}; training waits up to {wait:.0f}s for "
                                 f"node.min_peers ({self.config.min_peers}) live peers")
                          if type(a) is Joined else a for a in actions]
        return actions

    def _resumed(self, now: float, late: float) -> None:
        """The process was paused (Control noticed, before the event that woke it): the time
        is ours, not a peer's. A join's waits start again (it gave up on a leader it had had no
        time to hear, and trained from fresh weights), and an open averaging exchange's
        clocks move by the pause (its partner was benched, and measured slower, for it)."""
        if self.phase == JOINING:
            self.join.resumed(now)
            self.started = now
        if self.trainer.exchange is not None:
            self.trainer.exchange.postpone(late, now)

    def _fetched(self, now: float, event: CheckpointFetched) -> list[Action]:
        actions = self.join.fetched(now, event, self._swarm_loss(self.join.fetching_from),
                                    trained_alone=self.join_steps > 0)
        if self.join.refused and actions:  # the leader's checkpoint was refused just now
            self._offended(now, self.join.refused, self.join.reason, actions)
        if any(type(a) is AdoptCheckpoint for a in actions):
            self._adopt_counts(event.counts or {})
            if self.join_steps:  # the steps taken while joining go with their weights
                self.learner.opt.reset()
        return actions

    def _trains_while_joining(self) -> bool:
        """A fresh replica's steps before the join is over: while no message heard so far (from
        at least one member, and `min_peers`) named a leader, and no fetch is in flight."""
        return (self.fresh and not self.join.done and self.join.state != FETCHING
                and not self.leader_heard and self.control.leader is None
                and self._fetched_late is None
                and len(self.bytes_in) >= max(1, self.config.min_peers)  # members heard
                and not self.learner.finished)

    def _offended(self, now: float, sender: str, reason: str, actions: list[Action]) -> None:
        if self.offenders.refused(now, sender, reason):
            record = self.offenders.records[sender]
            actions.append(Offender(sender, record.total, record.ignored_until, reason))

    def _adopt_counts(self, counts: dict[str, int]) -> None:
        """Adopting a fetched checkpoint (the driver loads its weights, not its counter): the
        queued gradients and exchanges belong to the old replica; the G-counter it brings is
        bounded like any peer's (entries above what the sample guard admits now are lowered
        to it, entries of non-members dropped) -- a hostile leader's checkpoint cannot end the
        run or jump the schedule."""
        self.trainer.close(replaced=True)
        self.learner.count.merge(self.control.admit_samples(dict(counts)))

    def _swarm_loss(self, judged: str | None) -> float | None:  # not the judged leader's
        return median_loss(p[1] for peer, p in self.trainer.peer_progress.items() if peer != judged)

    def sources_of(self, leader: str, digest: str | None = None) -> tuple[str, ...]:
        """Where to fetch `leader`'s checkpoint (joining.sources), fastest measured first."""
        members, peers = self.control.members(), self.trainer.peers
        fast = lambda n: (-(peers.get(n).bandwidth or 0.0), -members[n][2].capability)  # noqa: E731
        return sources(leader, digest, self._addr_of, self.control.membership.holdings,
                       sorted(members, key=fast), MAX_SOURCES)

    def _addr_of(self, node_id: str) -> str | None:
        """The address of a live member that accepts connections (None otherwise)."""
        member = self.control.member(node_id)
        if (member is None or member[0] != ALIVE or member[2].outbound_only
                or self.offenders.ignored(self.control.now, node_id)):
            return None
        return member[2].addr

    def _time_ping(self, now: float, target: str, seq: int) -> None:
        """Remember when a direct probe left, to time its ack (RTT: status, push targets)."""
        self._pings[(target, seq)] = now
        if len(self._pings) > MAX_PINGS_TIMED:
            del self._pings[next(iter(self._pings))]

    def _acked(self, now: float, sender: str, body: Ack) -> None:
        sent = self._pings.pop((sender, body.seq), None) if body.target == sender else None
        if sent is not None:
            self.trainer.peers.observe_rtt(sender, now - sent, now)

    def _received(self, now: float, event: Received, msgs: list[Out]) -> list[Action]:
        message = event.message
        if type(message) is Envelope:
            size = wire.size(message)
        else:
            try:
                size, message = len(message), wire.decode(message)
            except (RemoteProtocolError, TypeError):
                return self.control.handle(now, event)  # refuses it with the reason
        header, body = message.header, message.body
        self.leader_heard |= (header.view is not None and self.phase == JOINING
                              and header.fingerprint == self.control.me.fingerprint)
        if self.offenders.ignored(now, header.sender):
            self.trainer.stats["ignored_offender_messages"] += 1
            return []
        parsed = None
        gossip = isinstance(body, GOSSIP_BODIES)
        if gossip and self.control.member(header.sender) is not None:
            try:  # checked whole before the header may change anything
                parsed = self.trainer.parse(header.sender, body,
                                            decline=self.phase == JOINING)
            except CodecError as exc:
                refused: list[Action] = [RemoteError(event.addr, header.sender, exc.reason,
                                                     offence=not isinstance(exc, TooFar))]
                if type(body) is AverageRequest:  # tell the initiator at once (no 90 s wait)
                    refused.append(self.control.wrap(header.sender, event.addr, AverageReply(
                        body.seed, self.learner.step, {}, (), body.part, body.parts), True))
                elif type(body) is TrackPush:  # likewise: its pushes wait for this answer
                    refused.append(self.control.wrap(header.sender, event.addr, TrackAck(
                        body.epoch, body.seq, body.part, TRACK_REFUSED), True))
                return refused
        actions = self.control.handle(now, Received(event.addr, message))
        if type(body) is Ack:
            self._acked(now, header.sender, body)
        known = self.control.member(header.sender)
        if known is not None:
            self.bytes_in[header.sender] += size
        if not gossip:
            return actions
        out: list[Action] = []
        for action in actions:
            if type(action) is not Deliver or action.envelope is not message:
                out.append(action)
                continue
            counts = (self.control.admit_samples(body.counts)
                      if isinstance(body, AverageRequest | AverageReply) else None)
            try:
                self.trainer.on_body(now, header.sender, event.addr, body, parsed, counts=counts,
                                     busy=self.outstanding is not None,
                                     outbound_sender=known is not None
                                     and known[2].outbound_only, out=msgs,
                                     decline=self.phase == JOINING)
            except CodecError as exc:
                out.append(RemoteError(event.addr, header.sender, exc.reason))
        return out

    def _step_done(self, now: float, event: StepDone, msgs: list[Out]) -> list[Action]:
        if self.outstanding is None or event.step != self.outstanding or self.trainer.reading:
            raise LocalProtocolError(f"StepDone({event.step}) answers no outstanding RunStep "
                                     f"(outstanding: {self.outstanding}) or came during a read")
        self.outstanding = None
        if self.phase == STOPPED:
            return []
        learner, trainer = self.learner, self.trainer
        joining = self.phase == JOINING  # a step of `_trains_while_joining`: alone
        if joining:  # nothing heard moves a joiner's replica: pushes that came are dropped
            trainer.mixer.clear()
        else:
            learner.count.merge(self.control.sample_counts())
        trainer.flush()
        loss = event.loss
        if isinstance(loss, numbers.Real) and math.isfinite(loss) and finite_norm(learner.grad):
            peers = [] if joining else self.alive_peers()
            trainer.step(now, float(loss), peers, peers, msgs)
            self.loss = float(loss)
            self.join_steps += joining
        else:
            self.skipped += 1
        self.control.merge_samples(learner.count.as_dict())
        finished = learner.finished
        me = self.node_id
        actions = self.control.handle(now, Progress(
            learner.step, learner.count.total, learner.count.get(me), finished))
        if finished and self.phase == TRAINING:
            self.phase = FINISHED
            actions.append(Finished(learner.step, learner.count.total))
        if self._fetched_late is not None:  # the join's checkpoint, held for this step
            late, self._fetched_late = self._fetched_late, None
            actions += self._fetched(now, late)
        return actions

    def _maybe_step(self, now: float, actions: list[Action]) -> None:
        if self.phase == JOINING and self.join.done and (
                self._alive_count() >= self.config.min_peers
                or now >= self.started + self.config.join_timeout):
            self.phase = TRAINING
        if self.outstanding is not None or self.phase != TRAINING and not (
                self.phase == JOINING and self._trains_while_joining()):
            return
        if self.learner.finished and self.phase == TRAINING:  # e.g. restored, the run's end
            self.phase = FINISHED
            actions.append(Finished(self.learner.step, self.learner.count.total))
            return
        self.outstanding = self.learner.step + 1
        actions.append(RunStep(self.outstanding))

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """This node as plain data, the `/v1/status` document (`swarm` is the driver's)."""
        return node_status(self)
