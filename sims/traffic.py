"""Traffic-only mode: model size and fleet size as numbers (up to 1B parameters and 1,000
machines), no gradient computed -- what the links carry, how long steps take, how many
samples per simulated second the swarm gets through.

A sweep point is (machines N, parameters P, method), or (N, charge spec, method). The
scenario's first `[[nodes]]` group is scaled to N machines; the model's FLOPs and memory
follow P (the `[charge]` table with `params = P`: `flops_per_token = 6 P`, 24 B/param), or
follow a whole charge spec of the sweep's `charges` list (charge.py: e.g. an rwkv shape, in
full or in LoRA mode, where P is the adapters and the 16-bit base is held but never sent).
`params` points come first, then `charges` points. Message sizes are the codecs' exact
encoded sizes for P elements (`total_encoded_size`), plus a header.

- gossip: every machine steps back to back at its device's speed and, after each step,
  pushes its encoded gradient to `fanout` peers drawn at random among those it may connect
  to (fire and forget; dropped beyond two in flight to one peer, as the runtime's outbox);
  every `average_every` steps it opens a push-pull averaging exchange with one random peer
  (both directions carry the snapshot the averaging plan covers: full, fp16 or a subset),
  given up as the protocol gives a part up (`PeerTable.give_up`: `average_timeout_margin` x
  its bytes both ways over the bandwidth the machine measured to that peer, between the
  runtime's `average_timeout` of 90 s and `average_timeout_max`; a completed exchange is a
  bandwidth sample, one given up lowers the estimate). The model sends the exchange as one
  transfer where the protocol sends parts of `average_part` coordinates, each with its own
  give-up: its give-up is the formula for the whole exchange. `averages_completed_fraction`
  counts the exchanges whose outcome is known (completed or given up); those still in flight
  when the run ends are `averages_open_at_end`; `averages_across_sites` counts (started,
  completed, given up) of the exchanges between two sites. Nobody waits on the network.
- coordinator: every machine but the coordinator's host is a worker that pulls the weights,
  computes, pushes its gradient and gets the next weights in the reply; the coordinator's
  update costs CPU time as in coordinator.py. Workers wait on the network.

Throughput is samples per simulated second: computed samples for gossip, samples of the
gradients the coordinator applied for the coordinator. Pure: virtual time, seeds only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from p2ptrain.codecs import make_codec
from p2ptrain.proto import AveragingPlan, GossipConfig, NodeConfig, PeerTable
from sims.charge import ModelSize, vector_bytes
from sims.fleet import World
from sims.metrics import Recorder, sig
from sims.scenario import Method, Scenario

HEADER_BYTES = 256
GOSSIP_KNOBS = {"fanout", "codec", "codec_params", "average_every", "averaging",
                "subset_fraction", "average_timeout", "average_timeout_margin",
                "average_timeout_max", "average_every_fast", "average_fast_share"}
COORDINATOR_KNOBS = {"codec", "codec_params", "pull", "update_seconds_per_param"}
SWEEP_KEYS = {"nodes", "params", "charges"}


def sweep_points(scenario: Scenario) -> list[dict[str, Any]]:
    """Every (nodes, params or charge, method) of the sweep, in a fixed order; a charge
    point names its spec by its index in the sweep's `charges`."""
    sweep = scenario.sweep
    unknown = sorted(set(sweep) - SWEEP_KEYS)
    if unknown:
        raise ValueError(f"[sweep]: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(SWEEP_KEYS))}")
    nodes = [int(n) for n in sweep.get("nodes", [scenario.node_count])]
    charges = list(sweep.get("charges", []))
    for spec in charges:
        ModelSize.from_spec(spec)  # refused here, before any point runs
    if "params" in sweep or not charges:
        base = ModelSize.from_spec(scenario.charge or {})
        params = [int(float(p)) for p in sweep.get("params", [base.params])]
    else:
        params = []
    methods = range(len(scenario.methods))
    return ([{"nodes": n, "params": p, "method": k} for p in params for n in nodes
             for k in methods]
            + [{"nodes": n, "charge": c, "method": k} for c in range(len(charges))
               for n in nodes for k in methods])


def point_size(scenario: Scenario, point: dict[str, Any]) -> ModelSize:
    """The model a point is charged for."""
    if "charge" in point:
        return ModelSize.from_spec(scenario.sweep["charges"][point["charge"]])
    spec = dict(scenario.charge or {})
    spec["params"] = point["params"]
    spec.pop("flops_per_token", None)
    return ModelSize.from_spec(spec)


def _world(scenario: Scenario, point: dict[str, Any], seed: int) -> World:
    groups = list(scenario.nodes)
    groups[0] = dataclasses.replace(groups[0], count=point["nodes"])
    return World(scenario, seed, None, point_size(scenario, point), groups=groups)


def run_point(scenario: Scenario, point: dict[str, Any], seed: int) -> dict[str, Any]:
    method = scenario.methods[point["method"]]
    world = _world(scenario, point, seed)
    sim = (GossipTraffic if method.kind == "gossip" else CoordinatorTraffic)(world, method)
    world.engine.run_until(scenario.duration)
    row = sim.recorder.result(world, world.engine.now)
    row.pop("curve")
    row.pop("links")
    row.update({"nodes": point["nodes"], "model_params": world.charged.params})
    if "charge" in point:  # params points keep the rows they always had
        row["charge"] = world.charged.describe()
    m = world.members[0]
    row["step_seconds"] = sig(world.compute_seconds(m))
    row["batch"] = m.batch
    row.update(sim.figures())
    return row


def _check(method: Method, knobs: set[str]) -> dict[str, Any]:
    unknown = sorted(set(method.params) - knobs)
    if unknown:
        raise ValueError(f"traffic {method.kind}: unknown knob(s) {', '.join(unknown)}")
    return method.params


class GossipTraffic:
    def __init__(self, world: World, method: Method):
        p = _check(method, GOSSIP_KNOBS)
        self.world, self.engine, self.network = world, world.engine, world.network
        self.recorder = Recorder(method.name, method.kind, p, None)
        n = world.charged.params
        base = GossipConfig()  # unset knobs: the protocol's defaults, as gossip.py runs
        codec = make_codec(p.get("codec", base.codec),
                           **p.get("codec_params", dict(base.codec_params)))
        self.fanout = int(p.get("fanout", base.fanout))
        self.push_bytes = vector_bytes(codec, n) + HEADER_BYTES
        asked = dataclasses.replace(base, averaging=p.get("averaging", base.averaging))
        mode = asked.averaging_mode(world.charged.flops_per_sample / n)  # auto: as a node would
        plan = AveragingPlan.from_mode(n, mode, float(p.get("subset_fraction",
                                                            base.subset_fraction)))
        self.average_bytes = vector_bytes(plan.codec(), plan.capacity) + HEADER_BYTES
        self.average_every = int(p.get("average_every", base.average_every))
        fast = dataclasses.replace(base, average_fast_share=float(p.get(
            "average_fast_share", base.average_fast_share)))  # its rule, `fast_core`
        speeds = [world.compute_seconds(m) / m.batch for m in world.members]  # s a sample
        fastest = sum(s <= min(speeds) * 1.0001 for s in speeds)
        every_fast = int(p.get("average_every_fast", base.average_every_fast))
        if self.average_every and every_fast and fast.fast_core(fastest, len(speeds)):
            raise ValueError("traffic gossip: this fleet has a fast core (its fastest "
                             f"{fastest} of {len(speeds)} machines) whose every-step "
                             "averaging traffic mode does not model; set "
                             "average_every_fast = 0 (and say so in the method's name)")
        self.average_timeout = float(p.get("average_timeout", NodeConfig().average_timeout))
        self.margin = float(p.get("average_timeout_margin", base.average_timeout_margin))
        self.ceiling = float(p.get("average_timeout_max", base.average_timeout_max))
        self.links = [PeerTable() for _ in world.members]  # what each machine measured
        self.rng = self.engine.rng("traffic-peers")
        self.steps = [0] * len(world.members)
        self.open: dict[int, tuple[int, int, float]] = {}  # machine -> (id, peer, start)
        # of its open averaging exchange
        self.counts = {"pushes": 0, "pushes_delivered": 0, "averages": 0, "averages_done": 0,
                       "averages_given_up": 0}
        self.across = [0, 0, 0]  # exchanges between two sites: started, done, given up
        self.site = [m.site for m in world.members]
        self.give_ups: list[float] = []  # the give-up time of every exchange, seconds
        self.targets = {m.index: [o.index for o in world.members
                                  if o is not m and not o.outbound_only]
                        for m in world.members}
        for m in world.members:
            self.engine.at(0.0, self.step, m.index)

    def step(self, i: int) -> None:
        m = self.world.members[i]
        rng = self.engine.rng(f"compute/{i}")
        seconds = self.world.compute_seconds(m, rng)
        self.engine.after(seconds, self.done, i)

    def done(self, i: int) -> None:
        m = self.world.members[i]
        self.steps[i] += 1
        self.recorder.steps += 1
        self.recorder.samples += m.batch
        targets = self.targets[i]
        for dst in self.rng.sample(targets, min(self.fanout, len(targets))):
            self.counts["pushes"] += 1
            self.recorder.sent("gradient", self.push_bytes)
            self.network.send(i, dst, self.push_bytes, self._pushed, droppable=True)
        if (self.average_every and self.steps[i] % self.average_every == 0
                and i not in self.open and targets):
            self._average(i, self.rng.choice(targets))
        self.step(i)

    def _pushed(self) -> None:
        self.counts["pushes_delivered"] += 1

    def _average(self, i: int, peer: int) -> None:
        self.counts["averages"] += 1
        ident = self.counts["averages"]
        self.open[i] = (ident, peer, self.engine.now)
        self.across[0] += self.site[i] != self.site[peer]
        give_up = self.links[i].give_up(str(peer), 2 * self.average_bytes,
                                        floor=self.average_timeout, margin=self.margin,
                                        ceiling=self.ceiling)
        self.give_ups.append(give_up)
        self.engine.after(give_up, self._give_up, i, ident)
        self.recorder.sent("average", self.average_bytes)
        self.network.send(i, peer, self.average_bytes, lambda: self._answer(peer, i, ident),
                          bulk=True)

    def _answer(self, peer: int, i: int, ident: int) -> None:
        self.recorder.sent("average", self.average_bytes)
        self.network.send(peer, i, self.average_bytes, lambda: self._closed(i, ident),
                          reply=True, bulk=True)

    def _closed(self, i: int, ident: int) -> None:
        if self.open.get(i, (None,))[0] == ident:
            _, peer, start = self.open.pop(i)
            now = self.engine.now
            self.links[i].observe_transfer(str(peer), self.average_bytes, self.average_bytes,
                                           now - start, now)
            self.counts["averages_done"] += 1
            self.across[1] += self.site[i] != self.site[peer]

    def _give_up(self, i: int, ident: int) -> None:
        if self.open.get(i, (None,))[0] == ident:
            _, peer, start = self.open.pop(i)
            self.links[i].observe_shortfall(str(peer), 2 * self.average_bytes,
                                            self.engine.now - start)
            self.counts["averages_given_up"] += 1
            self.across[2] += self.site[i] != self.site[peer]

    def figures(self) -> dict[str, Any]:
        c = self.counts
        decided = c["averages_done"] + c["averages_given_up"]
        give_ups = sorted(self.give_ups)
        return {"push_bytes": self.push_bytes, "average_bytes": self.average_bytes,
                "pushes_delivered_fraction": sig(c["pushes_delivered"] / c["pushes"])
                if c["pushes"] else None,
                "averages_completed_fraction": sig(c["averages_done"] / decided)
                if decided else None,
                "averages_given_up": c["averages_given_up"],
                "averages_open_at_end": len(self.open),
                "averages_across_sites": list(self.across),
                "average_give_up_median_max": [sig(give_ups[len(give_ups) // 2]),
                                               sig(give_ups[-1])] if give_ups else None,
                "throughput": sig(self.recorder.samples / self.engine.now)}


class CoordinatorTraffic:
    def __init__(self, world: World, method: Method):
        p = _check(method, COORDINATOR_KNOBS)
        self.world, self.engine, self.network = world, world.engine, world.network
        self.recorder = Recorder(method.name, method.kind, p, None)
        n = world.charged.params
        codec = make_codec(p.get("codec", "topk"), **p.get("codec_params", {"fraction": 0.01}))
        pull = p.get("pull", "fp32")
        self.push_bytes = vector_bytes(codec, n) + HEADER_BYTES
        self.pull_bytes = vector_bytes(make_codec("none" if pull == "fp32" else pull), n) \
            + HEADER_BYTES
        self.update_seconds = float(p.get("update_seconds_per_param", 1 / 3e9)) * n
        self.cpu_free = 0.0
        self.cpu_busy = 0.0
        self.host = world.fastest()
        self.workers = [m.index for m in world.members if m.index != self.host.index]
        for i in self.workers:
            self.engine.at(0.0, self._pull, i)

    def _pull(self, i: int) -> None:
        self.recorder.sent("pull", HEADER_BYTES)
        self.network.send(i, self.host.index, HEADER_BYTES, lambda: self._reply(i))

    def _reply(self, i: int) -> None:
        self.recorder.sent("weights", self.pull_bytes)
        self.network.send(self.host.index, i, self.pull_bytes, lambda: self._compute(i),
                          reply=True, bulk=True)

    def _compute(self, i: int) -> None:
        m = self.world.members[i]
        rng = self.engine.rng(f"compute/{i}")
        seconds = self.world.compute_seconds(m, rng)
        self.engine.after(seconds, self._push, i)

    def _push(self, i: int) -> None:
        self.recorder.steps += 1
        self.recorder.samples += self.world.members[i].batch
        self.recorder.sent("gradient", self.push_bytes)
        self.network.send(i, self.host.index, self.push_bytes, lambda: self._update(i),
                          bulk=True)

    def _update(self, i: int) -> None:
        start = max(self.engine.now, self.cpu_free)
        self.cpu_free = start + self.update_seconds
        self.cpu_busy += self.update_seconds
        self.recorder.applied_samples += self.world.members[i].batch
        self.engine.at(self.cpu_free, self._reply, i)

    def figures(self) -> dict[str, Any]:
        now = self.engine.now
        host = self.network.endpoints[self.host.index]
        link = host.tx if host.tx is not None else self.network.air[host.site.name]
        per_step = self.push_bytes + self.pull_bytes + HEADER_BYTES
        m = self.world.members[self.workers[0]] if self.workers else self.host
        step = self.world.compute_seconds(m)
        # the coordinator's link carries one pull per worker step: it saturates near
        # N* = link rate x (step + exchange time) / bytes per step
        exchange = per_step / link.rate
        return {"push_bytes": self.push_bytes, "pull_bytes": self.pull_bytes,
                "coordinator_link": link.name,
                "coordinator_link_utilisation": sig(link.utilisation(now)),
                "coordinator_cpu_utilisation": sig(min(self.cpu_busy, now) / now),
                "saturation_nodes": sig((step + exchange) / exchange if math.isfinite(step)
                                        else None),
                "throughput": sig(self.recorder.applied_samples / now)}
