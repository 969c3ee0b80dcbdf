"""The gossip-training sub-machine of a node: what happens to gradients and parameters between
the control plane and the learner (steps 2-4 of DESIGN.md's training algorithm).

After each local step (`step`): encode the own gradient (with error feedback), push it to
`fanout` peers the caller found eligible (chosen by `PeerTable`, favouring fast links), mix it
with the peer gradients queued since the last step (`GradientMixer`: sample-count weights,
staleness in swarm samples, median-norm clipping), apply AdamW (`learner.apply_gradient`),
and every `average_every` steps open a push-pull averaging exchange with one peer (its seed,
which chooses the coordinates covered, drawn with that peer: seeds.py; moving
by `pull_share` of the two nodes' sample rates, as `rate_of` -- the node's -- observes them).
The partner is drawn by link speed and its rate to `average_draw_power`; with
`average_known_rates`, only among peers whose rate is observed (none yet: not this time).

Inbound bodies are checked completely (`parse`: framing, checksum, model length, the swarm's
codec before any decoding, the sender named in the chunks is the header's, finite values)
before anything changes; a defect raises CodecError and nothing moves (a refused reply to
the open exchange ends it). A gradient arriving while the driver computes is only queued.
Parameters are written only between steps: averaging half steps that complete while a step
is outstanding (`busy`) are held and added by `flush` at the next `StepDone`, so a driver
may compute in a worker thread while the event loop answers requests. They are held sparse
(`HeldDeltas`: each part's coordinates and values, their pulls summing to at most 1 over any
coordinate), at most `held_capacity` coordinates (an eighth of the model, or 64 MiB if
more): a responder replies at once, from a snapshot (a read), to as many requests per step
as fit, and declines the rest; an initiator sends its next part at the step boundary when
that one's reply would not fit. A node not training yet (joining) declines. The
error-feedback residual exists only when gradients are pushed (`fanout > 0`).

Give-up: each part waits for its reply until a deadline that grows with its bytes over the
bandwidth measured to the peer (`give_up_seconds`: `average_timeout_margin` x the expected
time, within [`average_timeout`, `average_timeout_max`]); a part given up lowers that peer's
bandwidth estimate. No part is sent once the exchange has run `average_timeout_max`; nor
waited for once the membership finds its partner dead (`life_of`): it ends at the next tick;
nor once the driver says the part's request is over without its reply (`unanswered`: a
refused connection, a refusal, a request timed out). Averaging requests are answered by
answer.py's `respond`.

Tracking (`track_peers` > 0, tracking.py): after each step the node also pushes the sign of
its replica minus its public copy to the fastest and moves toward its copies (`track_step`).

Outbound-only peers: nobody may connect to them, so they are never push targets or averaging
partners; they start exchanges themselves, and a push from one is answered with this node's
latest gradient (`GradientReply`, sent in the response), once per own step. No I/O, no
clock (times are passed in), randomness only from the generator it is given.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ptrain.codecs import CodecError, Message
from p2ptrain.proto.gossip.answer import declines, respond, serve_latest, strike
from p2ptrain.proto.gossip.averaging import (
    HeldDeltas,
    ParameterAverager,
    PeerSnapshot,
    pull_share,
    read_part,
)
from p2ptrain.proto.gossip.config import GossipConfig, flops_per_coordinate
from p2ptrain.proto.gossip.exchange import Exchange, held_capacity
from p2ptrain.proto.gossip.messages import (
    TRACK_REFUSED,
    AverageReply,
    AverageRequest,
    GradientPush,
    GradientReply,
    TrackAck,
    TrackPush,
)
from p2ptrain.proto.gossip.mixer import GradientMixer, MixReport, gradient_encoder
from p2ptrain.proto.gossip.outer import OuterOptimizer, outer_step
from p2ptrain.proto.gossip.peers import PeerTable, fast_pair, fast_partners
from p2ptrain.proto.gossip.seeds import MAX_SEED, Seeds
from p2ptrain.proto.gossip.tracking import Tracker, track_step
from p2ptrain.proto.messages import Body, Out

if TYPE_CHECKING:
    from p2ptrain.learner import Learner

OUTER_STALENESS = 2**62  # outer steps mix every pseudo-gradient that arrived since the last


class TooFar(CodecError):
    """An averaging snapshot the distance guard refuses: drift, not necessarily malice."""


class GossipTrainer:
    """Gradient gossip and parameter averaging around one learner; see the module docstring."""

    def __init__(self, config: GossipConfig, learner: Learner, rng: np.random.Generator, *,
                 average_timeout: float, chunk_elems: int, secret: bytes = b""):
        self.n = n = int(learner.params.shape[0])
        self.config, self.learner, self.node_id = config, learner, learner.node_id
        self.sender = bytes.fromhex(learner.node_id)  # raw id in codec chunk headers
        self.rng, self.average_timeout, self.chunk_elems = rng, average_timeout, chunk_elems
        self.outer = (OuterOptimizer(config, n, int(rng.integers(0, 2**62)), learner.outer_saved)
                      if config.outer_every > 0 else None)
        if self.outer is not None:  # outer steps share progress; no per-step pushes
            learner.progress, learner.outer = self.outer.progress, self.outer
        learner.outer_saved = None  # taken, or not wanted: never held for the whole run
        self.encoder = (gradient_encoder(config, n)  # error feedback: a model-sized buffer
                        if config.fanout > 0 and self.outer is None else None)
        # pseudo-gradients are mixed once a round, whatever the swarm trained meanwhile
        self.mixer = GradientMixer(config if self.outer is None else replace(
            config, max_staleness_samples=OUTER_STALENESS), n, self.node_id)
        self.plan = config.averaging_plan(n, flops_per_coordinate(learner.model, n))
        anchor = self.outer.progress if self.outer is not None and self.outer.rewinds else None
        self.initiator = ParameterAverager(self.plan, chunk_elems, anchor=anchor)  # we open
        self.responder = ParameterAverager(self.plan, chunk_elems, anchor=anchor)  # we answer
        self.peers = PeerTable()  # RTT and bandwidth per peer: how push targets are chosen
        self.guard = config.distance_guard()  # which averaging snapshots are too far
        self.seeds = Seeds(self.node_id, secret or self.sender, self.plan.slow_fraction is not None)
        # (the pairs' seed chains; the runtime's secret is the OS's: simulated, predictable)
        self.opening = ["", ""]  # the open exchange's nonce revealed, its commitment (hex)
        self.exchange: Exchange | None = None
        # peers that are no partner of ours for now -> (when we answered one of its requests,
        # until when): just averaged with (at least until our next step), or our reply perhaps
        # still on its way (answer.py's `respond`); and when our last step ended
        self.resting: dict[str, tuple[float, float]] = {}
        # partner -> (its exchanges in a row without a reply, benched until: answer.strike)
        self.benched: dict[str, tuple[int, float]] = {}
        self.boundary = -math.inf
        self.held = HeldDeltas(self.plan, held_capacity(n))  # half steps while busy
        self.reading = False  # the driver reads the learner's buffers: busy even between steps
        # (peer, addr, seed, part, parts, opened): a next part to send at the step boundary
        self.next_part: tuple[str, str, int, int, int, float] | None = None
        self.latest: tuple[int, float, list[bytes]] | None = None  # own last gradient sent
        self.served: dict[str, int] = {}  # outbound-only peer -> own step last returned to it
        self.peer_progress: dict[str, tuple[int, float | None]] = {}  # last (step, loss) heard
        self.loss: float | None = None  # the own latest training loss (averaging bodies carry it)
        self.distance: float | None = None  # consensus distance of the last exchange (RMS)
        self.last_mix: MixReport | None = None
        self.stats: Counter[str] = Counter()
        # the membership's: samples/s a node is seen to train at (None: unobserved; averaging
        # pulls 1/2, partners by link alone); a member's incarnation while it lives, or None
        self.rate_of: Callable[[str], float | None] | None = None
        self.life_of: Callable[[str], int | None] = lambda node_id: None
        self._seed_base = int(rng.integers(0, 2**62))
        self.tracker = (Tracker(n, config.track_peers, config.track_gamma, config.track_warmup,
                                config.distance_guard(), rng, chunk_elems, self.stats)
                        if config.track_peers > 0 else None)

    # -- inbound ------------------------------------------------------------------------------

    def parse(self, sender: str, body: Body, decline: bool = False
              ) -> tuple[Message, float] | PeerSnapshot | None:
        """Check a gossip body from `sender` completely, changing nothing (but drop and
        refusal counts, and the seed chain a reply moves: seeds.py); CodecError names the
        first defect. Returns the admitted chunk and its
        squared norm (gradients), the peer snapshot (averaging) or None (a reply that
        declines). An averaging snapshot this node would apply (a request it will not
        `decline`, the reply its open exchange waits for) must pass the distance guard."""
        raw_id = bytes.fromhex(sender)
        if isinstance(body, TrackPush | TrackAck):  # a node that does not track refuses
            return self.tracker.parse(sender, body) if (
                type(body) is TrackPush and self.tracker is not None) else None
        if isinstance(body, GradientPush | GradientReply):  # refused before any header use
            return self.mixer.admit(body.chunk, raw_id)
        if isinstance(body, AverageReply) and body.part == 0:  # the pair's seed chain: moved
            self.seeds.answered(sender, body.seed, body.grant, body.reseed)  # if we refuse it
        if isinstance(body, AverageReply) and not body.chunks:
            return None
        snap = read_part(self.plan, self.initiator.codec, raw_id, body.chunks, body.seed,
                         body.part, body.parts)
        if (isinstance(body, AverageRequest) and not decline
                and declines(self, sender, body) is None):
            self.responder.begin(self.learner.params, body.seed, body.part)  # a read
            try:
                distance = self.responder.distance(snap)
            finally:
                self.responder.abort()
            self._judge(sender, distance)
        elif isinstance(body, AverageReply):
            ex = self.exchange
            if (ex is not None and ex.peer == sender and ex.seed == body.seed
                    and ex.part == body.part and self.initiator.is_open):
                self._judge(sender, self.initiator.distance(snap), ours=True)
        return snap

    def _judge(self, sender: str, distance: float, ours: bool = False) -> None:
        reason = self.guard.judge(sender, distance)
        if reason is not None:
            self.stats["average_refused"] += 1
            if ours:  # the reply our exchange waits for: it is over, as if declined
                self.exchange = None
                self.initiator.abort()
            raise TooFar(reason)

    def on_body(self, now: float, sender: str, addr: str, body: Body, parsed: Any, *,
                busy: bool, outbound_sender: bool, out: list[Out],
                decline: bool = False, counts: dict[str, int] | None = None) -> None:
        """Act on a body `parse` accepted (`busy`: a step is outstanding; `decline`: refuse
        averaging requests; `counts`: the part of an averaging body's G-counter the control
        plane admitted, merged instead of the body's). CodecError if the mixer refuses the
        gradient (an absurd norm, a duplicate chunk); nothing changes then."""
        learner = self.learner
        busy = busy or self.reading
        if counts is None and isinstance(body, AverageRequest | AverageReply):
            counts = body.counts
        if type(body) is TrackPush:
            status = (self.tracker.on_push(now, sender, body, parsed, not decline)
                      if self.tracker is not None else TRACK_REFUSED)
            out.append(Out(sender, addr, TrackAck(body.epoch, body.seq, body.part, status),
                           reply=True))
        elif type(body) is TrackAck and self.tracker is not None:
            self.tracker.on_ack(now, sender, body, self.give_up_seconds, out)
        elif isinstance(body, GradientPush | GradientReply):
            arrival = self.mixer.receive(parsed[0], learner.count.total, admitted=parsed)
            self.peer_progress[sender] = (body.step, body.loss)
            self.stats[f"gradient_{arrival.value}"] += 1
            if isinstance(body, GradientPush) and outbound_sender:
                serve_latest(self, sender, addr, out)
        elif isinstance(body, AverageRequest):
            self.peer_progress[sender] = (body.step, body.loss)
            if not decline:  # a joiner's counters move only with the replica it adopts
                learner.count.merge(counts)
            respond(self, now, sender, addr, body, parsed, busy, decline, out)
        elif isinstance(body, AverageReply):
            if body.loss is not None:  # (not a refusal, which carries none)
                self.peer_progress[sender] = (body.step, body.loss)
            learner.count.merge(counts)
            ex = self.exchange
            if (ex is None or ex.peer != sender or ex.seed != body.seed
                    or ex.part != body.part):
                self.stats["average_late"] += 1  # timed out already; nothing to undo
                return
            self.exchange = None
            if parsed is None:
                self.initiator.abort()
                self.stats["average_declined"] += 1  # (no strike: a refusal by the distance
                return  # guard is one, and the patience that ends drift needs those to come)
            received = sum(len(c) for c in body.chunks)
            self.peers.observe_transfer(sender, ex.sent, received, now - ex.started, now)
            self._finish(self.initiator, parsed, busy, ex.part)
            if ex.part + 1 < ex.parts:  # the next part, from a fresh snapshot of it
                nxt = (ex.peer, ex.addr or addr, ex.seed, ex.part + 1, ex.parts,
                       ex.started if ex.opened is None else ex.opened)
                if busy and not self.held.room(self._part_size(ex.seed, ex.part + 1)):
                    self.next_part = nxt  # its reply could not be held: after the step
                else:
                    self._send_part(now, *nxt, out)

    # -- parameter writes ---------------------------------------------------------------------

    def _part_size(self, seed: int, part: int) -> int:
        lo, hi = self.plan.part_range(seed, part)
        return hi - lo

    def _finish(self, averager: ParameterAverager, snap: PeerSnapshot, busy: bool,
                part: int) -> None:
        """Close `averager`'s exchange: its half step goes to the parameters, or, while a step
        is outstanding, into the held half steps."""
        rate_of = self.rate_of or (lambda node_id: None)
        try:
            report = averager.finish(
                self.learner.params, snap, self.held if busy else None, pull_share(
                    rate_of(self.node_id), rate_of(snap.sender.hex()),
                    self.config.average_pull_max, self.config.average_pull_power))
        except CodecError:  # too far apart (max_distance): refused, nothing applied
            self.stats["average_refused"] += 1
            return
        self.distance = report.distance
        self.guard.applied(report.peer.hex(), report.distance, averager is self.responder,
                           part == 0)
        if averager is self.initiator:  # its reply came (its requests prove nothing: a
            self.benched.pop(report.peer.hex(), None)  # silent member may send its own)
        self.stats["average_applied"] += 1

    def read(self, active: bool, stepping: bool) -> list:
        """The driver starts or stops reading the learner's buffers (the `Reading` event):
        meanwhile half steps are held as while a step runs; at the end they are added, unless
        a step is still outstanding (`stepping`). Returns no actions."""
        self.reading = bool(active)
        if not (active or stepping):
            self.flush()
        return []

    @property
    def dirty(self) -> bool:  # averaging half steps wait for the step boundary
        return bool(self.held)

    def flush(self) -> None:
        """Add the held averaging half steps to the parameters (call while no step runs)."""
        self.held.apply(self.learner.params)

    # -- the step -----------------------------------------------------------------------------

    def step(self, now: float, loss: float, targets: Sequence[tuple[str, str]],
             partners: Sequence[tuple[str, str]], out: list[Out]) -> MixReport:
        """Push, mix and apply the gradient in `learner.grad` (finite, from the batch whose
        mean loss is `loss`); then open an averaging exchange if one is due. `targets` and
        `partners` are (node id, addr) of the peers eligible for pushes and for averaging."""
        learner, cfg, self.loss = self.learner, self.config, loss
        swarm = learner.count.total
        step = learner.step + 1
        if self.outer is not None:
            return outer_step(self, now, loss, targets, partners, out)
        if self.encoder is not None:
            chunks = [bytes(m) for m in self.encoder.encode_vector(
                learner.grad, sender_id=self.sender, swarm_samples=swarm,
                weight=float(learner.batch), seed=(self._seed_base + step) % 2**64,
                chunk_elems=self.chunk_elems)]
            self.latest = (step, loss, chunks)
            addrs = dict(targets)
            size = sum(len(c) for c in chunks)
            for peer in self.peers.choose(addrs, cfg.fanout, self.rng, size):
                out.extend(Out(peer, addrs[peer], GradientPush(step, loss, c)) for c in chunks)
                self.stats["gradient_pushes"] += 1
        self.mixer.observe(now, swarm)  # the swarm's sample rate: the staleness bound
        report = self.mixer.mix(learner.grad, float(learner.batch), swarm)
        self.last_mix = report
        learner.apply_gradient(learner.grad, loss)
        if self.tracker is not None:
            track_step(self, now, partners, out)
        self._average_if_due(now, partners, out)
        return report

    def _average_if_due(self, now: float, partners: Sequence[tuple[str, str]],
                        out: list[Out]) -> None:
        """After a step: an exchange's part that waited for this boundary, else an averaging
        exchange if one is due -- with any partner every `average_every` steps, with one of
        the swarm's fastest every `average_every_fast` when they, this node too, are few;
        not with a peer resting (`resting`: just averaged with, our reply to it perhaps still
        on its way) nor, unless every partner is, one benched (our exchanges with it ended
        without its reply: answer.strike)."""
        resting = {p for p, (at, until) in self.resting.items()
                   if at >= self.boundary or until > now}
        benched = {p for p, (_, until) in self.benched.items() if until > now}
        if any(p not in benched for p, _ in partners):  # a benched partner only when every
            resting |= benched  # partner is (a pair whose link is back after an outage)
        self.resting = {p: v for p, v in self.resting.items() if v[1] > now}
        self.boundary = now
        if self.next_part is not None:
            nxt, self.next_part = self.next_part, None
            self._send_part(now, *nxt, out)
        elif self.exchange is not None or not partners:
            return
        elif self.config.averaging_due(self.learner.step):
            self._begin_average(now, partners, out, resting)
        elif self.config.fast_averaging_due(self.learner.step) and self.rate_of is not None:
            fast = fast_partners(self.node_id, partners, self.rate_of)
            if fast and self.config.fast_core(len(fast) + 1, len(partners) + 1):
                self._begin_average(now, fast, out, resting)
            elif fast:
                self.stats["average_fast_not_core"] += 1

    def _begin_average(self, now: float, partners: Sequence[tuple[str, str]],
                       out: list[Out], resting: Collection[str] = ()) -> None:
        cfg, addrs, rate_of = self.config, dict(partners), self.rate_of
        rates = ({p: rate_of(p) for p in addrs}
                 if cfg.average_pull_max > 0.5 and rate_of is not None else None)
        drawn = {p: a for p, a in addrs.items() if p not in resting}
        if not drawn:
            self.stats["average_partners_resting"] += 1
            return
        peer = self.peers.choose_partner(drawn, self.rng, 4 * self.plan.capacity,
                                         cfg.average_explore, rates, cfg.average_draw_power,
                                         cfg.average_known_rates)
        if peer is None:  # no partner's progress observed yet: wait for the next due step
            self.stats["average_waited"] += 1
            return
        fast = None
        if self.plan.slow_fraction is not None:  # the seed says which share it covers
            fast = rate_of is not None and fast_pair(
                rate_of(self.node_id), rate_of(peer), (rate_of(p) for p in addrs if p != peer))
        seed, *self.opening = self.seeds.opening(peer, int(self.rng.integers(0, MAX_SEED)), fast)
        self._send_part(now, peer, addrs[peer], seed, 0, self.plan.parts(seed), now, out)
        self.stats["average_started"] += 1

    def _send_part(self, now: float, peer: str, addr: str, seed: int, part: int, parts: int,
                   opened: float, out: list[Out]) -> None:
        """Snapshot part `part` of exchange `seed` (first sent at `opened`) and send it; wait
        for its reply until its give-up time. A later part is not sent once the exchange has
        run `average_timeout_max` (the parts done stay applied: each stands alone)."""
        learner = self.learner
        if part > 0 and now - opened >= self.config.average_timeout_max:
            self.stats["average_cut_short"] += 1
            return
        self.initiator.begin(learner.params, seed, part)  # a read: allowed while busy
        chunks = tuple(bytes(c) for c in self.initiator.messages(self.sender,
                                                                 learner.count.total))
        sent = sum(len(c) for c in chunks)
        self.exchange = Exchange(peer, seed, now, now + self.give_up_seconds(peer, sent),
                                 sent, part, parts, addr, opened, self.life_of(peer))
        self.stats["average_parts_sent"] += 1
        self.stats["average_bytes_sent"] += self.exchange.sent
        out.append(Out(peer, addr, AverageRequest(seed, learner.step, learner.count.as_dict(),
                                                  chunks, part, parts, self.loss,
                                                  *(self.opening if part == 0 else ()))))

    # -- timers -------------------------------------------------------------------------------

    def give_up_seconds(self, peer: str, sent: int) -> float:
        """How long a part that sent `sent` bytes to `peer` waits for its reply (as many bytes
        come back): see the module docstring."""
        cfg = self.config
        return self.peers.give_up(peer, 2 * sent, floor=self.average_timeout,
                                  margin=cfg.average_timeout_margin,
                                  ceiling=cfg.average_timeout_max)

    def next_deadline(self) -> float | None:
        times = [self.exchange.deadline if self.exchange is not None else None,
                 self.tracker.next_deadline() if self.tracker is not None else None]
        return min((t for t in times if t is not None), default=None)

    def tick(self, now: float) -> None:
        if self.tracker is not None:
            self.tracker.tick(now)
        ex = self.exchange
        gone = ex is not None and ex.life is not None and self.life_of(ex.peer) is None
        if ex is not None and (now >= ex.deadline or gone):  # (gone: found dead, so no reply
            # comes: the slot is free at once, not after 90 s or more; given up: the link is
            # slower than measured)
            self._end(now, "average_partner_gone" if gone else "average_timeout", not gone)

    def unanswered(self, now: float, peer: str, seed: int, part: int, timed_out: bool) -> None:
        """The request of part `part` of exchange `seed` to `peer` is over without its reply
        (the `Unanswered` event): the exchange ends now instead of at its give-up."""
        ex = self.exchange
        if ex is not None and (ex.peer, ex.seed, ex.part) == (peer, seed, part):
            self._end(now, "average_unanswered", timed_out)

    def _end(self, now: float, stat: str, shortfall: bool) -> None:
        ex, self.exchange = self.exchange, None
        self.initiator.abort()
        self.stats[stat] += 1
        strike(self, now, ex.peer, now - ex.started)  # gone, restarting, slow or silent
        if shortfall:
            self.peers.observe_shortfall(ex.peer, 2 * ex.sent, now - ex.started)

    def close(self, replaced: bool = False) -> None:
        """Stop: forget the open exchange and held results; `replaced`: the outer round too."""
        self.exchange = None
        self.next_part = None
        self.resting.clear()
        self.benched.clear()
        self.held.clear()
        self.initiator.abort()
        self.mixer.clear()
        if replaced and self.outer is not None:
            self.outer.reset()
        if self.tracker is not None:
            self.tracker.close()
