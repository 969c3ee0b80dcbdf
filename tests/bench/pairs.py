"""How far the replicas of a small swarm averaging every step stay apart, and how many
exchanges that takes: N nodes of the virtual-time harness (tests/test_node.py: the real
protocol node and learner, a modelled network, 0.25 s steps) averaging whole vectors after
every step (LoRA mode's pattern), no gradient pushes.

    python -m tests.bench.pairs [--nodes 2] [--seeds 1,2,3] [--seconds 60]

Prints, per seed, the consensus distance of the replicas at 10 / 20 / 40 / 60 s (or the
quarter points of `--seconds`), and the exchanges the swarm started, applied (both sides
count), declined as crossing, skipped because every partner was resting, and the steps
each node took at least. Virtual time:
the figures do not depend on the machine's load."""

from __future__ import annotations

import argparse
import sys

from p2ptrain.proto.gossip.averaging import consensus_distance
from p2ptrain.proto.gossip.config import GossipConfig
from tests.test_node import cluster

KEYS = ("average_started", "average_applied", "average_declined_crossing",
        "average_partners_resting")


def run(nodes: int, seed: int, seconds: float) -> tuple[list[float], dict[str, int]]:
    """(distances at the checkpoints, the swarm's exchange counts) of one run."""
    c = cluster(nodes, step_seconds=0.25, seed=seed, gossip=GossipConfig(
        fanout=0, average_every=1, averaging="full", average_every_fast=0))
    marks = [10.0, 20.0, 40.0, 60.0] if seconds == 60 else [seconds * q / 4 for q in (1, 2, 3, 4)]
    distances = []
    for t in marks:
        c.run_until(t)
        distances.append(consensus_distance([c.training_node(i).learner.params
                                             for i in range(nodes)]))
    counts = {k: sum(c.training_node(i).trainer.stats.get(k, 0) for i in range(nodes))
              for k in KEYS}
    counts["steps"] = min(c.training_node(i).learner.step for i in range(nodes))  # each took
    return distances, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.pairs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be integers: {args.seeds!r}")
    if args.nodes < 2 or not args.seconds > 0:
        ap.error("--nodes must be at least 2 and --seconds above 0")
    for seed in seeds:
        distances, counts = run(args.nodes, seed, args.seconds)
        print(f"{args.nodes} nodes, seed {seed}: distance "
              + " / ".join(f"{d:.2e}" for d in distances)
              + "; " + ", ".join(f"{k.removeprefix('average_')} {v}" for k, v in counts.items()),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
