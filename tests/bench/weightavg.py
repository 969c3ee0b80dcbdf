"""Averaging a machine's weights over its own steps, against the fleet (issue 17; BENCHMARKS
§16, 2026-12-03): how much of the fleet's lead over one server is gradient noise that the
server could average away alone.

    python -m tests.bench.weightavg [--scenario seed-100m] [--seeds 1,2,3] [--duration 250]
                                    [--eval-every 10] [--beta 0.99] [--tier server]

Runs the scenario's "one server alone" and "gossip, the default" methods (no stop at the
target) with an exponential moving average of weights kept beside the simulation -- after
each step of a machine, `average = beta x average + (1 - beta) x its weights` -- and
evaluated at every evaluation with the same held-out windows. It prints, per run, the time to
the scenario's target and the final held-out loss of: the server's weights and their
average; the gossip leader's replica (the scenario's deliverable) and its average; the plain
mean of the `--tier` machines' replicas (the servers, by default), and of their averages.
p2ptrain keeps such an average with `train.ema` (on by default in LoRA mode); this bench
keeps its own beside an unchanged run, so one run shows both, and mixes of them p2ptrain
does not make. Run it on a scenario without `[train] ema`. Nothing is written.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.learner import ema_decay
from sims import run as sims_run
from sims.allreduce import SoloSim
from sims.gossip import GossipSim
from sims.scenario import Scenario, load

SOLO, GOSSIP = "one server alone", "gossip, the default"


class Averages:
    """One exponential moving average of weights per key (a machine and its incarnation),
    with the decay `train.ema` gives a node (`p2ptrain.learner.ema_decay`: `beta`, lower
    while the average is young)."""

    def __init__(self, beta: float):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), not {beta}")
        self.beta = beta
        self.of: dict[object, np.ndarray] = {}
        self.steps: dict[object, int] = {}

    def update(self, key: object, params: np.ndarray) -> None:
        avg = self.of.get(key)
        if avg is None:  # the first step: the average starts at the weights
            self.of[key], self.steps[key] = params.copy(), 1
            return
        decay = ema_decay(self.beta, self.steps[key])
        self.steps[key] += 1
        avg *= decay
        avg += (1.0 - decay) * params


@dataclass
class Curves:
    """Held-out loss over time of each evaluated model, and when it first reached the target."""

    target: float
    points: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, name: str, t: float, loss: float) -> None:
        self.points.setdefault(name, []).append((t, loss))

    def reached(self, name: str) -> float | None:
        return next((t for t, loss in self.points.get(name, []) if loss <= self.target), None)

    def final(self, name: str) -> float | None:
        pts = self.points.get(name)
        return pts[-1][1] if pts else None


class AveragedSolo(SoloSim):
    def __init__(self, world, method, averages: Averages, curves: Curves):
        super().__init__(world, method)
        self.averages, self.curves = averages, curves

    def _done(self, loss: float) -> None:
        super()._done(loss)  # applies the step (and starts the next gradient)
        self.averages.update("solo", self.learner.params)

    def evaluate(self) -> None:
        t, heldout = self.engine.now, self.training.heldout_loss
        self.curves.add("weights", t, heldout(self.learner.params))
        if "solo" in self.averages.of:
            self.curves.add("average", t, heldout(self.averages.of["solo"]))
        super().evaluate()


class AveragedGossip(GossipSim):
    def __init__(self, world, method, averages: Averages, curves: Curves, tier: set[str]):
        super().__init__(world, method)
        self.averages, self.curves, self.tier = averages, curves, tier

    def _step_done(self, i: int, generation: int, step: int, loss: float) -> None:
        super()._step_done(i, generation, step, loss)
        mach = self.machines[i]
        if mach.node is not None and mach.generation == generation:
            self.averages.update((i, mach.incarnation), mach.node.learner.params)

    def measure(self) -> None:
        super().measure()
        t, heldout, live = self.engine.now, self.training.heldout_loss, self.live()
        avg = {m.member.index: self.averages.of.get((m.member.index, m.incarnation))
               for m in live}
        leaders = [(m.node.control.term, m.member.index, m) for m in live if m.node.is_leader]
        if leaders:
            _, index, leader = max(leaders, key=lambda x: x[:2])
            self.curves.add("leader", t, heldout(leader.node.learner.params))
            if avg[index] is not None:
                self.curves.add("leader average", t, heldout(avg[index]))
        tier = [m for m in live if m.member.device.name in self.tier]
        if tier:
            self.curves.add("tier mean", t, heldout(
                np.mean([m.node.learner.params for m in tier], axis=0)))
            averaged = [a for m in tier if (a := avg[m.member.index]) is not None]
            if len(averaged) == len(tier):
                self.curves.add("tier average mean", t, heldout(np.mean(averaged, axis=0)))


@contextmanager
def simulators(**kinds):
    """sims.run's simulators for `kinds` replaced while inside (restored also on errors)."""
    saved = dict(sims_run.SIMULATORS)
    sims_run.SIMULATORS.update(kinds)
    try:
        yield
    finally:
        sims_run.SIMULATORS.clear()
        sims_run.SIMULATORS.update(saved)


def run_one(scenario: Scenario, name: str, seed: int, beta: float,
            tier: set[str]) -> Curves:
    """One method of `scenario` on `seed`, its whole duration, with averages kept."""
    method = next((m for m in scenario.methods if m.name == name), None)
    if method is None:
        raise ValueError(f"scenario {scenario.name} has no method {name!r}")
    curves = Curves(scenario.target_loss)
    kinds = {"solo": lambda w, m: AveragedSolo(w, m, Averages(beta), curves),
             "gossip": lambda w, m: AveragedGossip(w, m, Averages(beta), curves, tier)}
    with simulators(**kinds):
        sims_run.run_method(scenario.replace(stop_at_target=False), method, seed)
    return curves


def describe(curves: Curves, name: str) -> str:
    t, final = curves.reached(name), curves.final(name)
    when = "not reached" if t is None else f"{t:g} s"
    return f"{name} {when} ({final:.4f})" if final is not None else f"{name}: none"


def main(argv: list[str] | None = None) -> dict[tuple[str, int], Curves]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="seed-100m")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--duration", type=float, default=250.0,
                        help="simulated seconds each run goes (no stop at the target)")
    parser.add_argument("--eval-every", type=float, default=10.0)
    parser.add_argument("--beta", type=float, default=0.99,
                        help="the average's decay per step (0.99: about the last 100 steps)")
    parser.add_argument("--tier", default="server",
                        help="device names whose replicas' mean is evaluated (comma-separated)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        Averages(args.beta)
    except ValueError as e:
        parser.error(str(e))
    if not seeds or not args.duration > 0 or not args.eval_every > 0:
        parser.error("give at least one seed, a duration > 0 and an evaluation period > 0")
    scenario = load(args.scenario).replace(duration=args.duration, eval_every=args.eval_every)
    if scenario.train.get("ema"):
        parser.error(f"{args.scenario} sets [train] ema: its runs' weights are averaged "
                     "already; give a scenario without it (seed-1b-lora, not seed-1b-lora-ema)")
    tier = set(filter(None, args.tier.split(",")))
    out = {}
    for name, shown in ((SOLO, ("weights", "average")),
                        (GOSSIP, ("leader", "leader average", "tier mean",
                                  "tier average mean"))):
        for seed in seeds:
            t0 = time.perf_counter()
            curves = out[name, seed] = run_one(scenario, name, seed, args.beta, tier)
            print(f"{args.scenario} seed {seed} {name}: "
                  + "; ".join(describe(curves, s) for s in shown)
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


if __name__ == "__main__":
    main()
