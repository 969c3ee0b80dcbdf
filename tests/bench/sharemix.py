"""Shared increments among some machines, over the simulator's links: a lead toward issue 17's
2x at 100M, measured, not built into the product.

    python -m tests.bench.sharemix [--scenario seed-100m] [--devices server] [--fraction 0.03]
                                   [--value-bytes 2] [--start 0] [--lr 1.2e-2] [--ema 0.99]
                                   [--form follow|keep|sync] [--warmup 0] [--eval-every 5]
                                   [--seeds 1,2,3] [--off]

A scenario's gossip method runs as usual and, besides, the machines of the `--devices`
classes (a group of n) keep an exact account of what they share. Each holds a view v_i
(float32, set to its replica when it starts); after each of its steps a machine sends
q = topk(x_i - v_i) (`--fraction` of the coordinates, values rounded to `--value-bytes`;
1: int8 with one scale) to the n - 1 others over the simulated network (bytes charged as
the charged model's: k values plus the Elias-Fano positions of the product's `topk`), adds
q / n to v_i and q / n - q to x_i -- it keeps its share and gives the rest away -- and each
receiver adds q / n to its replica and its view when the bytes arrive. What is not sent stays
in x_i - v_i (error feedback for free), every increment counts once in every replica, and
with nothing compressed the group moves as one replica fed by all of its steps. A machine
sends only once its last share has arrived everywhere or been lost on the way (the residual
grows meanwhile; a lost part stays lost, the averaging beside draws that replica back).
Before `--start` a machine shares nothing and its view follows its replica (a group formed
late, without a common point); `--form keep`: the views keep the replicas' start (a common
point if they started at one); `--form sync`: they follow, and at `--start` every member of
the group is set to their mean (one perfect, free mix when the group forms). `--off`: the
scenario's method alone, on the same settings.

Throwaway-grade: no security checks, no churn handling beyond skipping machines that are
down. One line per seed and a summary; nothing is written.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from p2ptrain.codecs.positions import coded_size
from sims.fleet import Training, World
from sims.scenario import load
from tests.bench.perfectmix import PerfectMix, add_training_options, gossip_method, variant


class ShareMix(PerfectMix):
    """A gossip run in which the `devices` machines share increments; see the docstring."""

    def __init__(self, world: World, method, devices: set[str], fraction: float,
                 value_bytes: int, start: float, off: bool = False, form: str = "follow"):
        super().__init__(world, method, set(), 1e9, 1e9, False)  # no perfect mix
        self.group, self.fraction, self.value_bytes = devices, fraction, value_bytes
        self.start_sharing, self.off, self.form, self.synced = start, off, form, False
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

    def charged_bytes(self, k: int, n: int) -> int:
        planned = self.world.charged.params
        kept = max(1, round(k * planned / n))
        if kept >= planned:
            return planned * self.value_bytes
        return kept * self.value_bytes + coded_size(planned, kept)

    def compress(self, r: np.ndarray) -> tuple[np.ndarray, int]:
        n = len(r)
        k = max(1, int(n * self.fraction))
        q = np.zeros_like(r)
        if k >= n:
            q[:] = r
        else:
            idx = np.argpartition(np.abs(r), n - k)[n - k:]
            q[idx] = r[idx]
        if self.value_bytes == 1:
            scale = float(np.abs(q).max()) / 127 or 1.0
            q = (np.round(q / scale) * scale).astype(np.float32)
        elif self.value_bytes == 2:
            q = q.astype(np.float16).astype(np.float32)
        return q, min(k, n)

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
        q, k = self.compress(params - self.views[i])
        share = np.float32(1.0 / (len(others) + 1))
        self.views[i] += q * share
        params += q * (share - 1)
        size = self.charged_bytes(k, len(q))
        self.waiting[i] = len(others)
        self.shares += 1
        for j in others:
            self.bytes_sent += size
            if not self.network.send(i, j, size, lambda j=j, g=self.machines[j].generation:
                                     self.land(i, j, g, q * share), bulk=True,
                                     on_lost=lambda: self.land(i, -1, 0, q),
                                     on_cut=lambda: self.land(i, -1, 0, q)):
                self.land(i, -1, 0, q)  # refused at once: that part is lost

    def land(self, i: int, j: int, generation: int, part: np.ndarray) -> None:
        """Part of i's share reaches j (j = -1: lost on the way, or refused)."""
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
    parser.add_argument("--value-bytes", type=int, choices=(1, 2, 4), default=2)
    parser.add_argument("--start", type=float, default=0.0)
    parser.add_argument("--form", choices=("follow", "keep", "sync"), default="follow",
                        help="before --start the views follow the replicas, keep their "
                        "start, or follow and at --start every member is set to the mean")
    parser.add_argument("--off", action="store_true")
    add_training_options(parser)
    args = parser.parse_args(argv)
    args.only, args.period, args.weighted, args.delay = False, 0.28, False, 0.0
    scenario = variant(load(args.scenario), args)
    method = gossip_method(parser, scenario, args.method)
    times = []
    for seed in args.seeds:
        wall = time.monotonic()
        world = World(scenario, seed, Training(scenario))
        sim = ShareMix(world, method, args.devices, args.fraction, args.value_bytes,
                       args.start, args.off, args.form)
        sim.recorder.stop = world.engine.stop
        t = sim.run()["time_to_target"]
        times.append(t)
        rate = sim.bytes_sent / 1e6 / max(t or world.engine.now, 1e-9)
        print(f"seed {seed}: {'not reached' if t is None else f'{t:g} s'}, {sim.shares} "
              f"shares, {rate:.0f} MB/s of shares in the group "
              f"({time.monotonic() - wall:.0f} s wall)", flush=True)
    what = ("off" if args.off else f"{','.join(sorted(args.devices))} share top-k "
            f"{args.fraction:g} in {args.value_bytes}-byte values from {args.start:g} s"
            + (f" ({args.form})" if args.start > 0 else ""))
    print(f"{scenario.name} (lr {scenario.train.get('lr')}, ema {scenario.train.get('ema')}, "
          f"warm-up {scenario.train.get('warmup_samples')}; {what}): "
          + " / ".join("-" if t is None else f"{t:g}" for t in times) + " s")


if __name__ == "__main__":
    main()
