"""A deterministic in-memory cluster: N control planes, virtual time, a seeded network.

    cluster = Cluster(7, seed=3, network=Network(loss=0.1))
    cluster.run_until(20.0)
    cluster.crash(cluster.leaders()[0]); cluster.run_for(5.0)

The network delivers each `Send` after a random delay (uniform in `delay`, plus an extra
`reorder_delay` for a `reorder` fraction, which reorders), drops a `loss` fraction,
duplicates a `duplicate` fraction, and drops everything between nodes in different partition
groups (checked at send and at delivery) and every request to an outbound-only node (only
replies reach it, as through NAT). `crash(i)` loses the node's state but for its identity
(node id, incarnation counter, highest term it claimed); `restart(i)` starts a new
incarnation that rediscovers the others' addresses (mDNS). Virtual time advances event by
event, waking each node at its `next_deadline()`. A simple trainer feeds `Progress` events.
Each node's state machine is a bare `Control` unless `make_machine` builds something else
with the same `handle`/`next_deadline` (a training Node: training.py), and actions the
cluster does not perform itself go to `on_action` (a subclass runs RunStep there). With
`Network.bandwidth` set, a message also takes its size / bandwidth to arrive.
Observers see every delivery and every action, to check invariants as the run goes.

Nothing here reads the clock or global randomness; one seed fixes the whole run. Run
`python -m tests.bench.convergence` for the membership convergence table
(convergence.py).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.proto import wire
from p2ptrain.proto.config import LOCAL, ProtoConfig
from p2ptrain.proto.control import Control
from p2ptrain.proto.events import (
    Action,
    Discovered,
    Event,
    LeaderChanged,
    Progress,
    Received,
    SaveCheckpoint,
    Send,
    Tick,
)
from p2ptrain.proto.records import MemberInfo, fingerprint_of

RESUME_READ_DELAY = 0.001  # s from resuming to handling the first waiting message
FIELDS = {"model": "mlp", "layout": "0123456789abcdef", "vocab": "65", "mode": "full"}
_DELIVER, _WAKE, _CALL, _TRAIN = 0, 1, 2, 3


@dataclass
class Network:
    """How the simulated network treats messages (every field may change during a run)."""

    delay: tuple[float, float] = (0.001, 0.010)  # one-way delay range, s (uniform)
    bandwidth: float | None = None  # bytes/s of every link: adds size/bandwidth; None: free
    loss: float = 0.0  # fraction of messages dropped
    duplicate: float = 0.0  # fraction delivered twice
    reorder: float = 0.0  # fraction delayed by up to reorder_delay more (overtaken by others)
    reorder_delay: float = 0.05  # s


@dataclass
class Slot:
    """One machine of the cluster: its identity survives crashes, its state machine does not."""

    index: int
    info: MemberInfo
    seeds: list[str]  # addresses it discovers at every start
    machine: Any = None  # what handles its events: a Control, or a training Node; None: down
    incarnation: int = 0  # the identity file's counter (bumped at every start)
    term_floor: int = 0  # highest term it ever claimed (persisted by a real driver)
    generation: int = 0  # bumped at every crash and restart
    group: int = 0  # partition group
    wake_at: float | None = None
    steps_per_second: float = 4.0
    paused_until: float = 0.0  # SIGSTOP: nothing runs until then; messages wait for it
    step: int = 0
    lives: list[list[float]] = field(default_factory=list)  # [start, end or inf]

    @property
    def up(self) -> bool:
        return self.machine is not None

    @property
    def control(self) -> Control | None:
        """The node's control plane (the machine itself, or the one a training node holds)."""
        machine = self.machine
        return machine if machine is None or type(machine) is Control else machine.control


class Cluster:
    """N nodes in memory; see the module docstring."""

    def __init__(self, n: int, seed: int, config: ProtoConfig = LOCAL, *,
                 network: Network | None = None, outbound_only: Iterable[int] = (),
                 priorities: list[int] | None = None, seeds: str = "all", wire_format: bool = False,
                 train: bool = True, progress_interval: float = 0.5, start: bool = True,
                 observers: Iterable[Any] = (), make_machine: MachineFactory | None = None):
        self.config = config
        self.network = network or Network()
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.wire_format = wire_format
        self.progress_interval = progress_interval
        self.make_machine = make_machine or _make_control
        self.observers: list[Any] = [_complete(obs) for obs in observers]
        self._heap: list[tuple] = []
        self._seq = 0
        self.sent = 0
        self.delivered = 0
        self.checkpoints: list[tuple[float, int, SaveCheckpoint]] = []
        self.blocked: set[tuple[int, int]] = set()  # (from, to) links that drop everything
        outbound = set(outbound_only)
        addrs = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7100" for i in range(n)]
        self.nodes: list[Slot] = []
        for i in range(n):
            info = MemberInfo(
                node_id=f"{self.rng.getrandbits(128):032x}", addr=addrs[i],
                device_class=self.rng.choice(("pi4", "laptop", "server")),
                capability=round(self.rng.uniform(1.0, 100.0), 3),
                priority=priorities[i] if priorities else 0,
                fingerprint=fingerprint_of(FIELDS), fingerprint_fields=dict(FIELDS),
                outbound_only=i in outbound)
            if seeds == "all":
                node_seeds = [a for a in addrs if a != addrs[i]]
            elif seeds == "first":
                node_seeds = [addrs[0]] if i else []
            elif seeds == "random":  # one random earlier node: a random tree of introductions
                node_seeds = [addrs[self.rng.randrange(i)]] if i else []
            else:
                raise ValueError(f"unknown seeding {seeds!r}")
            node = Slot(i, info, node_seeds, steps_per_second=self.rng.uniform(1.0, 20.0))
            self.nodes.append(node)
        self.addr_index = {node.info.addr: node.index for node in self.nodes}
        self.ids = {node.info.node_id: node.index for node in self.nodes}
        if start:
            for node in self.nodes:
                self.restart(node.index)
        if train:
            self._push(self.progress_interval, _TRAIN, None)

    # -- running ------------------------------------------------------------------------------

    def run_until(self, t: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t:
            entry = heapq.heappop(heap)
            self.now = entry[0]
            kind = entry[2]
            if kind == _DELIVER:
                self._deliver(entry[3], entry[4], entry[5])
            elif kind == _WAKE:
                node = self.nodes[entry[3]]
                if node.paused_until > self.now:  # a stopped process wakes late
                    self._push(node.paused_until, _WAKE, *entry[3:])
                elif node.generation == entry[4] and node.wake_at == entry[5]:
                    node.wake_at = None
                    self._handle(node, Tick())
            elif kind == _CALL:
                entry[3](self)
            else:
                self._train()
        self.now = max(self.now, t)

    def run_for(self, dt: float) -> None:
        self.run_until(self.now + dt)

    def observe(self, observer: Any) -> None:
        """Attach an observer (see `Observer`; missing hooks are no-ops)."""
        self.observers.append(_complete(observer))

    def at(self, t: float, fn: Callable[[Cluster], None]) -> None:
        """Call fn(cluster) at virtual time t (disruptions, checks)."""
        self._push(t, _CALL, fn)

    # -- disruptions --------------------------------------------------------------------------

    def crash(self, i: int) -> None:
        node = self.nodes[i]
        if not node.up:
            return
        node.machine, node.wake_at = None, None
        node.generation += 1
        node.lives[-1][1] = self.now
        for obs in self.observers:
            obs.on_crash(self, i)

    def restart(self, i: int) -> None:
        """Start node i (a new incarnation); it rediscovers its seeds."""
        node = self.nodes[i]
        self.crash(i)
        node.incarnation += 1
        node.generation += 1
        rng = random.Random(f"{self.seed}/{i}/{node.incarnation}")
        node.machine = self.make_machine(self, node, rng)
        node.lives.append([self.now, float("inf")])
        for obs in self.observers:
            obs.on_restart(self, i)
        for addr in node.seeds:
            self._handle(node, Discovered(addr))
        self._reschedule(node)

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """Split the network: nodes in different groups cannot talk; unlisted nodes form one
        more group together."""
        for node in self.nodes:
            node.group = 0
        for g, members in enumerate(groups, start=1):
            for i in members:
                self.nodes[i].group = g
        for obs in self.observers:
            obs.on_partition(self)

    def pause(self, i: int, seconds: float) -> None:
        """Stop node i (as SIGSTOP) for `seconds`: its timers fire and the messages sent to it
        are handled only when it resumes, in the order they arrived; it makes no progress."""
        self.nodes[i].paused_until = self.now + seconds

    def heal(self) -> None:
        self.partition(())

    def block(self, i: int, j: int, both: bool = True) -> None:
        """Cut the link from i to j (and back, unless both=False): an asymmetric fault that
        the partition groups cannot express."""
        self.blocked.add((i, j))
        if both:
            self.blocked.add((j, i))

    def unblock_all(self) -> None:
        self.blocked.clear()

    # -- queries ------------------------------------------------------------------------------

    def up(self) -> list[int]:
        return [n.index for n in self.nodes if n.up]

    def leaders(self) -> list[int]:
        return [n.index for n in self.nodes if n.up and n.control.is_leader]

    def components(self) -> list[list[int]]:
        """Up nodes grouped by partition."""
        groups: dict[int, list[int]] = {}
        for n in self.nodes:
            if n.up:
                groups.setdefault(n.group, []).append(n.index)
        return list(groups.values())

    def control(self, i: int) -> Control:
        control = self.nodes[i].control
        if control is None:
            raise ValueError(f"node {i} is down")
        return control

    def on_action(self, node: Slot, action: Action) -> None:
        """Perform an action the cluster itself does not know (subclasses: RunStep...)."""

    def on_checkpoint(self, node: Slot, action: SaveCheckpoint) -> None:
        """A node saved a checkpoint (recorded in `checkpoints`; subclasses keep its data)."""

    def inject(self, i: int, message: Any, addr: str = "192.0.2.1:7100") -> list[Action]:
        """Hand node i a message directly (bytes or Envelope); returns its actions."""
        return self._handle(self.nodes[i], Received(addr, message), deliver_sends=False)

    # -- internals ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: Any, b: Any = None, c: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b, c))

    def _handle(self, node: Slot, event: Event, deliver_sends: bool = True) -> list[Action]:
        actions = node.machine.handle(self.now, event)
        for obs in self.observers:
            obs.on_actions(self, node.index, event, actions)
        for action in actions:
            if type(action) is Send:
                if deliver_sends:
                    self._send(node, action)
            elif type(action) is SaveCheckpoint:
                self.checkpoints.append((self.now, node.index, action))
                self.on_checkpoint(node, action)
            elif type(action) is LeaderChanged:
                if action.leader == node.info.node_id:
                    node.term_floor = max(node.term_floor, action.term)
            else:
                self.on_action(node, action)
        if node.machine is not None:
            self._reschedule(node)
        return actions

    def _reschedule(self, node: Slot) -> None:
        d = node.machine.next_deadline()
        if d is not None and d != node.wake_at:
            node.wake_at = d
            self._push(max(d, self.now), _WAKE, node.index, node.generation, d)

    def _send(self, node: Slot, send: Send) -> None:
        self.sent += 1
        dst = self.addr_index.get(send.addr)
        if dst is None:
            return
        target = self.nodes[dst]
        net, rng = self.network, self.rng
        if target.info.outbound_only and not send.reply:
            return
        if target.group != node.group or (self.blocked and (node.index, dst) in self.blocked):
            return
        if net.loss and rng.random() < net.loss:
            return
        payload = wire.encode(send.envelope) if self.wire_format else send.envelope
        copies = 2 if net.duplicate and rng.random() < net.duplicate else 1
        lo, hi = net.delay
        transfer = 0.0
        if net.bandwidth:
            size = len(payload) if self.wire_format else wire.size(send.envelope)
            transfer = size / net.bandwidth
        for _ in range(copies):
            delay = lo + (hi - lo) * rng.random() + transfer
            if net.reorder and rng.random() < net.reorder:
                delay += net.reorder_delay * rng.random()
            self._push(self.now + delay, _DELIVER, dst, payload, node.index)

    def _deliver(self, dst: int, payload: Any, src: int) -> None:
        node = self.nodes[dst]
        if not node.up or node.group != self.nodes[src].group or (
                self.blocked and (src, dst) in self.blocked):
            return
        if node.paused_until > self.now:  # waits in the socket buffer; on resuming, the
            # overdue timers run first (an event loop's timers fire before a request that
            # arrived meanwhile has been read and parsed), then the waiting messages
            self._push(node.paused_until + RESUME_READ_DELAY, _DELIVER, dst, payload, src)
            return
        self.delivered += 1
        for obs in self.observers:
            obs.before_deliver(self, dst, payload)
        self._handle(node, Received(self.nodes[src].info.addr, payload))

    def _train(self) -> None:
        """Every progress interval each up node steps at its own speed and reports."""
        dt = self.progress_interval
        running = [n for n in self.nodes if n.up and n.paused_until <= self.now]
        for node in running:
            node.step += max(1, round(node.steps_per_second * dt))
        swarm = sum(n.step for n in self.nodes) * 8
        for node in running:
            self._handle(node, Progress(node.step, swarm, node.step * 8))
        self._push(self.now + dt, _TRAIN, None)


MachineFactory = Callable[[Cluster, Slot, random.Random], Any]


def _make_control(cluster: Cluster, node: Slot, rng: random.Random) -> Control:
    """The default machine: a bare control plane."""
    return Control(cluster.config, node.info, incarnation=node.incarnation, now=cluster.now,
                   rng=rng, term_floor=node.term_floor)


def _noop(*args: Any) -> None:
    return None


class Observer:
    """Base for harness observers: every hook is a no-op until overridden."""

    def on_actions(self, cluster: Cluster, i: int, event: Event, actions: list[Action]) -> None:
        """Slot i handled `event` and returned `actions`."""

    def before_deliver(self, cluster: Cluster, i: int, payload: Any) -> None:
        """A message is about to be handed to node i."""

    def on_crash(self, cluster: Cluster, i: int) -> None:
        """Slot i crashed."""

    def on_restart(self, cluster: Cluster, i: int) -> None:
        """Slot i started a new incarnation."""

    def on_partition(self, cluster: Cluster) -> None:
        """The partition groups changed."""


def _complete(obs: Any) -> Any:
    """Give a duck-typed observer the hooks it lacks."""
    for name in ("on_actions", "before_deliver", "on_crash", "on_restart", "on_partition"):
        if not hasattr(obs, name):
            setattr(obs, name, _noop)
    return obs

