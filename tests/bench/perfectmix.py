"""The simulator's own ceiling for a fleet: some machines' replicas mixed perfectly and for free.

    python -m tests.bench.perfectmix [--scenario seed-100m] [--method "gossip, the default"]
                                     [--devices server[,desktop]] [--weighted] [--start S]
                                     [--period P] [--delay D] [--only] [--lr 1.2e-2]
                                     [--outer-lr 0.7 --outer-momentum 0.9]
                                     [--ema 0.99] [--warmup 0] [--eval-every 5] [--seeds 1,2,3]
                                     [--solo [--solo-lr 8e-3]]

Issue 17 asks for a fleet 2x faster than its best single machine. This asks the simulator
what the best *any* exchange could do there: a scenario's method runs as usual (its links,
joins, averaging, the leader's replica as the deliverable), and besides, every `--period`
simulated seconds from `--start` on, the replicas of the machines of the `--devices`
classes are replaced by their mean (weighted by each machine's sample rate with
`--weighted`) -- what a perfect all-reduce taking no time and no bytes would give; with
`--delay D` each lands D seconds later as a move by (mean - its own snapshot), the steps
taken meanwhile kept (an all-reduce overlapping the next steps, as the product's averaging
does). With `--outer-lr` the mix is DiLoCo's outer step instead: the machines share an anchor
(their first mean), each mix takes the pseudo-gradient d = anchor - mean, a Nesterov step
with `--outer-momentum` m = mu m + d, anchor -= outer_lr (d + mu m), and every replica is set
to the new anchor (outer lr 1, momentum 0 is the plain mix). `--only` keeps just those
machines in the fleet. `--solo` runs the scenario's server
alone too (the same settings, or at `--solo-lr`) and prints the ratio of the medians. The
mean is taken at whatever moment the tick falls, a step in flight included (its gradient was
computed on the replica before).

`--lr`, `--ema` and `--warmup` replace the scenario's `[train] lr`, `ema` and
`warmup_samples` (BENCHMARKS §16's fairer reading: the server alone is best with no warm-up
and `ema = 0.99`); `--eval-every` its evaluation grid. One line per run; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sims.fleet import Training, World
from sims.gossip import GossipSim
from sims.run import run_method
from sims.scenario import Method, Scenario, load


class PerfectMix(GossipSim):
    """A gossip run whose `devices` replicas are set to their mean every `period` s."""

    def __init__(self, world: World, method: Method, devices: set[str], period: float,
                 start: float, weighted: bool, delay: float = 0.0,
                 outer: tuple[float, float] | None = None):
        super().__init__(world, method)
        self.devices, self.period, self.start_at, self.weighted = devices, period, start, weighted
        self.delay, self.outer = delay, outer
        self.anchor: np.ndarray | None = None  # with `outer`: the shared point and its momentum
        self.momentum: np.ndarray | None = None
        self.mixes = 0

    def _target(self, mean: np.ndarray) -> np.ndarray:
        """Where a mix sets the replicas: their mean, or the anchor after an outer step."""
        if self.outer is None:
            return mean
        if self.anchor is None:
            self.anchor, self.momentum = mean, np.zeros_like(mean)
            return mean
        lr, mu = self.outer
        delta = self.anchor - mean  # the pseudo-gradient of the steps since the last mix
        self.momentum = mu * self.momentum + delta
        self.anchor = (self.anchor - lr * (delta + mu * self.momentum)).astype(np.float32)
        return self.anchor

    def _mix(self) -> None:
        up = [m for m in self.machines
              if m.node is not None and m.member.device.name in self.devices]
        if len(up) > 1 and self.engine.now >= self.start_at:
            rates = np.array([m.member.batch / self.world.compute_seconds(m.member)
                              if self.weighted else 1.0 for m in up])
            stacked = np.stack([m.node.learner.params for m in up])
            mean = self._target(np.tensordot(rates / rates.sum(), stacked, 1).astype(np.float32))
            if self.delay > 0:  # each lands on the mean of the snapshots, its steps since kept
                moves = [(m, m.generation, mean - row) for m, row in zip(up, stacked, strict=True)]
                self.engine.after(self.delay, self._land, moves)
            else:
                for m in up:
                    m.node.learner.params[:] = mean
                self.mixes += 1
        self.engine.after(self.period, self._mix)

    def _land(self, moves: list) -> None:
        for m, generation, move in moves:
            if m.node is not None and m.generation == generation:  # not restarted since
                m.node.learner.params += move
        self.mixes += 1

    def run(self) -> dict:
        self.engine.at(0.0, self._mix)
        return super().run()


def variant(scenario: Scenario, args: argparse.Namespace) -> Scenario:
    train = dict(scenario.train)
    for key, value in (("lr", args.lr), ("ema", args.ema), ("warmup_samples", args.warmup)):
        if value is not None:
            train[key] = value
    changes = {"train": train, "stop_at_target": True}
    if args.eval_every is not None:
        changes["eval_every"] = args.eval_every
    if args.only:
        changes["nodes"] = tuple(g for g in scenario.nodes if g.device in args.devices)
    return scenario.replace(**changes)


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """--lr, --ema, --warmup and --eval-every (what `variant` reads) and --seeds."""
    parser.add_argument("--lr", type=float)
    parser.add_argument("--ema", type=float)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--eval-every", type=float)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 3])


def gossip_method(parser: argparse.ArgumentParser, scenario: Scenario, name: str) -> Method:
    """The scenario's gossip method called `name`; a usage error naming its methods if none."""
    by_name = {m.name: m for m in scenario.methods}
    if name not in by_name or by_name[name].kind != "gossip":
        parser.error(f"no gossip method {name!r} in {scenario.name}; its methods: "
                     + "; ".join(by_name))
    return by_name[name]


def run(scenario: Scenario, method: Method, seed: int, args: argparse.Namespace) -> float | None:
    """Time to target of one run (`scenario` stops at the target: `variant`); anything but a
    gossip method with devices to mix runs as `python -m sims` runs it (a method's own lr)."""
    if method.kind != "gossip" or not args.devices:
        return run_method(scenario, method, seed)["time_to_target"]
    world = World(scenario, seed, Training(scenario))
    outer = None if args.outer_lr is None else (args.outer_lr, args.outer_momentum)
    sim = PerfectMix(world, method, set(args.devices), args.period, args.start, args.weighted,
                     args.delay, outer)
    sim.recorder.stop = world.engine.stop
    return sim.run()["time_to_target"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="seed-100m")
    parser.add_argument("--method", default="gossip, the default",
                        help="a gossip method of the scenario, by name")
    parser.add_argument("--devices", type=lambda s: [d for d in s.split(",") if d],
                        default=["server"], help="device classes mixed perfectly ('' none)")
    parser.add_argument("--weighted", action="store_true",
                        help="mean weighted by each machine's sample rate")
    parser.add_argument("--start", type=float, default=0.0, help="first mix, simulated s")
    parser.add_argument("--period", type=float, default=0.28, help="s between mixes")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="s from a mix's snapshots to its landing (0: at once)")
    parser.add_argument("--only", action="store_true", help="the fleet is just --devices")
    parser.add_argument("--outer-lr", type=float,
                        help="mix by DiLoCo's outer step (Nesterov) with this outer lr")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="its momentum (with --outer-lr)")
    add_training_options(parser)
    parser.add_argument("--solo", action="store_true", help="the server alone besides")
    parser.add_argument("--solo-lr", type=float, help="its learning rate (default: --lr)")
    args = parser.parse_args(argv)
    if args.only and not args.devices:
        parser.error("--only keeps the --devices machines: name at least one class")
    scenario = variant(load(args.scenario), args)
    rows = [("mixed", gossip_method(parser, scenario, args.method))]
    if args.solo:
        params = {"device": "server"} | ({"lr": args.solo_lr} if args.solo_lr else {})
        rows.append(("solo", Method("one server alone", "solo", params)))
    medians, seen = {}, {}
    for label, method in rows:
        times = []
        for seed in args.seeds:
            wall = time.monotonic()
            t = run(scenario, method, seed, args)
            times.append(t)
            print(f"{label}: {method.name}, seed {seed}: "
                  f"{'not reached' if t is None else f'{t:g} s'} "
                  f"({time.monotonic() - wall:.0f} s wall)", flush=True)
        seen[label] = " / ".join("-" if t is None else f"{t:g}" for t in times)
        reached = [t for t in times if t is not None]
        medians[label] = statistics.median(reached) if len(reached) == len(times) else None
    what = ("nothing" if not args.devices else
            f"{','.join(args.devices)} {'rate-weighted ' if args.weighted else ''}mean every "
            f"{args.period:g} s from {args.start:g} s"
            + (f", landing {args.delay:g} s late" if args.delay else "")
            + (f", as an outer step (lr {args.outer_lr:g}, Nesterov momentum "
               f"{args.outer_momentum:g})" if args.outer_lr is not None else ""))
    print(f"{scenario.name} (lr {scenario.train.get('lr')}, ema {scenario.train.get('ema')}, "
          f"warm-up {scenario.train.get('warmup_samples')}; perfect mix: {what}"
          f"{', only those machines' if args.only else ''}): {seen['mixed']} s", end="")
    if args.solo and medians["mixed"] and medians.get("solo"):
        print(f"; the server alone {seen['solo']} s: medians "
              f"{medians['solo'] / medians['mixed']:.2f}x", end="")
    print()


if __name__ == "__main__":
    main()
