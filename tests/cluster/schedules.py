"""Seeded random fault schedules for the cluster harness, and the runner that judges them.

A schedule is a seed and a list of disruptions -- crashes, restarts, partitions, heals, the
leader crashing together with its best successors, changes of loss -- spread over a chaos
phase, followed by a calm tail in which the network is whole again. `run_schedule` plays it
on a `Cluster` with a `Monitor` attached and returns every invariant violation:

1. safety (the monitor, at every step): claims unique and ordered, a leader that hears a
   higher claim steps down at once and writes nothing after, checkpoint ids unique;
2. in the tail, once settled: exactly one leader, and every live member follows it;
3. a crashed leader (with up to two best successors) is replaced within
   `failover_bound(rank of the best survivor)`;
4. after the heal, checkpoint (term, step) only grows (above every checkpoint written before
   by a node that is up: a crashed node's knowledge is gone with it);
5. a crashed member is declared dead by every live member within `detection_bound(n)`;
   with loss <= 10% and no partition, no member that never crashed is ever declared dead.
The runner resolves "which node" choices at run time from the schedule's own generator, so a
seed reproduces a run exactly. Pure: no clock, no global random state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from p2ptrain.proto.config import LOCAL, ProtoConfig
from p2ptrain.proto.records import DEAD, LEFT
from tests.cluster.harness import Cluster, Network
from tests.cluster.monitor import Monitor

OPS = ("crash", "restart", "partition", "heal", "crash_leader", "loss")


@dataclass
class Schedule:
    seed: int
    n: int
    loss: float  # message loss in the chaos phase
    tail_loss: float  # message loss in the calm tail
    duplicate: float
    reorder: float
    outbound: tuple[int, ...]  # outbound-only nodes
    priorities: list[int]
    ops: list[tuple[float, str]]  # (time, op); targets are chosen when the op runs
    chaos_end: float  # the network is whole again from here
    duration: float

    @property
    def partitions(self) -> bool:
        return any(op == "partition" for _, op in self.ops)


@dataclass
class Outcome:
    schedule: Schedule
    violations: list[str] = field(default_factory=list)
    failovers: list[float] = field(default_factory=list)  # measured fail-over times, s
    checks: int = 0  # liveness checks made
    messages: int = 0
    max_loss: float = 0.0  # highest loss the network had


def random_schedule(seed: int, config: ProtoConfig = LOCAL, n_range: tuple[int, int] = (5, 9),
                    chaos_end: float = 20.0, duration: float = 40.0,
                    tail_losses: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)) -> Schedule:
    rng = random.Random(seed)
    n = rng.randint(*n_range)
    loss = rng.choice((0.0, 0.01, 0.05, 0.1, 0.2))
    outbound = tuple(rng.sample(range(n), rng.choice((0, 0, 1, 2))))
    priorities = [rng.choice((0, 0, 1, 2)) for _ in range(n)]
    failover_quiet = config.failover_bound(n) + 1.0
    ops: list[tuple[float, str]] = []
    t = rng.uniform(3.0, 6.0)
    while t < chaos_end - 1.0:
        op = rng.choices(OPS, weights=(3, 2, 2, 1, 2, 1))[0]
        ops.append((t, op))
        t += failover_quiet if op == "crash_leader" else rng.uniform(0.5, 5.0)
    return Schedule(seed, n, loss, rng.choice(tail_losses),
                    rng.choice((0.0, 0.0, 0.02)), rng.choice((0.0, 0.1, 0.3)), outbound,
                    priorities, ops, chaos_end, duration)


def run_schedule(s: Schedule, config: ProtoConfig = LOCAL, settle: float | None = None,
                 wire_format: bool = False) -> Outcome:
    """Play schedule `s` and judge it; see the module docstring."""
    monitor = Monitor()
    net = Network(loss=s.loss, duplicate=s.duplicate, reorder=s.reorder)
    cluster = Cluster(s.n, s.seed, config, network=net, outbound_only=s.outbound,
                      priorities=s.priorities, observers=[monitor], progress_interval=1.0,
                      wire_format=wire_format)
    out = Outcome(s, max_loss=s.loss)
    rng = random.Random(f"ops/{s.seed}")
    crashed_ever: set[int] = set()
    for t, op in s.ops:
        cluster.run_until(t)
        _apply(cluster, op, rng, s, config, out, crashed_ever)
    cluster.run_until(s.chaos_end)
    cluster.heal()
    cluster.network.loss = s.tail_loss
    out.max_loss = max(out.max_loss, s.tail_loss)
    if settle is None:
        settle = (2 * config.lease + s.n * config.claim_backoff + 4 * config.reconnect_interval
                  + config.suspicion_max(s.n))
    t = s.chaos_end + settle
    cluster.run_until(t)
    # Checkpoints whose writer is gone for good cannot bind the survivors: the others only
    # know what a live node knows (a restarted leader keeps the highest term it claimed).
    before_heal = max(((term, step) for time, i, term, step in monitor.checkpoints
                       if time < s.chaos_end and cluster.nodes[i].up), default=None)
    last = None
    while t <= s.duration:
        cluster.run_until(t)
        out.checks += 1
        _check_one_leader(cluster, out)
        t += 1.0
    for time, i, term, step in monitor.checkpoints:
        if time < s.chaos_end + settle:
            continue
        if before_heal is not None and (term, step) <= before_heal:
            out.violations.append(f"checkpoint {term}/{step} of node {i} at {time:.2f} not above "
                                  f"{before_heal} from before the heal")
        if last is not None and (term, step) <= last:
            out.violations.append(f"checkpoint {term}/{step} at {time:.2f} after {last}")
        last = (term, step)
    if out.max_loss <= 0.1 and not s.partitions:
        for d in monitor.deaths:
            # Two outbound-only nodes cannot reach each other: without an inbound node up to
            # carry their news, each rightly finds the other silent.
            relay_up = any(not n.info.outbound_only and any(a <= d.time < b for a, b in n.lives)
                           for n in cluster.nodes)
            if d.node not in crashed_ever and relay_up:
                out.violations.append(f"t={d.time:.2f}: node {d.observer} declared live node "
                                      f"{d.node} dead")
    out.violations[:0] = monitor.violations
    out.messages = cluster.delivered
    return out


def _apply(cluster: Cluster, op: str, rng: random.Random, s: Schedule, config: ProtoConfig,
           out: Outcome, crashed_ever: set[int]) -> None:
    up = cluster.up()
    down = [i for i in range(s.n) if i not in up]
    if op == "crash" and len(up) > 2:
        _crash(cluster, [rng.choice(up)], config, out, crashed_ever)
    elif op == "restart" and down:
        cluster.restart(rng.choice(down))
    elif op == "partition":
        cut = rng.randint(1, s.n - 1)
        order = rng.sample(range(s.n), s.n)
        cluster.partition([order[:cut]])
    elif op == "heal":
        cluster.heal()
    elif op == "loss":
        cluster.network.loss = rng.choice((0.0, 0.05, 0.1, 0.2))
        out.max_loss = max(out.max_loss, cluster.network.loss)
    elif op == "crash_leader":
        _crash_leader(cluster, rng, config, out, crashed_ever)


def _crash(cluster: Cluster, victims: list[int], config: ProtoConfig, out: Outcome,
           crashed_ever: set[int]) -> None:
    n = len(cluster.nodes)
    for i in victims:
        cluster.crash(i)
        crashed_ever.add(i)
    t_c = cluster.now
    witnesses = [j for j in cluster.up() if cluster.nodes[j].lives[-1][0] < t_c - 5.0]
    for i in victims:
        node = cluster.nodes[i]
        bound = (config.outbound_detection_bound(n) if node.info.outbound_only
                 else config.detection_bound(n))
        generation = node.generation

        def check(c: Cluster, i=i, generation=generation, node=node, bound=bound) -> None:
            if node.generation != generation:
                return  # restarted meanwhile
            out.checks += 1
            for j in witnesses:
                w = c.nodes[j]
                if w.up and w.lives[-1][0] < t_c:
                    state = w.control.member_state(node.info.node_id)
                    if state not in (DEAD, LEFT, None):
                        out.violations.append(f"t={c.now:.2f}: node {j} still sees crashed "
                                              f"node {i} as {state} {bound:.1f}s after the crash")
        cluster.at(t_c + bound, check)


def _crash_leader(cluster: Cluster, rng: random.Random, config: ProtoConfig, out: Outcome,
                  crashed_ever: set[int]) -> None:
    """Crash the agreed leader, with 0-2 of its best successors, and time the fail-over."""
    leaders = cluster.leaders()
    up = cluster.up()
    if len(leaders) != 1 or len(cluster.components()) != 1:
        return
    leader = leaders[0]
    lid = cluster.nodes[leader].info.node_id
    if any(cluster.nodes[j].control.leader != lid for j in up):
        return
    candidates = sorted((j for j in up if j != leader and not cluster.nodes[j].info.outbound_only),
                        key=lambda j: cluster.nodes[j].info.priority_key(), reverse=True)
    k = min(rng.choice((0, 0, 1, 2)), len(candidates) - 1)
    if k < 0 or len(up) - 1 - k < 2:
        return
    victims = [leader, *candidates[:k]]
    best = candidates[k]
    mine = cluster.nodes[best].info.priority_key()
    rank = sum(1 for i, (state, _, info) in cluster.control(best).members().items()
               if state in ("alive", "suspect") and not info.outbound_only and i != lid
               and info.priority_key() > mine)
    _crash(cluster, victims, config, out, crashed_ever)
    t_c = cluster.now
    bound = config.failover_bound(rank) + 0.05  # + delivery of the claim

    def measure(c: Cluster) -> None:
        if c.leaders() and not hasattr(measure, "done"):
            measure.done = True
            out.failovers.append(c.now - t_c)

    step = 0.05
    for m in range(1, int(bound / step) + 1):
        cluster.at(t_c + m * step, measure)

    def check(c: Cluster) -> None:
        out.checks += 1
        if not c.leaders():
            out.violations.append(f"t={c.now:.2f}: no leader {bound:.2f}s after the leader "
                                  f"and {k} successors crashed (best survivor rank {rank})")
    cluster.at(t_c + bound, check)


def _check_one_leader(cluster: Cluster, out: Outcome) -> None:
    leaders = cluster.leaders()
    if all(cluster.nodes[j].info.outbound_only for j in cluster.up()):
        if leaders:  # nobody may lead
            out.violations.append(f"t={cluster.now:.2f}: outbound-only nodes {leaders} lead")
        return
    if len(leaders) != 1:
        out.violations.append(f"t={cluster.now:.2f}: {len(leaders)} leaders in the healed "
                              f"cluster: {leaders}")
        return
    lid = cluster.nodes[leaders[0]].info.node_id
    strays = [j for j in cluster.up() if cluster.nodes[j].control.leader != lid]
    if strays and cluster.now >= 0:
        out.violations.append(f"t={cluster.now:.2f}: nodes {strays} do not follow leader "
                              f"{leaders[0]}")
