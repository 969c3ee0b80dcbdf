"""Shared increments among some machines, over the simulator's links: a lead toward issue 17's
2x at 100M, measured, not built into the product.

    python -m tests.bench.sharemix [--scenario seed-100m] [--devices server] [--fraction 0.03]
                                   [--codec topk|randomk] [--values fp16]
                                   [--start 0 [--form follow|keep|sync]]
                                   [--overhead X | --work S] [--lr 1.2e-2] [--ema 0.99]
                                   [--warmup 0] [--eval-every 5] [--seeds 1,2,3] [--off]

A scenario's gossip method runs as usual and, besides, the machines of the `--devices`
classes (a group of n) keep an exact account of what they share. Each holds a view v_i
(float32, set to its replica when it starts); after each of its steps a machine sends
q = topk(x_i - v_i) -- the product's `topk` codec (or `randomk`, at positions a seed drawn
for each share gives), `--fraction` of each chunk's coordinates in `--values`, as a receiver
decodes it -- to the n - 1 others over the simulated network
(charged its exact bytes for the charged model), adds q / n to v_i and q / n - q to x_i -- it
keeps its share and gives the rest away -- and each receiver adds q / n to its replica and its
view when the bytes arrive. What is not sent stays in x_i - v_i (error feedback for free),
every increment counts once in every replica, and with nothing compressed the group moves as
one replica fed by all of its steps. A machine sends only once its last share has arrived
everywhere or been lost on the way (the residual grows meanwhile; a lost part stays lost, the
averaging beside draws that replica back). Before `--start` a machine shares nothing and its
view follows its replica (a group formed late, without a common point); `--form keep`: the
views keep the replicas' start (a common point if they started at one); `--form sync`: they
follow, and at `--start` every member of the group is set to their mean (one perfect, free
mix when the group forms). A member that adopts a checkpoint starts its view again there.
`--off`: the scenario's method alone, on the same settings.

**The shares' own work is free unless `--overhead` says otherwise**: the difference, the
top-k selection and the view's update over the whole vector after every step (at 100M about
0.4-0.6 s of one core here, more than a server's 0.28 s step) take no simulated time;
`--overhead X` makes the group's steps 1 + X times as long (the device's `overhead`), the
cost of that work done in the step's stead; `--work S` has it done beside the steps (another
core): a share is taken from the residual at the step's end and leaves S seconds later, the
sender giving it away then.

Throwaway-grade: no security checks; the sender knows at once which members are up (a real
node learns it late). One line per seed and a summary; nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from p2ptrain.codecs import make_codec
from sims.charge import vector_bytes
from sims.fleet import Training, World
from sims.scenario import load
from tests.bench.perfectmix import PerfectMix, add_training_options, gossip_method, variant


class ShareMix(PerfectMix):
    """A gossip run in which the `devices` machines share increments; see the docstring."""

    def __init__(self, world: World, method, devices: set[str], fraction: float,
                 values: str, start: float, off: bool = False, form: str = "follow",
                 codec: str = "topk", work: float = 0.0):
        super().__init__(world, method, set(), 1e9, 1e9, False)  # no perfect mix
        self.group, self.start_sharing, self.off, self.form = devices, start, off, form
        self.codec = make_codec(codec, fraction=fraction, values=values)
        self.charged = vector_bytes(self.codec, world.charged.params)
        self.synced, self.work = False, work
        self.views: dict[int, np.ndarray] = {}
        self.waiting: dict[int, int] = {}  # machine -> deliveries of its last share pending
        self.shares = 0
        self.bytes_sent = 0

    def start(self, i: int) -> None:
        super().start(i)
        mach = self.machines[i]
        if mach.member.device.name not in self.group:
            return
        learner = mach.node.learner
        self.views[i] = learner.params.copy()
        self.waiting[i] = 0
        apply, generation = learner.apply_gradient, mach.generation

        def stepped(grad, loss):
            result = apply(grad, loss)
            self.share(i, generation)
            return result

        learner.apply_gradient = stepped

    def adopt(self, i: int, action) -> None:
        """A member that adopts a checkpoint (back from a failure) has nothing of its own to
        share: its view starts again at the weights it adopted."""
        super().adopt(i, action)
        if i in self.views and self.machines[i].node is not None:
            self.views[i][:] = self.machines[i].node.learner.params

    def compress(self, r: np.ndarray) -> np.ndarray:
        """q: what the product's codec keeps of r, as a receiver decodes it (`randomk`: at the
        positions of a seed each share draws anew, which travels in the chunk's header)."""
        q = np.zeros_like(r)
        seed = self.shares + 1
        self.codec.decode_into(self.codec.encode(r, seed), q, 1.0, seed)
        return q

    def share(self, i: int, generation: int) -> None:
        mach = self.machines[i]
        if mach.generation != generation or mach.node is None:
            return
        params = mach.node.learner.params
        if self.off or self.engine.now < self.start_sharing:
            if self.form == "follow":
                self.views[i][:] = params
            return
        if self.form == "sync" and not self.synced:
            self.synced = True  # the group formed: every member at the mean, views with it
            up = [self.machines[j].node.learner.params for j in self.views
                  if self.machines[j].node is not None]
            mean = np.mean(up, axis=0, dtype=np.float64).astype(np.float32)
            for j in self.views:
                if self.machines[j].node is not None:
                    self.machines[j].node.learner.params[:] = mean
                    self.views[j][:] = mean
        others = [j for j in self.views if j != i and self.machines[j].node is not None]
        if not others or self.waiting[i]:
            return
        q = self.compress(params - self.views[i])
        self.waiting[i] = len(others)
        self.shares += 1
        if self.work > 0:  # selected beside the steps: it leaves `work` seconds later
            self.engine.after(self.work, self.give, i, generation, others, q)
        else:
            self.give(i, generation, others, q)

    def give(self, i: int, generation: int, others: list[int], q: np.ndarray) -> None:
        """i gives q away: keeps its share, sends the rest to `others`."""
        mach = self.machines[i]
        if mach.generation != generation or mach.node is None:
            return
        share = np.float32(1.0 / (len(others) + 1))
        self.views[i] += q * share
        mach.node.learner.params += q * (share - 1)
        for j in others:
            self.bytes_sent += self.charged

            def lost(i=i, g=generation) -> None:
                self.land(i, g, -1, 0, q)

            if not self.network.send(i, j, self.charged, lambda j=j, g=self.machines[j].generation:
                                     self.land(i, generation, j, g, q * share), bulk=True,
                                     on_lost=lost, on_cut=lost):
                lost()  # refused at once: that part is lost

    def land(self, i: int, sender: int, j: int, generation: int, part: np.ndarray) -> None:
        """Part of i's share (sent by its incarnation `sender`) reaches j (j = -1: lost on the
        way, or refused)."""
        if self.machines[i].generation == sender:  # not a part of an incarnation before
            self.waiting[i] = max(0, self.waiting[i] - 1)
        if j < 0:
            return
        mach = self.machines[j]
        if mach.node is not None and mach.generation == generation:
            mach.node.learner.params += part
            self.views[j] += part


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="seed-100m")
    parser.add_argument("--method", default="gossip, the default")
    parser.add_argument("--devices", type=lambda s: {d for d in s.split(",") if d},
                        default={"server"})
    parser.add_argument("--fraction", type=float, default=0.03)
    parser.add_argument("--codec", choices=("topk", "randomk"), default="topk",
                        help="randomk: seeded positions, values only, no selection")
    parser.add_argument("--values", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="the codec's value type")
    parser.add_argument("--overhead", type=float,
                        help="the group's host work beside the gradient, as a share of its "
                        "step time (the device's `overhead`): the shares' own cost")
    parser.add_argument("--work", type=float, default=0.0,
                        help="s a share's selection takes beside the steps (another core): "
                        "it leaves, and the sender gives it away, that much later")
    parser.add_argument("--start", type=float, default=0.0)
    parser.add_argument("--form", choices=("follow", "keep", "sync"), default="follow",
                        help="before --start the views follow the replicas, keep their "
                        "start, or follow and at --start every member is set to the mean")
    parser.add_argument("--off", action="store_true")
    add_training_options(parser)
    args = parser.parse_args(argv)
    args.only, args.period, args.weighted, args.delay = False, 0.28, False, 0.0
    scenario = variant(load(args.scenario), args)
    missing = args.devices - {g.device for g in scenario.nodes}
    if missing:
        parser.error(f"no machine of {', '.join(sorted(missing))} in {scenario.name}")
    if args.overhead is not None:
        scenario = scenario.replace(devices={
            name: dataclasses.replace(d, overhead=args.overhead) if name in args.devices else d
            for name, d in scenario.devices.items()})
    method = gossip_method(parser, scenario, args.method)
    times = []
    for seed in args.seeds:
        wall = time.monotonic()
        world = World(scenario, seed, Training(scenario))
        sim = ShareMix(world, method, args.devices, args.fraction, args.values,
                       args.start, args.off, args.form, args.codec, args.work)
        sim.recorder.stop = world.engine.stop
        t = sim.run()["time_to_target"]
        times.append(t)
        rate = sim.bytes_sent / 1e6 / max(t or world.engine.now, 1e-9)
        print(f"seed {seed}: {'not reached' if t is None else f'{t:g} s'}, {sim.shares} "
              f"shares, {rate:.0f} MB/s of shares in the group "
              f"({time.monotonic() - wall:.0f} s wall)", flush=True)
    kind = "top-k" if args.codec == "topk" else "random-k"
    what = ("off" if args.off else f"{','.join(sorted(args.devices))} share {kind} "
            f"{args.fraction:g} {args.values} from {args.start:g} s"
            + (f" ({args.form})" if args.start > 0 else "")
            + (f", its work {args.work:g} s beside the steps" if args.work else "")
            + (f", steps {1 + args.overhead:g}x as long" if args.overhead else ""))
    print(f"{scenario.name} (lr {scenario.train.get('lr')}, ema {scenario.train.get('ema')}, "
          f"warm-up {scenario.train.get('warmup_samples')}; {what}): "
          + " / ".join("-" if t is None else f"{t:g}" for t in times) + " s")


if __name__ == "__main__":
    main()
