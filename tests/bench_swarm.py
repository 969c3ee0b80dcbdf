"""Benchmark of real `p2ptrain join` processes: how soon nodes exchange their first gradient
(loopback with static seeds; network namespaces with mDNS alone), and how long the survivors
take to agree on a new leader after `kill -9` of the leader (timing presets "local" and
"lan", beside the protocol's bound 2*lease + rank*claim_backoff).

    cd /work/main && .venv/bin/python -m tests.bench_swarm [--json] [--reps N]

Prints a Markdown table (or, with --json, one JSON document) with the command line and the
date; progress goes to stderr. A benchmark, not a test: figures depend on the machine's load.
The namespace rows need root and `ip` (they say so and are left out otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from p2ptrain.proto.config import PRESETS
from tests.netlab import NetLab, _netns_unavailable
from tests.swarmlab import Proc, SwarmLab, free_ports, wait_for
from tests.test_swarm_netns import observe_from_root, start_on_host, status_of

POLL = 0.02  # s between looks at logs and status documents
TIMEOUT = 60.0  # s for any one phase of a repetition


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _first_exchanges(procs: list[Proc], started: list[float]) -> list[tuple[float, float]]:
    """For each node, (seconds from its Popen to its "first_exchange" line, the event's own
    elapsed_s since the runtime started), polling the logs every POLL seconds."""
    found: dict[int, tuple[float, float]] = {}
    deadline = time.monotonic() + TIMEOUT
    while len(found) < len(procs):
        for i, proc in enumerate(procs):
            if i in found:
                continue
            if not proc.alive():
                raise RuntimeError(f"node {i} exited: {proc.output()[-2000:]}")
            event = next((e for e in proc.events() if e.get("event") == "first_exchange"), None)
            if event is not None:
                found[i] = (time.monotonic() - started[i], float(event["elapsed_s"]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(found)} of {len(procs)} nodes exchanged in "
                               f"{TIMEOUT:g}s")
        time.sleep(POLL)
    return [found[i] for i in range(len(procs))]


def first_exchange_loopback(n: int, tmp: Path) -> dict:
    """n nodes on 127.0.0.1, each given every other as a static seed, mDNS off."""
    with SwarmLab(tmp) as lab:
        ports = free_ports(n)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        procs, started = [], []
        for i in range(n):
            started.append(time.monotonic())
            procs.append(lab.start(f"n{i}", ports[i], [a for a in addrs if a != addrs[i]]))
        times = _first_exchanges(procs, started)
    return {"seconds": max(t for t, _ in times), "runtime_s": max(e for _, e in times)}


def first_exchange_netns(n: int, tmp: Path) -> dict:
    """n nodes, one per namespace, bound to 0.0.0.0 with mDNS on and no seed at all."""
    with NetLab(n, prefix="bnch") as net, SwarmLab(tmp) as lab:
        observe_from_root(net)
        procs, started = [], []
        for i in range(n):
            started.append(time.monotonic())
            procs.append(start_on_host(lab, net, i, f"n{i}", P2PTRAIN_NET_MDNS="true"))
        times = _first_exchanges(procs, started)
    return {"seconds": max(t for t, _ in times), "runtime_s": max(e for _, e in times)}


def failover(timing: str, tmp: Path, n: int = 4) -> dict:
    """Seconds from `kill -9` of the leader until every survivor names one new leader (and
    until the first survivor does), n training nodes on loopback with static seeds."""
    with SwarmLab(tmp) as lab:
        ports = free_ports(n)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        env = lab.env(P2PTRAIN_NET_TIMING=timing)
        procs = [lab.start(f"n{i}", ports[i], [a for a in addrs if a != addrs[i]], env=env)
                 for i in range(n)]

        def steady() -> list[dict] | None:
            docs = [status_of(p) for p in procs]
            leaders = {d["leader"] for d in docs}
            ok = (len(leaders) == 1 and None not in leaders
                  and sum(d["is_leader"] for d in docs) == 1
                  and all(len([m for m in d["members"] if m["state"] == "alive"]) == n - 1
                          and d["step"] > 0 for d in docs))
            return docs if ok else None

        docs = wait_for("a steady swarm with one leader", steady, TIMEOUT)
        old = next(i for i, d in enumerate(docs) if d["is_leader"])
        old_id = docs[old]["leader"]
        survivors = [p for i, p in enumerate(procs) if i != old]
        killed_at = time.monotonic()
        lab.kill(procs[old])
        first: float | None = None
        while True:
            now = time.monotonic()
            if now - killed_at > TIMEOUT:
                raise RuntimeError(f"no new leader {TIMEOUT:g}s after the kill")
            leaders = set()
            for p in survivors:
                try:
                    leaders.add(p.status()["leader"])
                except OSError:
                    leaders.add(None)
            new = leaders - {None, old_id}
            if new and first is None:
                first = now - killed_at
            if len(leaders) == 1 and new:
                break
            time.sleep(POLL)
        return {"seconds": now - killed_at, "first_s": first}


def _repeat(what: str, reps: int, run: Callable[[Path], dict]) -> dict:
    """Run one measurement `reps` times, each in a fresh temporary directory."""
    runs = []
    for r in range(reps):
        with tempfile.TemporaryDirectory(prefix="p2pbench-") as tmp:
            result = run(Path(tmp))
        _say(f"{what}, run {r + 1}/{reps}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in result.items() if v is not None))
        runs.append(result)
    keys = runs[0].keys()
    return {"runs": runs, "median": {k: statistics.median(r[k] for r in runs
                                                         if r[k] is not None)
                                     for k in keys if any(r[k] is not None for r in runs)}}


def measure(reps: int) -> list[dict]:
    rows: list[dict] = []
    for n in (2, 4):
        row = {"measure": "Popen → first gradient exchange, every node", "nodes": n,
               "setup": "loopback, static seeds, mDNS off, net.timing = 'local'"}
        row.update(_repeat(f"first exchange, {n} nodes, loopback", reps,
                           lambda tmp, n=n: first_exchange_loopback(n, tmp)))
        rows.append(row)
    unavailable = _netns_unavailable()
    for n in (2, 4):
        row = {"measure": "Popen → first gradient exchange, every node", "nodes": n,
               "setup": "network namespaces, mDNS only (no seeds), net.timing = 'local'"}
        if unavailable:
            row["skipped"] = unavailable
        else:
            row.update(_repeat(f"first exchange, {n} nodes, namespaces + mDNS", reps,
                               lambda tmp, n=n: first_exchange_netns(n, tmp)))
        rows.append(row)
    for timing in ("local", "lan"):
        cfg = PRESETS[timing]
        row = {"measure": "kill -9 of the leader → all survivors agree on a new leader",
               "nodes": 4, "setup": f"loopback, net.timing = {timing!r} (lease "
               f"{cfg.lease:g}s, claim_backoff {cfg.claim_backoff:g}s)",
               "bound_s": [cfg.failover_bound(0), cfg.failover_bound(2)]}
        row.update(_repeat(f"fail-over, timing {timing}", reps,
                           lambda tmp, t=timing: failover(t, tmp)))
        rows.append(row)
    return rows


def markdown(doc: dict) -> str:
    lines = [f"`{doc['command']}` — {doc['date']}, {doc['cpus']} CPUs, median of "
             f"{doc['reps']} runs", "",
             "| measure | nodes | setup | median | runs | note |",
             "|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['measure']} | {row['nodes']} | {row['setup']} | – | – | "
                         f"skipped: {row['skipped']} |")
            continue
        med = row["median"]
        runs = ", ".join(f"{r['seconds']:.2f}" for r in row["runs"])
        if "bound_s" in row:
            low, high = row["bound_s"]
            note = (f"first survivor: {med['first_s']:.2f} s; bound 2·lease + "
                    f"rank·backoff = {low:.2f}–{high:.2f} s (rank 0–2)")
        else:
            note = f"of which in the runtime (elapsed_s): {med['runtime_s']:.2f} s"
        lines.append(f"| {row['measure']} | {row['nodes']} | {row['setup']} | "
                     f"{med['seconds']:.2f} s | {runs} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench_swarm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measure")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    command = "python -m tests.bench_swarm " + " ".join(argv if argv is not None
                                                        else sys.argv[1:])
    doc = {"command": command.strip(),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "cpus": os.cpu_count(), "reps": args.reps, "rows": measure(args.reps)}
    print(json.dumps(doc, indent=2) if args.json else markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
