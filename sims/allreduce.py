"""Baselines (b) and (c): synchronous ring all-reduce, and one machine training alone.

Ring all-reduce (dense fp32, the data-parallel reference): every step, each machine of the
ring computes a gradient on its own batch from the same weights (real numpy on the proxy;
the device's modelled time for the charged model), all wait for the slowest, then the
gradients are summed by the classic ring: 2(n-1) phases, in each of which every machine sends
a 1/n slice (4 x params / n bytes of the charged model, plus a header) to its successor; a
phase ends when all its slices have arrived. The batch-weighted mean gradient is then applied
once with AdamW, so every replica stays identical (one parameter vector is kept). The ring
is ordered by site, so it crosses between sites twice. Connections are long-lived and opened
by each machine to its successor, which passes NAT (a slice is sent like a reply). A slice
lost on the way is sent again after `retransmit` seconds (TCP); a ring member that is down or
cut off stalls a phase, and `timeout` s after the phase began the step is dropped and the
ring re-formed from the machines that are up and reachable from the first of them. A machine
that returns joins at the next step (the weights it would fetch are not charged).

One machine alone: the chosen device (`device`, default the fastest machine) trains on its
own batch, no network. Its failures pause it; it resumes from its own state.
Pure: virtual time, seeds only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from sims.fleet import World
from sims.metrics import Recorder
from sims.scenario import Method

HEADER_BYTES = 256


class _Synchronous(ABC):
    """Shared by both: one parameter vector, evaluation, failures."""

    def __init__(self, world: World, method: Method, knobs: set[str]):
        unknown = sorted(set(method.params) - knobs)
        if unknown:
            raise ValueError(f"{method.kind} method: unknown knob(s) {', '.join(unknown)}")
        self.world, self.engine, self.network = world, world.engine, world.network
        self.training = world.training
        self.recorder = Recorder(method.name, method.kind, method.params,
                                 world.scenario.target_loss)
        self.up = {m.index: True for m in world.members}
        self.master = self.training.learner(world.members[0].node_id, 1)
        self.done = False

    def fail(self, i: int) -> None:
        self.up[i] = False

    def back(self, i: int) -> None:
        self.up[i] = True

    def deliverable_loss(self) -> float:
        """The held-out loss of what a checkpoint carries: the weights, or with `train.ema`
        their average."""
        return self.training.heldout_loss(self.master.checkpoint_weights)

    def evaluate(self) -> None:
        self.recorder.point(self.engine.now, [self.deliverable_loss()])
        if self.master.finished:
            self.recorder.ended_at = self.engine.now
            self.engine.stop()
            return
        self.engine.after(self.world.scenario.eval_every, self.evaluate)

    def run(self) -> dict:
        world, engine = self.world, self.engine
        world.schedule_churn(self.fail, self.back)  # no leader to kill
        engine.at(0.0, self.evaluate)
        engine.at(0.0, self.step)
        engine.run_until(world.scenario.duration)
        curve = self.recorder.curve
        if self.recorder.ended_at is None and (not curve or curve[-1][0] != engine.now):
            self.recorder.point(engine.now, [self.deliverable_loss()])
        return self.recorder.result(world, engine.now)

    def apply(self, grad: np.ndarray, samples: int, loss: float) -> None:
        master = self.master
        master.batch = samples  # the step's samples: what the swarm count is credited
        master.apply_gradient(grad, loss)
        self.recorder.steps += 1
        self.recorder.applied_samples += samples

    @abstractmethod
    def step(self) -> None:
        """Start the next synchronous step (each method says how)."""


class RingSim(_Synchronous):
    """Synchronous data parallelism over a ring; see the module docstring."""

    def __init__(self, world: World, method: Method):
        super().__init__(world, method, {"timeout", "retransmit"})
        self.timeout = float(method.params.get("timeout", 10.0))
        self.retransmit = float(method.params.get("retransmit", 0.2))
        site_order = {s.name: k for k, s in enumerate(world.scenario.sites)}
        self.order = sorted(world.members, key=lambda m: (site_order[m.site], m.index))
        self.learners = {}
        for m in world.members:
            learner = self.training.learner(m.node_id, m.batch)
            learner.params = self.master.params  # one replica: everyone computes on it
            self.learners[m.index] = learner
        self.grad = np.zeros_like(self.master.params)
        self.attempt = 0
        self.stalls = 0

    def ring(self) -> list[int]:
        up = [m.index for m in self.order if self.up[m.index]]
        if not up:
            return []
        first = up[0]
        # connections are opened outward by each member, so NAT does not matter: only a
        # partition does
        return [i for i in up if self.network.reachable(first, i, reply=True)]

    def step(self) -> None:
        ring = self.ring()
        if not ring:
            self.engine.after(1.0, self.step)
            return
        self.attempt += 1
        attempt = self.attempt
        self.grad.fill(0.0)
        samples, losses, slowest = 0, [], 0.0
        for i in ring:
            m = self.world.members[i]
            learner = self.learners[i]
            losses.append(learner.compute_gradient())
            self.grad += m.batch * learner.grad
            samples += m.batch
            rng = self.engine.rng(f"compute/{i}")
            slowest = max(slowest, self.world.compute_seconds(m, rng))
        self.recorder.samples += samples
        self.grad *= 1.0 / samples
        loss = float(np.mean(losses))
        self.engine.after(slowest, self._phase, ring, 0, attempt, samples, loss)

    def _phase(self, ring: list[int], k: int, attempt: int, samples: int, loss: float) -> None:
        if attempt != self.attempt:
            return
        n = len(ring)
        if k >= 2 * (n - 1):
            self.attempt += 1  # the stall timer of this attempt is now moot
            self.apply(self.grad, samples, loss)
            if not self.master.finished:
                self.step()
            return
        size = math.ceil(4 * self.world.charged.params / n) + HEADER_BYTES
        pending = {"left": n}
        self.engine.after(self.timeout, self._stalled, attempt, pending)

        def arrived() -> None:
            pending["left"] -= 1
            if pending["left"] == 0:
                self._phase(ring, k + 1, attempt, samples, loss)

        for j, src in enumerate(ring):
            self._slice(src, ring[(j + 1) % n], size, attempt, arrived)

    def _slice(self, src: int, dst: int, size: int, attempt: int, arrived) -> None:
        if attempt != self.attempt or not (self.up[src] and self.up[dst]):
            return  # the step stalls; its timer re-forms the ring
        self.recorder.sent("slice", size)

        def delivered() -> None:
            if attempt == self.attempt and self.up[dst]:
                arrived()

        def lost(_t=None) -> None:
            self.engine.after(self.retransmit, self._slice, src, dst, size, attempt, arrived)

        if not self.network.send(src, dst, size, delivered, reply=True, bulk=True,
                                 on_lost=lost):
            lost()

    def _stalled(self, attempt: int, pending: dict) -> None:
        """A phase still waits for slices `timeout` s after it began: a member is down or
        cut off. Drop the step and re-form the ring."""
        if attempt != self.attempt or pending["left"] == 0:
            return
        self.stalls += 1
        self.recorder.extra["ring_stalls"] = self.stalls
        self.step()


class SoloSim(_Synchronous):
    """One machine alone; see the module docstring."""

    def __init__(self, world: World, method: Method):
        super().__init__(world, method, {"device"})
        name = method.params.get("device")
        chosen = [m for m in world.members if m.device.name == name] if name else []
        self.member = chosen[0] if chosen else world.fastest()
        self.learner = self.master
        self.learner.batch = self.member.batch
        self.recorder.extra["solo"] = {"index": self.member.index,
                                       "device": self.member.device.name,
                                       "batch": self.member.batch}

    def step(self) -> None:
        m = self.member
        if not self.up[m.index]:
            self.engine.after(1.0, self.step)
            return
        loss = self.learner.compute_gradient()
        self.recorder.samples += m.batch
        rng = self.engine.rng("compute/solo")
        seconds = self.world.compute_seconds(m, rng)
        self.engine.after(seconds, self._done, loss)

    def _done(self, loss: float) -> None:
        self.learner.batch = self.member.batch
        self.learner.apply_gradient(self.learner.grad, loss)
        self.recorder.steps += 1
        self.recorder.applied_samples += self.member.batch
        if not self.learner.finished:
            self.step()
