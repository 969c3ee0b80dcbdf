"""Membership convergence, measured in protocol periods ("gossip rounds") on the harness.

Two measures, as a table for docs/BENCHMARKS.md (`python -m tests.bench.convergence
[N ...] [--seeds K]`, LAN preset, no loss):
- cold start: every node starts at once knowing one random earlier node (a random tree of
  introductions); rounds until every node knows every other as live;
- one join: a newcomer joins a converged swarm through one random member; rounds until every
  member knows it (SWIM's dissemination time).
Both should grow as O(log N). This file only measures; it never changes the protocol and
reads no clock (rounds are virtual time over the probe interval).
"""

from __future__ import annotations

import math
import sys

from p2ptrain.proto.config import LAN, ProtoConfig
from p2ptrain.proto.events import Action, Event
from tests.cluster.harness import Cluster


class _KnownCounter:
    """Observer counting, per node, the members it believes live."""

    def __init__(self, n: int):
        self.known = [0] * n
        self.complete = 0  # nodes that know all n - 1 others
        self.n = n

    def on_actions(self, cluster: Cluster, i: int, event: Event, actions: list[Action]) -> None:
        for a in actions:
            kind = type(a).__name__
            if kind == "MemberUp" or kind == "MemberDown":
                before = self.known[i]
                self.known[i] += 1 if kind == "MemberUp" else -1
                if before == self.n - 1:
                    self.complete -= 1
                if self.known[i] == self.n - 1:
                    self.complete += 1


def convergence_rounds(n: int, seed: int, config: ProtoConfig | None = None,
                       seeds: str = "random", limit_rounds: int = 200) -> float | None:
    """Protocol periods until every member knows every other as live, when each starts
    knowing one introducer (`seeds="random"`: a random earlier node; "first": node 0).
    None if not converged within `limit_rounds`."""
    config = config or LAN
    counter = _KnownCounter(n)
    cluster = Cluster(n, seed, config, seeds=seeds, train=False, observers=[counter])
    step = config.probe_interval / 4
    t = 0.0
    while t < limit_rounds * config.probe_interval:
        t += step
        cluster.run_until(t)
        if counter.complete == n:
            return t / config.probe_interval
    return None


class _NewcomerWatch:
    """Observer counting the nodes that have learned of one newcomer."""

    def __init__(self, newcomer: str):
        self.newcomer = newcomer
        self.knowers: set[int] = set()

    def on_actions(self, cluster: Cluster, i: int, event: Event, actions: list[Action]) -> None:
        for a in actions:
            if type(a).__name__ == "MemberUp" and a.info.node_id == self.newcomer:
                self.knowers.add(i)


def join_rounds(n: int, seed: int, config: ProtoConfig | None = None,
                limit_rounds: int = 200) -> float | None:
    """Protocol periods until all n members of a converged swarm know a newcomer that joined
    through one random member (SWIM's dissemination time). None if not within the limit."""
    config = config or LAN
    counter = _KnownCounter(n + 1)
    cluster = Cluster(n + 1, seed, config, seeds="random", train=False, start=False,
                      observers=[counter])
    for i in range(n):
        cluster.restart(i)
    t, step = 0.0, config.probe_interval / 4
    while sum(1 for k in counter.known[:n] if k == n - 1) < n:
        t += step
        cluster.run_until(t)
        if t > limit_rounds * config.probe_interval:
            return None
    cluster.run_for(config.sync_interval)  # let the forming-swarm exchanges calm down
    newcomer = cluster.nodes[n]
    newcomer.seeds = [cluster.nodes[cluster.rng.randrange(n)].info.addr]
    watch = _NewcomerWatch(newcomer.info.node_id)
    cluster.observe(watch)
    start = cluster.now
    cluster.restart(n)
    while len(watch.knowers - {n}) < n:
        cluster.run_for(step)
        if cluster.now - start > limit_rounds * config.probe_interval:
            return None
    return (cluster.now - start) / config.probe_interval


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m tests.bench.convergence [N ...] [--seeds K]", file=sys.stderr)
        return 2
    args = list(argv)
    repeats = 3
    if "--seeds" in args:
        k = args.index("--seeds")
        repeats = int(args[k + 1])
        del args[k : k + 2]
    sizes = [int(a) for a in args] or [8, 16, 32, 64, 128, 256, 512]
    print("| N | log2 N | cold start: rounds until all know all (mean, min-max) | per log2 N "
          "| one join: rounds until all know the newcomer (mean, min-max) | per log2 N |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        cells = []
        for measure in (convergence_rounds, join_rounds):
            rounds = [measure(n, seed) for seed in range(repeats)]
            done = [r for r in rounds if r is not None]
            if len(done) < len(rounds):
                cells += [f"not converged in {len(rounds) - len(done)} of {len(rounds)}", ""]
                continue
            mean = sum(done) / len(done)
            cells += [f"{mean:.1f} ({min(done):.2f}-{max(done):.2f})",
                      f"{mean / math.log2(n):.2f}"]
        print(f"| {n} | {math.log2(n):.0f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
