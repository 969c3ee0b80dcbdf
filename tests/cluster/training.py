"""N training nodes in virtual time: the in-memory cluster (harness.py) running real `Node`s
with real numpy training.

    cluster = TrainingCluster(8, seed=1, make_learner=lambda i, node_id: Learner(...),
                              node_config=NodeConfig(), step_seconds=[0.05] * 8,
                              network=Network(bandwidth=1.25e6))
    cluster.run_until_finished(max_time=600.0)
    worst = max(n.machine.learner.evaluate() for n in cluster.nodes)

A `RunStep` is executed at once (`learner.compute_gradient()`, synchronously, on the
parameters as they are then -- the node writes none until the step ends) and its `StepDone`
is delivered `step_seconds[i]` of virtual time later: the node's modelled compute time, so a
slow node takes fewer steps. Messages go through the cluster's seeded `Network` (delay range
plus size / bandwidth when `Network.bandwidth` is set; loss, duplication, reordering,
partitions, outbound-only nodes reached only by replies). Link contention is not modelled.
A crashed node loses its learner; a restarted one gets a fresh learner from `make_learner`
(fetching the leader's checkpoint first is the runtime's job and is not modelled here).

Pure: no clock, no sockets, randomness only from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ptrain.proto.config import LOCAL, ProtoConfig
from p2ptrain.proto.events import (
    Action,
    AdoptCheckpoint,
    CheckpointFetched,
    FetchCheckpoint,
    Finished,
    Holds,
    RunStep,
    SaveCheckpoint,
    StepDone,
)
from p2ptrain.proto.gossip.averaging import consensus_distance
from p2ptrain.proto.node import Node, NodeConfig
from p2ptrain.proto.records import Holding
from tests.cluster import harness

if TYPE_CHECKING:
    from p2ptrain.learner import Learner

LearnerFactory = Callable[[int, str], "Learner"]  # (node index, node id) -> a fresh learner


class TrainingCluster(harness.Cluster):
    """The harness cluster with training nodes; see the module docstring."""

    def __init__(self, n: int, seed: int, make_learner: LearnerFactory, *,
                 node_config: NodeConfig | None = None, config: ProtoConfig = LOCAL,
                 step_seconds: float | Sequence[float] = 0.05,
                 network: harness.Network | None = None, outbound_only: Iterable[int] = (),
                 seeds: str = "all", wire_format: bool = False,
                 observers: Iterable[Any] = ()):
        self.make_learner = make_learner
        self.node_config = node_config or NodeConfig(min_peers=0, join_fetch=False)
        self.fetch_seconds = 0.2  # a join-time checkpoint fetch takes this long
        self.fetch_fails: set[int] = set()  # nodes whose fetches fail (a broken link)
        self.stored: dict[str, tuple[int, np.ndarray, dict[str, int]]] = {}  # path -> data
        self.fetches: list[tuple[float, int, FetchCheckpoint]] = []
        if isinstance(step_seconds, int | float):
            step_seconds = [float(step_seconds)] * n
        if len(step_seconds) != n or min(step_seconds) <= 0:
            raise ValueError("step_seconds needs one positive compute time per node")
        self.step_seconds = list(step_seconds)
        self.finished_at: dict[int, float] = {}  # node index -> when it reported Finished
        self.distances: list[tuple[float, float]] = []  # (time, consensus distance) samples
        super().__init__(n, seed, config, network=network, outbound_only=outbound_only,
                         seeds=seeds, wire_format=wire_format, train=False,
                         observers=observers, make_machine=self._make_node)

    def _make_node(self, cluster: harness.Cluster, node: harness.Slot,
                   rng: random.Random) -> Node:
        learner = self.make_learner(node.index, node.info.node_id)
        return Node(self.config, node.info, learner, self.node_config,
                    incarnation=node.incarnation, now=self.now, rng=rng,
                    term_floor=node.term_floor)

    def training_node(self, i: int) -> Node:
        machine = self.nodes[i].machine
        if machine is None:
            raise ValueError(f"node {i} is down")
        return machine

    def learners(self) -> list[Learner]:
        """The learners of the nodes that are up."""
        return [n.machine.learner for n in self.nodes if n.up]

    # -- running ------------------------------------------------------------------------------

    def on_checkpoint(self, node: harness.Slot, action: SaveCheckpoint) -> None:
        learner = node.machine.learner
        path = f"ckpt/{node.index}/{action.term}/{action.step}"
        self.stored[path] = (node.index, learner.params.copy(), learner.count.as_dict())
        self._tell_holding(node, path)

    def _tell_holding(self, node: harness.Slot, path: str) -> None:
        """As the runtime's shelf does: the node now holds (and serves) checkpoint `path`."""
        _, term, step = (int(x) for x in path.split("/")[1:])
        holding = Holding(term, step, sum(self.stored[path][2].values()),
                          f"{term:08x}{step:08x}")
        i, generation = node.index, node.generation
        self.at(self.now, lambda c: c.nodes[i].up and c.nodes[i].generation == generation
                and c._handle(c.nodes[i], Holds(holding)))

    def _fetch(self, i: int, generation: int, action: FetchCheckpoint) -> None:
        """Answer a FetchCheckpoint: the newest checkpoint the leader wrote, fetched from the
        leader's address (which must be up and reachable), or why not."""
        node = self.nodes[i]
        if not node.up or node.generation != generation:
            return
        if node.paused_until > self.now:  # a stopped process hears of it when it resumes
            self.at(node.paused_until, lambda c: c._fetch(i, generation, action))
            return
        src = self.addr_index.get(action.sources[0])
        leader_written = [p for p, (w, _, _) in self.stored.items()
                          if self.nodes[w].info.node_id == action.leader]
        if i in self.fetch_fails or src is None or not self.nodes[src].up:
            event = CheckpointFetched(None, reason="connection refused", retry=True)
        elif not leader_written:
            event = CheckpointFetched(None, reason="no checkpoint yet", retry=False)
        else:
            path = leader_written[-1]
            event = CheckpointFetched(path, sum(self.stored[path][2].values()),
                                      counts=self.stored[path][2])
            self._tell_holding(node, path)
        self._handle(node, event)

    def on_action(self, node: harness.Slot, action: Action) -> None:
        if type(action) is FetchCheckpoint:
            self.fetches.append((self.now, node.index, action))
            i, generation = node.index, node.generation
            self.at(self.now + self.fetch_seconds, lambda c: c._fetch(i, generation, action))
        elif type(action) is AdoptCheckpoint:
            _, params, _ = self.stored[action.path]  # the node merged the counter itself
            np.copyto(node.machine.learner.params, params)
        elif type(action) is RunStep:
            loss = node.machine.learner.compute_gradient()
            i, generation = node.index, node.generation
            self.at(self.now + self.step_seconds[i],
                    lambda c: c._step_done(i, generation, action.step, loss))
        elif type(action) is Finished:
            self.finished_at.setdefault(node.index, self.now)

    def _step_done(self, i: int, generation: int, step: int, loss: float) -> None:
        node = self.nodes[i]
        if node.paused_until > self.now:  # SIGSTOP stops the step's thread too
            self.at(node.paused_until, lambda c: c._step_done(i, generation, step, loss))
        elif node.up and node.generation == generation:
            self._handle(node, StepDone(step, loss))

    def all_finished(self) -> bool:
        return all(n.machine.phase != "training" for n in self.nodes if n.up)

    def run_until_finished(self, max_time: float, sample_every: float = 1.0) -> float:
        """Run until every up node has stopped training (or `max_time`), sampling the
        consensus distance every `sample_every` s; returns the virtual time reached."""
        while self.now < max_time:
            self.run_for(sample_every)
            self.distances.append((self.now, consensus_distance(
                [learner.params for learner in self.learners()])))
            if self.all_finished():
                break
        return self.now
