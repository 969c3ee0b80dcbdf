"""Running a scenario: every method (or, in traffic-only mode, every point of the sweep, or
every fetch method of a join storm) in its own world with the same seed, then results.json,
the Markdown table and the plots.

Methods are independent, so they may run in parallel processes (`jobs`); results are put
back in the scenario's order, so the output does not depend on `jobs`. results.json holds
no wall-clock figure (those go to stdout and run.log), so the same seed gives the same
bytes. Pure apart from writing the output directory.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from sims import report, storm, traffic
from sims.allreduce import RingSim, SoloSim
from sims.coordinator import CoordinatorSim
from sims.fleet import Training, World
from sims.gossip import GossipSim
from sims.metrics import sig
from sims.scenario import Method, Scenario

SIMULATORS = {"gossip": GossipSim, "coordinator": CoordinatorSim, "allreduce": RingSim,
              "solo": SoloSim}


def run_method(scenario: Scenario, method: Method, seed: int) -> dict[str, Any]:
    """One method of a training scenario, in a fresh world. A method's `lr` replaces the
    scenario's `[train] lr` for it alone (each method at its own best learning rate)."""
    sim, lr = build(scenario, method, seed)
    result = sim.run()
    if lr is not None:
        result["params"] = {**result["params"], "lr": float(lr)}  # results.json says it
    return result


def build(scenario: Scenario, method: Method, seed: int) -> tuple[Any, float | None]:
    """The simulator of one method of a training scenario, ready to run, and the method's
    own `lr` (None: the scenario's)."""
    lr = None
    if "lr" in method.params:
        params = dict(method.params)
        lr = params.pop("lr")
        if not isinstance(lr, int | float) or not 0 < lr < 1:
            raise ValueError(f"method {method.name}: lr must be a number in (0, 1), not {lr!r}")
        scenario = scenario.replace(train={**scenario.train, "lr": float(lr)})
        method = Method(method.name, method.kind, params)
    training = Training(scenario)
    world = World(scenario, seed, training)
    sim = SIMULATORS[method.kind](world, method)
    if scenario.stop_at_target:
        sim.recorder.stop = world.engine.stop
    return sim, lr


def fleet_summary(scenario: Scenario, seed: int) -> dict[str, Any]:
    """The machines as the methods see them (batches and step times of the charged model)."""
    training = Training(scenario) if scenario.mode == "train" else None
    world = World(scenario, seed, training)
    groups: dict[tuple, dict[str, Any]] = {}
    for m in world.members:
        key = (m.device.name, m.site, m.medium)
        row = groups.setdefault(key, {
            "device": m.device.name, "site": m.site, "medium": m.medium, "count": 0,
            "batch": m.batch, "accum": m.accum, "outbound_only": m.outbound_only,
            "step_seconds": sig(world.compute_seconds(m)),
            "matmul_gflops": m.device.matmul_gflops,
            "nic_mbps": sig(m.device.nic_bytes_per_second(m.medium) * 8 / 1e6)})
        row["count"] += 1
    charged = world.charged
    out = {"machines": len(world.members), "groups": list(groups.values()),
           "charged_model": {"name": charged.name, "params": charged.params,
                             "flops_per_sample": sig(charged.flops_per_sample)},
           "sites": [{"name": s.name, "uplink": s.uplink.kind, "up_mbps": s.uplink.up_mbps,
                      "down_mbps": s.uplink.down_mbps, "cgnat": s.uplink.cgnat}
                     for s in scenario.sites]}
    if charged.lora:
        out["charged_model"]["base_params"] = charged.base_params
    if training is not None:
        out["proxy_model"] = {"name": training.size.name, "arch": training.model.arch(),
                              "params": training.size.params}
    return out


def _pool_map(fn, tasks: list[tuple], jobs: int) -> list:
    if jobs <= 1 or len(tasks) <= 1:
        return [fn(*t) for t in tasks]
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
        futures = [pool.submit(fn, *t) for t in tasks]
        return [f.result() for f in futures]


def run_scenario(scenario: Scenario, seed: int | None = None,
                 jobs: int | None = None) -> dict[str, Any]:
    """All methods (or the sweep) of `scenario`; the plain data of results.json."""
    seed = scenario.seed if seed is None else seed
    jobs = scenario.jobs if jobs is None else jobs
    head = {"scenario": scenario.name, "description": scenario.description, "seed": seed,
            "mode": scenario.mode, "target_loss": scenario.target_loss,
            "duration": scenario.duration}
    if scenario.checkpoint is not None:
        tasks = [(scenario, method, seed) for method in scenario.methods]
        return {**head, "storm": storm.summary(scenario, seed),
                "methods": _pool_map(storm.run_method, tasks, jobs)}
    if scenario.mode == "traffic":
        tasks = [(scenario, point, seed) for point in traffic.sweep_points(scenario)]
        rows = _pool_map(traffic.run_point, tasks, jobs)
        return {**head, "points": rows}
    head["fleet"] = fleet_summary(scenario, seed)
    tasks = [(scenario, method, seed) for method in scenario.methods]
    return {**head, "methods": _pool_map(run_method, tasks, jobs)}


def dumps(results: dict[str, Any]) -> str:
    """The canonical text of results.json."""
    return json.dumps(results, indent=1, sort_keys=True, allow_nan=False) + "\n"


def write_outputs(results: dict[str, Any], out: Path, plots: bool = True) -> list[str]:
    """Write results.json, table.md and (if matplotlib is there) the plots; returns notes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(dumps(results))
    (out / "table.md").write_text(report.markdown(results))
    notes: list[str] = []
    if plots:
        notes += report.plots(results, out)
    return notes
