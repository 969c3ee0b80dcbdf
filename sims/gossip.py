"""Our method in the simulator: the real protocol `Node`s (control plane, gossip training,
learner) on the modelled fleet, with real numpy training of the proxy model.

Each machine runs one `p2ptrain.proto.node.Node`. The driver performs its actions:
- `RunStep`: the learner computes the gradient at once (real numpy, on the parameters as
  they are then; the node writes none until the step ends) and `StepDone` is delivered after
  the device's modelled compute time for the *charged* model -- wall time is never measured;
- `Send`: handed to the network at its charged size (charge.py; the proxy's exact wire size
  when nothing is rescaled), a reply marked as such (it passes NAT), a gradient push marked
  droppable (the outbox's in-flight limit); it is delivered as the same `Envelope` object,
  and one lost on a lossy link is sent again after TCP's retransmission timeout (the
  runtime's messages go over TCP, which loses none; a partition or a dead peer still ends it;
  a message to a machine that is down costs a connection attempt, not its body, and an
  averaging request that reaches a dead machine is answered `Unanswered`, as the runtime's
  refused connection is);
- `SaveCheckpoint`: the leader's replica and swarm counter are kept as "the latest
  checkpoint"; `FetchCheckpoint` (a joining node, e.g. a machine back from a failure with
  nothing of its own) moves it over the network at its charged size from the source the node
  names, then answers `CheckpointFetched` with its held-out loss and the node's own on the
  judge's windows, as the runtime's join measures them; `AdoptCheckpoint` loads it -- the
  runtime's join path, decided by the same node code;
- holdings, as the runtime's shelf reports them (`Holds`), so headers carry the holding
  record a real node's carry: the leader holds what it saved, a joiner what it downloaded
  (adopted or not), and any other machine, every checkpoint interval of its steps, a local
  save of its own (the runtime's periodic non-leader checkpoint: held, never fetched here).
  Not modelled: the checkpoint the runtime writes the moment a node becomes leader (whether
  a joiner's fetch comes after that write is a race; here the first is at the interval);
- the node is woken at `next_deadline()` with `Tick`.
Discovery: every node is told the addresses of the machines at its own site (mDNS); nodes at
a NATed site are also given the wired machines of the other sites as static seeds.

Churn (the scenario's failure schedule, a leader kill, partitions between sites) is applied
at its times. Held-out loss of every live replica is measured every `eval_every` simulated
seconds, with the consensus distance and the leader's replica (the deliverable: the time to
target is when it reaches the target; the mean's time is kept beside it). Pure: no clock, no
sockets, seeds only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass

import numpy as np

from p2ptrain.proto import (
    GOSSIP_BODIES,
    AdoptCheckpoint,
    AverageRequest,
    CheckpointFetched,
    Discovered,
    FetchCheckpoint,
    Finished,
    GossipConfig,
    GradientPush,
    Holding,
    Holds,
    LeaderChanged,
    Leave,
    Node,
    NodeConfig,
    Received,
    RunStep,
    SaveCheckpoint,
    Send,
    StepDone,
    Tick,
    Unanswered,
    consensus_distance,
)
from sims.charge import ModelSize
from sims.engine import Timer, stream_seed
from sims.fleet import Member, World, proto_config
from sims.metrics import Recorder
from sims.network import RETRANSMIT_SECONDS
from sims.scenario import Method

CHECKPOINT_OVERHEAD = 4096  # bytes of manifest and headers around a checkpoint's weights
CONNECT_BYTES = 100  # a refused TCP connection: a SYN out (60 bytes), an RST back (40)
MAX_WAKES_AT_ONCE = 1000  # a node woken this often at one virtual time is spinning
SHARE_TOLERANCE = 0.1  # how far (relative) a proxy's subset share may be from the method's


def split_params(params: dict, flops_per_coordinate: float) -> tuple[GossipConfig, NodeConfig]:
    """A method's knobs: the keys of a node's [gossip] and [node] TOML sections (the
    GossipConfig and NodeConfig fields), given flat (`fanout = 1`) or as in a node's file
    (`gossip.fanout = 1`, i.e. a `gossip` or `node` table); others are errors.
    `averaging = "auto"` is resolved here by the *charged* model's FLOPs per sample and
    travelling coordinate, as a real node of that model resolves it (the proxy's own
    learners would resolve it by the proxy's)."""
    params = {k: v for k, v in params.items() if k not in ("gossip", "node")} | {
        k: v for table in ("gossip", "node") for k, v in dict(params.get(table, {})).items()}
    gossip_fields = {f.name for f in dataclasses.fields(GossipConfig)}
    node_fields = {f.name for f in dataclasses.fields(NodeConfig)} - {"gossip"}
    unknown = sorted(set(params) - gossip_fields - node_fields)
    if unknown:
        raise ValueError(f"gossip method: unknown knob(s) {', '.join(unknown)}")
    gossip = GossipConfig(**{k: v for k, v in params.items() if k in gossip_fields})
    gossip = dataclasses.replace(gossip, averaging=gossip.averaging_mode(flops_per_coordinate))
    # a simulated machine waits for no peer count (min_peers 0) unless the method says so;
    # it still joins as a real node does (FetchCheckpoint before its first step)
    node_knobs = {"min_peers": 0, **{k: v for k, v in params.items() if k in node_fields}}
    node = NodeConfig(gossip=gossip, **node_knobs)
    return gossip, node


def configure(params: dict, charged: ModelSize, proxy_params: int
              ) -> tuple[GossipConfig, NodeConfig]:
    """`split_params` of a method's knobs for the charged model, refused where the proxy of
    `proxy_params` cannot stand for a subset share (`check_shares`)."""
    gossip, node = split_params(params, charged.flops_per_sample / charged.params)
    check_shares(gossip, proxy_params)
    return gossip, node


def check_shares(gossip: GossipConfig, proxy_params: int) -> None:
    """Refuse a subset share the proxy cannot stand for: an exchange covers whole runs of the
    plan's block, at least one, so on a proxy of few runs a small share (0.1% of a 30k proxy's
    118 runs of 256) would be averaged -- and charged, scaled -- as one run (0.85%), not as
    the share the method names."""
    plan = gossip.averaging_plan(proxy_params, 0.0)  # the mode is resolved already
    shares = [("subset_fraction", plan.fraction, plan.k_blocks)]
    if plan.slow_fraction is not None:
        shares.append(("subset_fraction_slow", plan.slow_fraction, plan.k_for(0)))
    for name, share, runs in shares:
        covered = runs / plan.n_blocks
        if share < 1.0 and abs(covered - share) > SHARE_TOLERANCE * share:
            raise ValueError(
                f"gossip method: {name} = {share:g} cannot be simulated on the "
                f"{proxy_params:,}-parameter proxy: its {plan.n_blocks} runs of {plan.block} "
                f"cover {covered:.3%} (shares it can stand for are multiples of "
                f"1/{plan.n_blocks} = {1 / plan.n_blocks:.4%})")


@dataclass(eq=False)
class Machine:
    member: Member
    node: Node | None = None
    incarnation: int = 0
    generation: int = 0
    term_floor: int = 0
    wake: Timer | None = None
    wake_at: float | None = None
    rng: random.Random | None = None  # compute-time jitter of this machine
    saved_at: float = 0.0  # when this incarnation last saved (local saves) or started
    woken_at: float = -1.0  # virtual time of the last wake, and how many came at that time
    wakes_then: int = 0


@dataclass
class Checkpoint:
    time: float
    writer: int  # machine index
    params: np.ndarray
    counts: dict[str, int]
    holding: Holding  # what its holders advertise (term, step, swarm samples, digest)


class GossipSim:
    """One gossip run; `run()` returns the result row."""

    def __init__(self, world: World, method: Method):
        self.world = world
        self.engine = world.engine
        self.network = world.network
        self.training = world.training
        self.method = method
        self.proto = proto_config(world.scenario)
        charged = world.charged
        _, self.node_config = configure(method.params, charged, world.training.size.params)
        self.recorder = Recorder(method.name, method.kind, method.params,
                                 world.scenario.target_loss)
        self.machines = [Machine(m) for m in world.members]
        self.checkpoint: Checkpoint | None = None
        self.fetches = 0
        self.retransmits = 0  # messages lost on a link and sent again (TCP)
        self.fetched_data: dict[str, Checkpoint] = {}  # CheckpointFetched.path -> checkpoint
        self.finished = False

    # -- lifecycle ------------------------------------------------------------------------

    def seeds(self, m: Member) -> list[str]:
        local = [o.addr for o in self.world.members if o.site == m.site and o is not m]
        if m.outbound_only:
            local += [o.addr for o in self.world.members
                      if o.site != m.site and o.medium == "wired" and not o.outbound_only]
        return local

    def start(self, i: int) -> None:
        """Start machine i (a new incarnation, from the initial weights: a machine back from a
        failure joins by fetching the latest checkpoint, as a real node does)."""
        mach = self.machines[i]
        m = mach.member
        mach.incarnation += 1
        mach.generation += 1
        learner = self.training.learner(m.node_id, m.batch)
        seed = stream_seed(self.world.seed, f"node/{i}/{mach.incarnation}")
        mach.rng = random.Random(seed ^ 1)
        mach.saved_at = self.engine.now
        mach.node = Node(self.proto, self.world.member_info(m), learner, self.node_config,
                         incarnation=mach.incarnation, now=self.engine.now,
                         rng=random.Random(seed), term_floor=mach.term_floor)
        for addr in self.seeds(m):
            self.handle(i, Discovered(addr))
        self.reschedule(i)

    def crash(self, i: int) -> None:
        mach = self.machines[i]
        if mach.node is None:
            return
        mach.node = None
        mach.generation += 1
        mach.wake_at = None
        if mach.wake is not None:
            mach.wake.cancel()

    def come_back(self, i: int) -> None:
        """A failed machine returns: a new incarnation that joins the swarm."""
        if self.machines[i].node is None:
            self.start(i)

    def fetch(self, i: int, action: FetchCheckpoint) -> None:
        """Serve a joining node's FetchCheckpoint: the latest checkpoint, at its charged size,
        from the source it names (answered on arrival; at once when there is none)."""
        mach, ckpt = self.machines[i], self.checkpoint
        source = self.world.addr_index.get(action.sources[0])
        generation = mach.generation
        if ckpt is None or source is None or self.machines[source].node is None:
            reason = "no checkpoint yet" if ckpt is None else "source unreachable"
            answer = CheckpointFetched(None, reason=reason, retry=ckpt is not None)
            self.engine.after(0.0, self._fetched, i, generation, answer)
            return
        self.fetches += 1
        answer = CheckpointFetched(f"{ckpt.time}", sum(ckpt.counts.values()),
                                   counts=dict(ckpt.counts))
        self.fetched_data[answer.path] = ckpt
        self._ship(source, i, generation, answer)

    def _ship(self, source: int, i: int, generation: int, answer: CheckpointFetched) -> None:
        """Send a fetched checkpoint's bytes. Lost on a lossy link, they go again after TCP's
        retransmission timeout; cut off by a partition (or refused), the fetch fails and the
        node retries it -- it waited for an answer that never came, out of training, until
        its machine next failed (the runtime gives a fetch FETCH_DEADLINE)."""
        size = self.world.charged.params * 4 + CHECKPOINT_OVERHEAD

        def failed(reason: str) -> None:
            self.engine.after(0.0, self._fetched, i, generation, CheckpointFetched(
                None, reason=reason, retry=True))

        if self.machines[source].node is None:  # it died since: a connection reset
            failed("source unreachable")
            return
        self.recorder.sent("checkpoint", size)

        def lost() -> None:
            if self.machines[i].node is not None and self.machines[i].generation == generation:
                self.retransmits += 1
                self.engine.after(RETRANSMIT_SECONDS, self._ship, source, i, generation, answer)

        if not self.network.send(source, i, size, lambda: self._fetched(i, generation, answer),
                                 reply=True, bulk=True, on_lost=lost,
                                 on_cut=lambda: failed("cut off by a partition")):
            failed("transfer refused")

    def _fetched(self, i: int, generation: int, answer: CheckpointFetched) -> None:
        mach = self.machines[i]
        if mach.node is not None and mach.generation == generation:
            if answer.path is not None:  # on the shelf now, adopted or not: held
                ckpt = self.fetched_data[answer.path]
                self.handle(i, Holds(ckpt.holding))
                learner = mach.node.learner  # judged as the runtime's join judges it
                answer = dataclasses.replace(answer, loss=learner.evaluate_params(ckpt.params),
                                             own_loss=learner.evaluate_params(learner.params))
            self.handle(i, answer)

    def adopt(self, i: int, action: AdoptCheckpoint) -> None:
        ckpt = self.fetched_data[action.path]  # the node merged the counter itself
        learner = self.machines[i].node.learner
        np.copyto(learner.params, ckpt.params)
        learner.restart_average()  # as a node's restore of another's checkpoint

    # -- the node's events and actions ---------------------------------------------------

    def handle(self, i: int, event) -> None:
        mach = self.machines[i]
        node = mach.node
        actions = node.handle(self.engine.now, event)
        for action in actions:
            kind = type(action)
            if kind is Send:
                self.send(i, action)
            elif kind is RunStep:
                self.run_step(i, action.step)
            elif kind is SaveCheckpoint:
                holding = self.holding(i, action.term)
                self.checkpoint = Checkpoint(self.engine.now, i,
                                             node.learner.checkpoint_weights.copy(),
                                             node.learner.count.as_dict(), holding)
                self.engine.after(0.0, self._holds, i, mach.generation, holding)
            elif kind is LeaderChanged:
                if action.leader == node.node_id:
                    mach.term_floor = max(mach.term_floor, action.term)
            elif kind is Finished:
                self.recorder.extra.setdefault("first_finished_at", self.engine.now)
            elif kind is FetchCheckpoint:
                self.fetch(i, action)
            elif kind is AdoptCheckpoint:
                self.adopt(i, action)
        if mach.node is node:
            self.reschedule(i)

    def holding(self, i: int, term: int) -> Holding:
        """What machine i advertises for a checkpoint it writes now in `term`."""
        learner = self.machines[i].node.learner
        step, samples = learner.step, learner.count.total
        digest = hashlib.sha256(f"{term}/{step}/{samples}/{i}/{self.engine.now}".encode()
                                ).hexdigest()[:16]  # a manifest's digest, in kind
        return Holding(term, step, samples, digest)

    def _holds(self, i: int, generation: int, holding: Holding) -> None:
        mach = self.machines[i]
        if mach.node is not None and mach.generation == generation:
            self.handle(i, Holds(holding))

    def reschedule(self, i: int) -> None:
        mach = self.machines[i]
        deadline = mach.node.next_deadline()
        if deadline is None or deadline == mach.wake_at:
            return
        if mach.wake is not None:
            mach.wake.cancel()
        mach.wake_at = deadline
        mach.wake = self.engine.at(max(deadline, self.engine.now), self._wake, i,
                                   mach.generation)

    def _wake(self, i: int, generation: int) -> None:
        mach = self.machines[i]
        if mach.node is not None and mach.generation == generation:
            mach.wake_at = None
            mach.wake = None
            now = self.engine.now
            mach.wakes_then = mach.wakes_then + 1 if now == mach.woken_at else 1
            mach.woken_at = now
            if mach.wakes_then > MAX_WAKES_AT_ONCE:  # virtual time would never move on
                raise RuntimeError(f"machine {i}: {mach.wakes_then} wakes at t={now:.3f}; its "
                                   f"node's deadline stays in the past (a protocol bug)")
            self.handle(i, Tick())

    def run_step(self, i: int, step: int) -> None:
        mach = self.machines[i]
        m = mach.member
        loss = mach.node.learner.compute_gradient()
        seconds = self.world.compute_seconds(m, mach.rng)
        self.recorder.samples += m.batch
        self.engine.after(seconds, self._step_done, i, mach.generation, step, loss)

    def _step_done(self, i: int, generation: int, step: int, loss: float) -> None:
        mach = self.machines[i]
        if mach.node is None or mach.generation != generation:
            return
        self.recorder.steps += 1
        self.handle(i, StepDone(step, loss))
        node, now = mach.node, self.engine.now
        if (node is not None and not node.is_leader
                and now - mach.saved_at >= self.proto.checkpoint_interval):
            mach.saved_at = now  # a local save, held at once (the write is not charged)
            self.handle(i, Holds(self.holding(i, node.control.term)))

    def send(self, i: int, send: Send) -> None:
        dst = self.world.addr_index.get(send.addr)
        if dst is None:
            return
        envelope = send.envelope
        if self.machines[dst].node is None:
            # a machine that is down takes no connection: no body goes, whatever the message
            # (the same message, charged as a connection attempt, carries the refusal's
            # timing; an averaging request's sender hears `Unanswered` at delivery)
            self._transmit(i, dst, envelope, CONNECT_BYTES, False, self.machines[i].generation,
                           refused=True)
            return
        size = self.world.bytes.size(envelope)
        self.recorder.sent(type(envelope.body).__name__, size)
        self._transmit(i, dst, envelope, size, send.reply, self.machines[i].generation)

    def _transmit(self, i: int, dst: int, envelope, size: int, reply: bool,
                  generation: int, refused: bool = False) -> None:
        """Hand one message to the network. A message lost on the way (a lossy link) is
        sent again after TCP's retransmission timeout, as long as its sender lives: the
        runtime's messages travel over TCP, which loses none -- dropping them here left an
        averaging exchange waiting for its 90 s give-up (the calibration's Starlink node)."""
        body = envelope.body

        def lost() -> None:
            if self.machines[i].node is not None and self.machines[i].generation == generation:
                self.retransmits += 1
                self.engine.after(RETRANSMIT_SECONDS, self._transmit, i, dst, envelope, size,
                                  reply, generation, refused)

        self.network.send(i, dst, size, lambda: self.deliver(dst, i, envelope, refused),
                          reply=reply, droppable=type(body) is GradientPush,
                          bulk=isinstance(body, GOSSIP_BODIES), on_lost=lost)

    def deliver(self, dst: int, src: int, envelope, refused: bool = False) -> None:
        """`refused`: sent while `dst` was down -- a connection attempt, never a message,
        even if the machine is back by the time it arrives."""
        if refused or self.machines[dst].node is None:  # a request to a process that is
            body = envelope.body  # gone fails at once (connection refused): Unanswered
            if type(body) is AverageRequest and self.machines[src].node is not None:
                self.handle(src, Unanswered(self.world.members[dst].node_id, body.seed,
                                            body.part))
            return
        self.handle(dst, Received(self.world.members[src].addr, envelope))

    # -- measurement ----------------------------------------------------------------------

    def live(self) -> list[Machine]:
        """Machines whose replicas count: those done joining (a joiner's replica is about to
        be replaced), or every running one while none is (the swarm's start)."""
        up = [m for m in self.machines if m.node is not None]
        joined = [m for m in up if m.node.phase != "joining"]
        return joined or up

    def measure(self) -> None:
        """One evaluation: every live replica's held-out loss, their consensus distance, and
        the deliverable -- what the checkpoints of the leader (the highest term's, if two
        claim) carry, which a user takes away: its replica, or with `train.ema` the average
        of its weights; while no live replica leads, the mean."""
        live = self.live()
        losses = [self.training.heldout_loss(m.node.learner.params) for m in live]
        distance = consensus_distance([m.node.learner.params for m in live]) if live else None
        leaders = [(m.node.control.term, m.member.index, loss, m.node.learner)
                   for m, loss in zip(live, losses, strict=True) if m.node.is_leader]
        deliverable = None
        if leaders:
            _, _, deliverable, learner = max(leaders, key=lambda x: x[:2])
            if learner.checkpoint_weights is not learner.params:
                deliverable = self.training.heldout_loss(learner.checkpoint_weights)
        self.recorder.point(self.engine.now, losses, distance, deliverable)

    def evaluate(self) -> None:
        self.measure()
        live = self.live()
        if live and all(m.node.phase in ("finished", "stopped") for m in live):
            self.recorder.ended_at = self.engine.now
            self.engine.stop()
            return
        self.engine.after(self.world.scenario.eval_every, self.evaluate)

    def leader_kill(self, back_after: float | None) -> None:
        leaders = [m for m in self.machines if m.node is not None and m.node.is_leader]
        if not leaders:
            self.recorder.extra["leader_kill"] = "no leader at the time"
            return
        victim = max(leaders, key=lambda m: (m.node.control.term, m.member.index))
        i = victim.member.index
        self.recorder.extra["leader_killed"] = {"index": i, "at": self.engine.now,
                                                "device": victim.member.device.name}
        self.crash(i)
        if back_after is not None:
            self.engine.after(back_after, self.come_back, i)

    # -- running --------------------------------------------------------------------------

    def run(self) -> dict:
        world, scenario, engine = self.world, self.world.scenario, self.engine
        for i in range(len(self.machines)):
            self.start(i)
        world.schedule_churn(self.crash, self.come_back, self.leader_kill)
        engine.at(0.0, self.evaluate)
        engine.run_until(scenario.duration)
        until = engine.now
        if self.recorder.ended_at is None:
            self.evaluate_final()
        for mach in self.machines:
            if mach.node is not None:
                mach.node.handle(engine.now, Leave())
        self.recorder.extra.update(self.summary())
        return self.recorder.result(world, until)

    def evaluate_final(self) -> None:
        if not self.recorder.curve or self.recorder.curve[-1][0] != self.engine.now:
            self.measure()

    def summary(self) -> dict:
        stats: dict[str, int] = {}
        for mach in self.machines:
            if mach.node is not None:
                for k, v in mach.node.trainer.stats.items():
                    stats[k] = stats.get(k, 0) + v
        return {"gossip_stats": dict(sorted(stats.items())), "checkpoint_fetches": self.fetches,
                "retransmits": self.retransmits,
                "incarnations": sum(m.incarnation for m in self.machines)}
