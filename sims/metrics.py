"""What a run records and how it becomes one row of results: held-out loss over simulated
time, time to the target loss, samples and steps, bytes per node and per message kind, link
utilisation, consensus distance.

A method calls `Recorder.point(t, losses, distance, deliverable)` at every evaluation (one
loss per live replica: the mean is the curve, the worst is kept too; `deliverable` is the
loss of the model a user takes away -- what the swarm's checkpoints carry: gossip's leader's
replica, or with `train.ema` the average of its weights; a method with one model passes
none, its mean is that model) and counts steps and bytes as it goes;
`Recorder.result(world, until)` turns it into a plain dict for results.json. Time to target
is the first evaluation at which the deliverable's loss is at or below the target,
`mean_time_to_target` the same for the mean over replicas (their resolution is the
scenario's `eval_every`); with `stop` set (the scenario's `stop_at_target`), the
deliverable's reaching it ends the run. Numbers are rounded to 6 significant digits so
results.json stays readable; the same run gives the same bytes. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sims.fleet import World


def sig(x: float | None, digits: int = 6) -> float | None:
    """x rounded to `digits` significant digits (None and non-finite values pass as None)."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return float(f"{x:.{digits}g}")


class Recorder:
    """Measurements of one method's run."""

    def __init__(self, name: str, kind: str, params: dict, target: float | None):
        self.name, self.kind, self.params = name, kind, dict(params)
        self.target = target
        # [t, mean loss, worst loss, distance, samples, deliverable's loss]
        self.curve: list[list[float | None]] = []
        self.reached_at: float | None = None  # the deliverable at the target
        self.mean_reached_at: float | None = None  # the mean over replicas at the target
        self.steps = 0  # optimiser steps taken (all nodes)
        self.samples = 0  # samples whose gradient was computed (all nodes)
        self.applied_samples = 0  # samples that reached the model (coordinator: accepted)
        self.kind_bytes: Counter[str] = Counter()  # charged bytes sent, by message kind
        self.kind_count: Counter[str] = Counter()
        self.extra: dict[str, Any] = {}  # method-specific figures
        self.ended_at: float | None = None  # when training finished (or the run's end)
        self.stop: Callable[[], None] | None = None  # called when the target is first reached

    def sent(self, kind: str, size: int) -> None:
        self.kind_bytes[kind] += size
        self.kind_count[kind] += 1

    def point(self, t: float, losses: list[float], distance: float | None = None,
              deliverable: float | None = None) -> None:
        if not losses:
            self.curve.append([sig(t), None, None, sig(distance), self.samples, None])
            return
        mean = sum(losses) / len(losses)
        taken = mean if deliverable is None else deliverable
        self.curve.append([sig(t), sig(mean), sig(max(losses)), sig(distance), self.samples,
                           sig(taken)])
        if self.target is None:
            return
        if self.mean_reached_at is None and mean <= self.target:
            self.mean_reached_at = t
        if self.reached_at is None and taken <= self.target:
            self.reached_at = t
            if self.stop is not None:
                self.ended_at = t
                self.stop()

    def final(self) -> tuple[float | None, float | None, float | None]:
        """(mean loss, worst loss, distance, deliverable's loss) of the last evaluation that
        had replicas."""
        for _t, mean, worst, dist, _, taken in reversed(self.curve):
            if mean is not None:
                return mean, worst, dist, taken
        return None, None, None, None

    def result(self, world: World | None, until: float) -> dict[str, Any]:
        mean, worst, dist, taken = self.final()
        out: dict[str, Any] = {
            "name": self.name, "kind": self.kind, "params": self.params,
            "time_to_target": sig(self.reached_at),
            "mean_time_to_target": sig(self.mean_reached_at), "final_loss": mean,
            "final_worst_loss": worst, "final_deliverable_loss": taken,
            "consensus_distance": dist,
            "simulated_seconds": sig(until),
            "ended_at": sig(self.ended_at if self.ended_at is not None else until),
            "steps": self.steps, "samples": self.samples,
            "applied_samples": self.applied_samples,
            "samples_per_second": sig(self.samples / until) if until > 0 else None,
            "bytes_by_kind": dict(sorted(self.kind_bytes.items())),
            "messages_by_kind": dict(sorted(self.kind_count.items())),
        }
        if world is not None:
            net = world.network
            sent = [net.traffic.sent[m.index] for m in world.members]
            out["bytes_per_node_median"] = sig(statistics.median(sent)) if sent else None
            out["bytes_per_node_max"] = max(sent) if sent else None
            out["bytes_per_node_step"] = (sig(sum(sent) / self.steps) if self.steps else None)
            name, util = net.busiest(until)
            out["busiest_link"] = name
            out["busiest_utilisation"] = sig(util)
            out["links"] = {r.name: sig(r.utilisation(until))
                            for r in net.resources() if r.bytes and r.kind != "nic"}
            out["dropped_messages"] = net.traffic.dropped
            out["refused_messages"] = net.traffic.refused
            out["events"] = world.engine.events_run
        out.update(self.extra)
        out["curve"] = self.curve
        return out
