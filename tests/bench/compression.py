"""The compression table in the simulator (issue 17): bytes per trained sample against dense
fp32 gradient exchange, and the deliverable's final loss, for gossip configurations of one
seed-regime scenario.

    python -m tests.bench.compression [--scenario seed-1b-lora] [--seeds 1,2,3]
                                      [--duration 1200] [--config NAME:KEY=VALUE,...]...

Each configuration is the scenario's gossip method named "gossip, the default" with the
given [gossip] keys replaced (`--config tiered:averaging=subset_int8,subset_fraction=0.093,
subset_fraction_slow=0.0085`; the bare name `default` changes nothing), run the scenario's
whole `--duration` (no stop at the target) on each seed. Per run it prints: the
deliverable's held-out loss at the end (the leader's replica; the mean replica's beside it),
the time it first reached the scenario's target, bytes per trained sample (every envelope
every node sent, the control plane included) and dense fp32 over it (4 bytes x travelling
parameters x steps / samples: one fp32 gradient sent per step); then per configuration the
mean final loss over the seeds and how far it is from the first configuration's mean.
Nothing is written. (Since 2026-12-03 late night the default has a fast core averaging after
every step, `average_every_fast = 1`; BENCHMARKS §17's `default` rows were measured before
it: add `average_every_fast=0` to a configuration to run them as they were. The built-in
`tiered` has it, as the §17 row it stands for.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from sims.fleet import Training, charged_size
from sims.gossip import configure
from sims.run import fleet_summary, run_method
from sims.scenario import Method, Scenario, load

DEFAULT_METHOD = "gossip, the default"
DEFAULT_CONFIGS = ("default",
                   "tiered:averaging=subset_int8,subset_fraction=0.093,subset_fraction_slow=0.0085"
                   ",average_every_fast=0")


@dataclass(frozen=True, slots=True)
class Row:
    """One configuration on one seed."""

    config: str
    seed: int
    final: float  # the deliverable's held-out loss at the end
    mean_final: float  # the mean replica's
    reached: float | None  # simulated seconds to the target; None: not reached
    bytes_per_sample: float
    dense_ratio: float  # dense fp32 bytes per sample over bytes_per_sample
    steps: int  # steps every node took, together
    samples: int  # samples they trained on


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `NAME:KEY=VALUE,...` -> (name, the keys with JSON-parsed values, or the text
    itself where it is not JSON)."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"configuration {text!r} has no name")
    knobs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"configuration {name}: {item!r} is not KEY=VALUE")
        try:
            knobs[key] = json.loads(value)
        except json.JSONDecodeError:
            knobs[key] = value
    return name, knobs


def method_for(scenario: Scenario, name: str, knobs: dict[str, Any]) -> Method:
    """The scenario's default gossip method with `knobs`."""
    base = next((m for m in scenario.methods if m.name == DEFAULT_METHOD), None)
    if base is None:
        raise ValueError(f"scenario {scenario.name} has no method {DEFAULT_METHOD!r}")
    return Method(name, "gossip", {**base.params, **knobs})


def check_configs(scenario: Scenario, configs: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse, before anything runs, a configuration the scenario's proxy cannot stand for
    (unknown keys, a subset share it cannot cover)."""
    training = Training(scenario)
    charged = charged_size(scenario, training.size)
    for name, knobs in configs:
        params = {k: v for k, v in method_for(scenario, name, knobs).params.items() if k != "lr"}
        try:
            configure(params, charged, training.size.params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"configuration {name}: {e}") from e


def run_config(scenario: Scenario, name: str, knobs: dict[str, Any], seed: int) -> Row:
    """The scenario's default gossip method with `knobs`, run its whole duration on `seed`."""
    result = run_method(scenario.replace(stop_at_target=False),
                        method_for(scenario, name, knobs), seed)
    travelling = fleet_summary(scenario, seed)["charged_model"]["params"]
    return row_of(name, seed, result, travelling)


def row_of(name: str, seed: int, result: dict[str, Any], travelling: int) -> Row:
    """The table's figures from one method's result; `travelling`: the charged model's
    parameters that travel (the adapters in LoRA mode)."""
    samples, steps = result["samples"], result["steps"]
    if not samples or result["final_deliverable_loss"] is None:
        raise ValueError(f"configuration {name} (seed {seed}) trained nothing")
    per_sample = sum(result["bytes_by_kind"].values()) / samples
    dense = 4 * travelling * steps / samples
    return Row(name, seed, result["final_deliverable_loss"], result["final_loss"],
               result["time_to_target"], per_sample, dense / per_sample, steps, samples)


def summary(rows: list[Row]) -> list[str]:
    """Per configuration, in first-seen order: the mean final loss over its seeds, its range
    of bytes and ratios, and the gap to the first configuration's mean."""
    names = list(dict.fromkeys(r.config for r in rows))
    means = {n: statistics.fmean(r.final for r in rows if r.config == n) for n in names}
    best = means[names[0]]
    out = []
    for n in names:
        mine = [r for r in rows if r.config == n]
        out.append(f"{n}: final {means[n]:.4f} ({(means[n] / best - 1):+.1%} against "
                   f"{names[0]}), {min(r.bytes_per_sample for r in mine):,.0f}-"
                   f"{max(r.bytes_per_sample for r in mine):,.0f} B a sample, dense fp32 "
                   f"{min(r.dense_ratio for r in mine):.0f}-"
                   f"{max(r.dense_ratio for r in mine):.0f}x")
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="seed-1b-lora")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--duration", type=float, default=1200.0,
                        help="simulated seconds each run goes (no stop at the target)")
    parser.add_argument("--config", action="append", default=None,
                        help="NAME or NAME:KEY=VALUE,... (repeatable; the first is the yardstick;"
                             f" default: {' and '.join(DEFAULT_CONFIGS)})")
    args = parser.parse_args(argv)
    try:
        configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as e:
        parser.error(str(e))
    if not seeds or not args.duration > 0:
        parser.error("give at least one seed and a duration > 0")
    scenario = load(args.scenario).replace(duration=args.duration)
    try:
        check_configs(scenario, configs)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    for name, knobs in configs:
        for seed in seeds:
            t0 = time.perf_counter()
            row = run_config(scenario, name, knobs, seed)
            rows.append(row)
            reached = "not reached" if row.reached is None else f"{row.reached:g} s"
            print(f"{args.scenario} seed {seed} {name}: final {row.final:.4f} (mean replica "
                  f"{row.mean_final:.3f}), target "
                  f"{reached}, {row.bytes_per_sample:,.0f} B a sample, dense fp32 "
                  f"{row.dense_ratio:.1f}x ({time.perf_counter() - t0:.0f} s)", flush=True)
    for line in summary(rows):
        print(line)
    return rows


if __name__ == "__main__":
    main()
