"""Reports of a scenario's results: the Markdown table and the PNG plots.

Training scenarios get one row per method: simulated time to the target held-out loss, final
loss (mean over live replicas, worst in brackets), samples per simulated second, bytes sent
per machine (median / max) and per step, the busiest link and its utilisation, and the
consensus distance (RMS distance of the replicas to their mean). Traffic-only sweeps get one
row per (parameters, machines, method); a point charged for a named model says which, and a
LoRA point gives its adapters (what travels) and its frozen base. Join storms get, per fetch
strategy, the time until each device class, each site and the whole fleet hold their
checkpoint, beside the lower bounds derived from the link parameters, and the bytes by
route. Plots need matplotlib (the `plot` extra); without it they are skipped with a note.
This file reads results and writes files, nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _num(x: Any, fmt: str = "{:.3g}") -> str:
    return "–" if x is None else fmt.format(x)


def _bytes(x: Any) -> str:
    if x is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _time(x: Any) -> str:
    return "not reached" if x is None else f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def markdown(results: dict[str, Any]) -> str:
    if "storm" in results:
        return storm_table(results)
    if results.get("mode") == "traffic":
        return traffic_table(results)
    target = results.get("target_loss")
    lines = [f"Scenario `{results['scenario']}`, seed {results['seed']}: target held-out "
             f"loss {target} nats/char, at most {results['duration']:g} simulated s.", "",
             "| method | time to target (mean replica's) | final loss: deliverable; mean "
             "(worst) | samples/s | bytes/node median / max | bytes/node/step | busiest link "
             "(utilisation) | consensus distance |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in results["methods"]:
        final = (f"{r['final_loss']:.3f} ({r['final_worst_loss']:.3f})"
                 if r.get("final_loss") is not None else "–")
        taken = r.get("final_deliverable_loss")
        if taken is not None and r.get("final_loss") is not None:
            final = f"{taken:.3f}; {final}"
        reach = _time(r.get("time_to_target"))
        if (mean := r.get("mean_time_to_target")) != r.get("time_to_target"):
            reach += f" (mean: {_time(mean) if mean is not None else 'not by then'})"
        lines.append(
            f"| {r['name']} | {reach} | {final} | "
            f"{_num(r.get('samples_per_second'), '{:.0f}')} | "
            f"{_bytes(r.get('bytes_per_node_median'))} / {_bytes(r.get('bytes_per_node_max'))} | "
            f"{_bytes(r.get('bytes_per_node_step'))} | {r.get('busiest_link', '–')} "
            f"({_num(r.get('busiest_utilisation'), '{:.0%}')}) | "
            f"{_num(r.get('consensus_distance'), '{:.2g}')} |")
    return "\n".join(lines) + "\n"


def _params(x: float) -> str:
    """A parameter count with a unit: 1.03G, 12.8M."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def sized(r: dict[str, Any]) -> str:
    """The params cell of a traffic row: the count, and for a named model its name and, in
    LoRA mode, adapters vs base."""
    charge = r.get("charge")
    if charge is None:
        return f"{r['model_params']:.3g}"
    if charge["mode"] == "lora":
        return (f"{_params(charge['params'])} adapters (LoRA; base "
                f"{_params(charge['base_params'])} at 16 bits, not sent): {charge['name']}")
    return f"{_params(charge['params'])} (full): {charge['name']}"


def traffic_table(results: dict[str, Any]) -> str:
    lines = [f"Scenario `{results['scenario']}` (traffic only), seed {results['seed']}, "
             f"{results['duration']:g} simulated s per point.", "",
             "| params | machines | method | step s | samples/s | bytes/node median / max | "
             "busiest link (utilisation) | coordinator link | delivered |",
             "|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in results["points"]:
        delivered = r.get("pushes_delivered_fraction")
        coord = r.get("coordinator_link_utilisation")
        lines.append(
            f"| {sized(r)} | {r['nodes']} | {r['name']} | "
            f"{_num(r.get('step_seconds'))} | {_num(r.get('throughput'), '{:.3g}')} | "
            f"{_bytes(r.get('bytes_per_node_median'))} / {_bytes(r.get('bytes_per_node_max'))} | "
            f"{r.get('busiest_link')} ({_num(r.get('busiest_utilisation'), '{:.0%}')}) | "
            f"{_num(coord, '{:.0%}')} | {_num(delivered, '{:.0%}')} |")
    return "\n".join(lines) + "\n"


def _held(row: dict[str, Any]) -> str:
    """A simulated time with its lower bound in brackets."""
    return f"{_time(row['all_hold'])} ({_time(row['bound']['seconds'])})"


def _row(*cells: str) -> str:
    return f"| {' | '.join(cells)} |"


def storm_table(results: dict[str, Any]) -> str:
    storm, rows = results["storm"], results["methods"]
    leader, names = storm["leader"], [r["name"] for r in rows]
    classes = list(dict.fromkeys(g["device"] for g in storm["groups"]))
    sites = [s["name"] for s in storm["sites"]]
    fetch = {d: g["file"] for g in storm["groups"] for d in [g["device"]]}
    files = "; ".join(f"{', '.join(d for d in classes if fetch[d] == name)} fetch `{name}` "
                      f"({_bytes(f['bytes'])})" for name, f in storm["files"].items())
    lines = [f"Scenario `{results['scenario']}`, seed {results['seed']}: {storm['machines']} "
             f"machines join at once; {files}; chunks of {storm['chunk_bytes'] / 2**20:g} MiB. "
             f"Leader (as the election picks it): n{leader['index']}, a {leader['device']} "
             f"({leader['site']}, {leader['medium']}).", "",
             "Simulated time until every machine of a class / site / the fleet holds its file; "
             "in brackets the lower bound derived from the link parameters (stormbound.py).", "",
             _row("strategy", *classes, *sites, "all hold", "bound: binding resource",
                  "all / bound", "busiest link (utilisation)"),
             "|---|" + "---:|" * (len(classes) + len(sites) + 1) + "---|---:|---|"]
    for r in rows:
        lines.append(_row(
            r["name"], *(_held(r["by_class"][c]) for c in classes),
            *(_held(r["by_site"][s]) for s in sites), _time(r["all_hold"]),
            f"{_time(r['bound']['seconds'])}: {r['bound']['resource']}",
            _num(r["ratio_to_bound"], "{:.2f}"),
            f"{r['busiest_link']} ({_num(r['busiest_utilisation'], '{:.0%}')})"))
    bounds = [{b["resource"]: b["seconds"] for b in r["bounds"]} for r in rows]
    resources = sorted({res for found in bounds for res in found},
                       key=lambda res: -max(found.get(res, 0) for found in bounds))
    lines += ["", "Lower bounds, s (each resource's least work for the bytes it must carry):",
              "", _row("resource", *names), "|---|" + "---:|" * len(rows)]
    for res in resources:
        lines.append(_row(res, *(_time(found[res]) if res in found else "–"
                                 for found in bounds)))
    lines += ["", "Bytes delivered by route (first copies), the tail's second copies, messages "
              "lost (Starlink):", "", _row("route", *names), "|---|" + "---:|" * len(rows)]
    for route in sorted({k for r in rows for k in r["bytes_by_route"]}):
        lines.append(_row(route, *(_bytes(r["bytes_by_route"].get(route, 0)) for r in rows)))
    lines.append(_row("second copies (wasted)", *(_bytes(r["wasted_bytes"]) for r in rows)))
    lines.append(_row("messages lost", *(str(r["lost_messages"]) for r in rows)))
    return "\n".join(lines) + "\n"


def _storm_plot(results: dict[str, Any], out: Path, plt) -> str:
    fig, ax = plt.subplots(figsize=(9.6, 4.4))
    n = results["storm"]["machines"] - 1
    for r in results["methods"]:
        times = r["finish_times"]
        ax.step([0.0] + times, [0] + list(range(1, len(times) + 1)), where="post",
                label=f"{r['name']} (bound {r['bound']['seconds']:.0f} s)")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel(f"machines holding their checkpoint (of {n})")
    ax.set_title(f"{results['scenario']}: joiners holding their checkpoint")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / f"{results['scenario']}-held.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.name


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """Write the PNGs into `out`; returns notes (e.g. matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (from a clone: "
                ".venv/bin/pip install -e '.[plot]')"]
    name = results["scenario"]
    written = []
    if "storm" in results:
        return [f"plots: {_storm_plot(results, out, plt)}"]
    if results.get("mode") == "traffic":
        points = results["points"]
        for key, label, fname, log in (
                ("throughput", "samples per simulated second", "throughput", True),
                ("bytes_per_node_median", "bytes sent per machine (median)", "bytes", True),
                ("busiest_utilisation", "busiest link utilisation", "utilisation", False)):
            fig, ax = plt.subplots(figsize=(9.6, 4.4))
            series: dict[tuple, list] = {}
            for r in points:
                series.setdefault((r["name"], sized(r)), []).append(r)
            for (method, params), rows in series.items():
                rows = sorted(rows, key=lambda r: r["nodes"])
                ax.plot([r["nodes"] for r in rows], [r.get(key) or 0 for r in rows],
                        marker="o", label=f"{method}, {params}"
                        + ("" if rows[0].get("charge") else " params"))
            ax.set_xscale("log")
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("machines N")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label} vs N")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.tight_layout()
            path = out / f"{name}-{fname}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(path.name)
        return [f"plots: {', '.join(written)}"]
    fig, ax = plt.subplots(figsize=(9.6, 4.4))
    for r in results["methods"]:
        pts = [(p[0], p[5] if len(p) > 5 and p[5] is not None else p[1]) for p in r["curve"]
               if p[1] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r["name"])
    if results.get("target_loss") is not None:
        target = results["target_loss"]
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        lows = [loss for r in results["methods"] for _, loss, *_ in r["curve"] if loss]
        ax.set_ylim(min(lows + [target]) - 0.1, target + 1.0)  # the race near the target
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("held-out loss, nats/char, of what checkpoints carry\n(gossip: the "
                  "leader's; with train.ema the average of the weights)")
    ax.set_title(f"{name}: loss vs simulated time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / f"{name}-loss.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [f"plots: {path.name}"]


def _samples_at(r: dict[str, Any], t: float | None) -> int | None:
    """Samples the method had computed at simulated time t (the curve's point at t)."""
    if t is None:
        return None
    for point in r["curve"]:
        if point[0] is not None and point[0] >= t:
            return point[4]
    return None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def seeds_table(runs: list[dict[str, Any]]) -> str:
    """One row per (scenario, method) over several seeds' results: time to target per seed,
    the median (over the seeds that reached it; "not reached" unless most did), the swarm
    samples computed by then, and the median time of the scenario's `solo` method (the best
    single machine) and of its first coordinator over the method's (> 1: the method is
    faster). A seed that did not reach the target counts as its run's length. Times are the
    deliverable's (gossip: the leader's replica); the mean replica's follow where they differ."""
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for res in sorted(runs, key=lambda res: res["seed"]):
        by_scenario.setdefault(res["scenario"], []).append(res)
    lines = ["| scenario | charged model | method | time to target, seeds | median | swarm "
             "samples to target (median) | best single machine / method | coordinator / "
             "method |", "|---|---|---|---|---:|---:|---:|---:|"]
    for name, results in by_scenario.items():
        seeds = [res["seed"] for res in results]
        rows: dict[str, list[dict[str, Any]]] = {}
        for res in results:
            for r in res["methods"]:
                rows.setdefault(r["name"], []).append(r)

        def median_time(rs: list[dict[str, Any]]) -> float | None:
            times = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
            if 2 * len(times) <= len(rs):
                return None
            return _median([t if t is not None else r["simulated_seconds"]
                            for r in rs for t in [r["time_to_target"]]])

        medians = {method: median_time(rs) for method, rs in rows.items()}
        kinds = {method: rs[0]["kind"] for method, rs in rows.items()}
        solo = next((medians[m] for m in rows if kinds[m] == "solo"), None)
        coord = next((medians[m] for m in rows if kinds[m] == "coordinator"), None)
        model = results[0].get("fleet", {}).get("charged_model", {}).get("name", "–")
        for method, rs in rows.items():
            med = medians[method]
            samples = [s for r in rs for s in [_samples_at(r, r["time_to_target"])]
                       if s is not None]
            per_seed = " / ".join(_time(r["time_to_target"]) for r in rs)
            if any(r.get("mean_time_to_target", r["time_to_target"]) != r["time_to_target"]
                   for r in rs):  # gossip: the leader's replica, then the mean replica's
                per_seed += " (mean replica: " + " / ".join(  # a run ends at the target
                    _time(t) if (t := r.get("mean_time_to_target")) is not None
                    else "not by then" for r in rs) + ")"
            lines.append(_row(
                name, model, method, f"{per_seed} (seeds {', '.join(map(str, seeds))})",
                _time(med), f"{_median(samples):,.0f}" if samples and med is not None else "–",
                f"{solo / med:.2f}" if solo and med else "–",
                f"{coord / med:.2f}" if coord and med else "–"))
    return "\n".join(lines) + "\n"
