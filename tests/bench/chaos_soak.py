"""The chaos soak of issue 13: real nodes on loopback under seeded faults and a hostile member.

    python -m tests.bench.chaos_soak --seed N --seconds 120 --out DIR [--no-baseline]

What it runs (every random choice comes from `--seed`):
1. a no-fault baseline: 4 honest `p2ptrain join` processes for `--seconds`, then stopped with
   SIGTERM (each writes its final checkpoint);
2. the chaos run, as long: 4 honest nodes plus the hostile member (tests/bench/hostile.py: it
   holds the swarm key and sends the messages of issue 13 items 8-10 and 13 at random,
   including claiming leadership at term 2^52 and serving a wrecked checkpoint signed by
   itself), while a seeded fault plan hits the honest nodes: kill -9 then restart on the same
   state directory and port after 1-5 s, SIGSTOP for 1-10 s then SIGCONT -- never more than
   two honest nodes down at once (at least two stay up). Faults start a few seconds after
   the clock starts and end a few seconds before it stops. Then the hostile member is
   stopped, the faults end, and the swarm settles: the soak waits (deadline `--settle`) for
   every honest node to answer and one honest leader that every honest node follows.

Throughout, twice a second, it samples every node's /v1/status and the checkpoint manifests in
every state directory (checkpoints/*/manifest.json, in the order they were written, by the
manifest's mtime), and at the end it checks the invariants:

    alive          every honest node's process runs, answers /v1/status and still steps
    one_leader     exactly one leader, an honest node, which every honest node follows
    ckpt_monotonic the (term, swarm_samples) of the checkpoints each node writes never go
                   backwards (term and swarm_samples each non-decreasing, restarts included)
    finite         every honest node's final weights are finite
    heldout        (with a baseline) every honest node's held-out loss is within 10% of the
                   baseline's mean (at most 1.10 x)

Held-out loss: each node's final checkpoint (the newest written, by mtime) is loaded into the
project's Learner and scored on the fixed held-out windows (the last 10% of Tiny Shakespeare,
`eval.windows` = 512 windows of ctx_len + 1 bytes). It prints a table, writes DIR/result.json
and exits 0 only if every invariant holds.

Model and configuration: the small mlp of tests/swarmlab.py (n_hidden 32, n_embd 8,
ctx_len 16; batch 8; topk 0.1 gradient gossip to 2 peers and the default subset-fp16
averaging every 5 steps; `net.timing = "local"`: 0.25 s heartbeats, 1 s lease; a checkpoint
every 2 s), with `eval.windows = 512` and a held-out evaluation every 5 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from p2ptrain import checkpoint
from p2ptrain.config import resolve, settings_of
from p2ptrain.data import load_corpus
from p2ptrain.learner import Learner
from p2ptrain.startup import model_for
from tests.helpers import REPO
from tests.swarmlab import SMALL_SWARM_TOML, Proc, SwarmLab, free_ports, get_json

# swarmlab's small swarm, with a held-out set big enough to compare runs
SOAK_TOML = (SMALL_SWARM_TOML.replace("windows = 16", "windows = 512")
             .replace("every_seconds = 1\n", "every_seconds = 5\n"))
assert SOAK_TOML != SMALL_SWARM_TOML

N_HONEST = 4
MIN_UP = 2  # honest nodes that are never down at once
HELDOUT_TOLERANCE = 0.10


# -- the fault plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the clock started
    kind: str  # "kill" (kill -9, restart after `length`) or "stop" (SIGSTOP for `length`)
    node: int
    length: float


def fault_plan(rng: random.Random, seconds: float, n: int, gap: tuple[float, float],
               margin: float = 4.0) -> list[Fault]:
    """A seeded list of faults in [margin, seconds - margin]; at most n - MIN_UP nodes down at
    any time (a killed node counts as down until 3 s after its restart)."""
    faults: list[Fault] = []
    down: list[tuple[float, float, int]] = []  # (from, until, node)
    t = margin
    while True:
        t += rng.uniform(*gap)
        if t > seconds - margin:
            return faults
        kind = rng.choice(("kill", "stop"))
        length = rng.uniform(1.0, 5.0) if kind == "kill" else rng.uniform(1.0, 10.0)
        busy_until = t + length + (3.0 if kind == "kill" else 0.0)
        busy_until = min(busy_until, seconds - 1.0)
        length = min(length, busy_until - t)
        candidates = [i for i in range(n)
                      if not any(a <= t < b and j == i for a, b, j in down)]
        overlapping = {j for a, b, j in down if a < busy_until and t < b}
        if len(overlapping) >= n - MIN_UP or not candidates:
            continue
        node = rng.choice(candidates)
        if node in overlapping:
            continue
        faults.append(Fault(round(t, 2), kind, node, round(length, 2)))
        down.append((t, busy_until, node))


# -- watching nodes -------------------------------------------------------------------------------


@dataclass
class NodeWatch:
    """One honest node across its lives: what it said and the checkpoints it wrote."""

    name: str
    state_dir: Path
    ids: set[str] = field(default_factory=set)
    written: dict[tuple[str, int], dict] = field(default_factory=dict)  # (dir, mtime) -> info
    last_status: dict | None = None
    statuses: int = 0
    status_errors: int = 0

    def scan(self, now: float) -> None:
        root = self.state_dir / "checkpoints"
        if not root.is_dir():
            return
        for path in root.iterdir():
            if not checkpoint.store.NAME_RE.fullmatch(path.name):
                continue
            try:
                mtime = (path / checkpoint.store.MANIFEST_FILE).stat().st_mtime_ns
                if (path.name, mtime) in self.written:
                    continue
                manifest = json.loads((path / checkpoint.store.MANIFEST_FILE).read_bytes())
            except (OSError, ValueError):
                continue  # pruned or replaced meanwhile
            self.written[(path.name, mtime)] = {
                "name": path.name, "mtime_ns": mtime, "seen_at": round(now, 2),
                "term": manifest.get("term"), "step": manifest.get("step"),
                "swarm_samples": manifest.get("swarm_samples"),
                "leader": manifest.get("leader")}

    def history(self) -> list[dict]:
        """Checkpoints in the order they were written."""
        return sorted(self.written.values(), key=lambda c: c["mtime_ns"])

    def regressions(self) -> list[dict]:
        out = []
        hist = self.history()
        for before, after in zip(hist, hist[1:], strict=False):
            for key in ("term", "swarm_samples"):
                if after[key] < before[key]:
                    out.append({"node": self.name, "what": key, "from": before, "to": after})
        return out


def status_of(proc: Proc, timeout: float = 2.0) -> dict | None:
    try:
        return get_json(proc.addr, timeout=timeout)
    except (OSError, ValueError):
        return None


# -- one run --------------------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    seconds: float
    faults: list[dict]
    attacks: list[dict]
    settled_after: float | None
    final: list[dict]  # per honest node
    leader: str | None
    leaders_seen: list[str | None]
    regressions: list[dict]
    checkpoints: dict[str, list[dict]]
    exit_codes: list[int | None]
    invariants: dict[str, bool] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    heldout_mean: float | None = None


class Soak:
    """One run (baseline or chaos) in its own directory; `close()` ends every process."""

    def __init__(self, out: Path, name: str, seed: int, seconds: float, *, chaos: bool,
                 fault_gap: tuple[float, float] = (3.0, 7.0),
                 attack_gap: tuple[float, float] = (2.0, 5.0), settle: float = 90.0,
                 log=print):
        self.out, self.name, self.seed, self.seconds = out / name, name, seed, seconds
        self.chaos, self.settle, self.log = chaos, settle, log
        self.attack_gap = attack_gap
        self.rng = random.Random(f"{seed}/{name}")
        self.plan = fault_plan(self.rng, seconds, N_HONEST, fault_gap) if chaos else []
        self.lab = SwarmLab(self.out, SOAK_TOML, name=f"soak{seed}")
        self.ports = free_ports(N_HONEST + 1)
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports[:N_HONEST]]
        self.nodes: list[Proc] = []
        self.watch = [NodeWatch(f"n{i}", self.out / f"n{i}") for i in range(N_HONEST)]
        self.hostile: Proc | None = None
        self.down: dict[int, str] = {}  # node -> "killed" | "stopped"
        self.events: list[dict] = []

    # processes

    def start_node(self, i: int) -> Proc:
        peers = [a for j, a in enumerate(self.addrs) if j != i]
        proc = self.lab.start(f"n{i}", self.ports[i], peers)
        if i < len(self.nodes):
            self.nodes[i] = proc
        else:
            self.nodes.append(proc)
        return proc

    def start_hostile(self) -> Proc:
        state = self.out / "hostile"
        state.mkdir(exist_ok=True)
        log = self.out / "hostile.log"
        argv = [sys.executable, "-m", "tests.bench.hostile", "--config", str(self.lab.config),
                "--state-dir", str(state), "--port", str(self.ports[-1]),
                "--seed", str(self.rng.getrandbits(32)), "--first-delay", "2",
                "--gap", str(self.attack_gap[0]), str(self.attack_gap[1])]
        for a in self.addrs:
            argv += ["--peer", a]
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=self.lab.env(), start_new_session=True)
        proc = Proc(popen, f"127.0.0.1:{self.ports[-1]}", state, log)
        self.lab.procs.append(proc)  # lab.close() ends it too
        return proc

    def close(self) -> None:
        for proc in self.lab.procs:  # a stopped process must run again to die cleanly
            if proc.alive():
                with contextlib.suppress(OSError):
                    proc.popen.send_signal(signal.SIGCONT)
        self.lab.close()

    # sampling

    def sample(self, t: float) -> None:
        for i, (proc, watch) in enumerate(zip(self.nodes, self.watch, strict=True)):
            watch.scan(t)
            if i in self.down:
                continue
            doc = status_of(proc, 1.5)
            if doc is None:
                watch.status_errors += 1
                continue
            watch.statuses += 1
            watch.ids.add(doc["node_id"])
            watch.last_status = doc

    def leaders(self) -> list[str | None]:
        return [w.last_status.get("leader") if w.last_status else None for w in self.watch]

    def honest_ids(self) -> set[str]:
        return set().union(*(w.ids for w in self.watch))

    def settled(self) -> dict | None:
        """The settled state (one honest leader everyone follows), or None."""
        docs = [status_of(p) for p in self.nodes]
        if any(d is None for d in docs) or not all(p.alive() for p in self.nodes):
            return None
        leaders = {d["leader"] for d in docs}
        if len(leaders) != 1 or None in leaders:
            return None
        (leader,) = leaders
        if leader not in {d["node_id"] for d in docs}:
            return None
        if sum(1 for d in docs if d["is_leader"]) != 1:
            return None
        return {"leader": leader, "docs": docs}

    # faults

    def apply(self, fault: Fault, t: float) -> None:
        proc = self.nodes[fault.node]
        if fault.kind == "kill":
            self.lab.kill(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(5)
            self.down[fault.node] = "killed"
        else:
            proc.popen.send_signal(signal.SIGSTOP)
            self.down[fault.node] = "stopped"
        self.events.append({"t": round(t, 2), "action": fault.kind, "node": fault.node,
                            "for": fault.length})

    def recover(self, i: int, t: float) -> None:
        what = self.down.pop(i)
        if what == "killed":
            self.start_node(i)
            self.events.append({"t": round(t, 2), "action": "restart", "node": i})
        else:
            self.nodes[i].popen.send_signal(signal.SIGCONT)
            self.events.append({"t": round(t, 2), "action": "cont", "node": i})

    # the run

    def run(self) -> RunResult:
        self.log(f"[{self.name}] starting {N_HONEST} honest nodes"
                 + (" + the hostile member" if self.chaos else "") + f" in {self.out}")
        for i in range(N_HONEST):
            self.start_node(i)
        deadline = time.monotonic() + 90
        while self.settled() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the swarm never formed (see {self.out})")
            time.sleep(0.5)
        if self.chaos:
            self.hostile = self.start_hostile()
        start = time.monotonic()
        recover_at: dict[int, float] = {}
        pending = list(self.plan)
        leaders_seen: list[str | None] = []
        next_report = 10.0
        while (t := time.monotonic() - start) < self.seconds:
            while pending and pending[0].at <= t:
                fault = pending.pop(0)
                self.apply(fault, t)
                recover_at[fault.node] = fault.at + fault.length
            for i, when in sorted(recover_at.items()):
                if when <= t:
                    del recover_at[i]
                    self.recover(i, t)
            self.sample(t)
            for leader in self.leaders():
                if not leaders_seen or leaders_seen[-1] != leader:
                    leaders_seen.append(leader)
            if t >= next_report:
                next_report += 10.0
                steps = [w.last_status.get("step") if w.last_status else None
                         for w in self.watch]
                self.log(f"[{self.name}] t={t:5.1f}s steps {steps} down {self.down} "
                         f"leaders {[x[:8] if x else None for x in self.leaders()]}")
            time.sleep(0.5)
        # the faults end: the hostile member goes, every node runs again
        if self.hostile is not None:
            self.hostile.popen.send_signal(signal.SIGTERM)
            try:
                self.hostile.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.hostile.popen.kill()
        for i in sorted(self.down):
            self.recover(i, time.monotonic() - start)
        settle_start = time.monotonic()
        settled = None
        while time.monotonic() - settle_start < self.settle:
            self.sample(time.monotonic() - start)
            settled = self.settled()
            if settled is not None:
                break
            time.sleep(0.5)
        settled_after = time.monotonic() - settle_start if settled else None
        self.log(f"[{self.name}] settled after {settled_after}" if settled else
                 f"[{self.name}] NOT settled within {self.settle:g}s")
        # still stepping? two samples 3 s apart
        first = [status_of(p) for p in self.nodes]
        time.sleep(3.0)
        self.sample(time.monotonic() - start)
        second = [status_of(p) for p in self.nodes]
        final_docs = second
        codes = self.lab.stop_all(30)
        for watch in self.watch:
            watch.scan(time.monotonic() - start)
        return self._result(first, second, final_docs, settled, settled_after, leaders_seen,
                            codes)

    def _result(self, first, second, final_docs, settled, settled_after, leaders_seen,
                codes) -> RunResult:
        ids = self.honest_ids()
        final = []
        for i, (a, b) in enumerate(zip(first, second, strict=True)):
            score = score_node(self.lab.config, self.watch[i].state_dir)
            final.append({
                "node": f"n{i}", "node_id": b["node_id"] if b else None,
                "answered": b is not None,
                "stepping": bool(a and b and b["step"] > a["step"]),
                "step": b["step"] if b else None, "term": b["term"] if b else None,
                "leader": b["leader"] if b else None,
                "swarm_samples": b["swarm_samples"] if b else None,
                "eval_loss_status": b.get("eval_loss") if b else None,
                "phase": b.get("phase") if b else None,
                "exit_code": self.nodes[i].popen.returncode, **score})
        attacks = []
        if self.hostile is not None:
            attacks = [e for e in self.hostile.events() if e.get("event") == "attack"]
        regressions = [r for w in self.watch for r in w.regressions()]
        leader = settled["leader"] if settled else None
        res = RunResult(self.name, self.seconds, [asdict(f) for f in self.plan] if self.chaos
                        else [], attacks, settled_after, final, leader, leaders_seen,
                        regressions, {w.name: w.history() for w in self.watch}, codes)
        res.evidence["fault_events"] = self.events
        alive = [f["answered"] and f["stepping"] for f in final]
        res.invariants["alive"] = all(alive)
        res.evidence["alive"] = {f["node"]: {"answered": f["answered"],
                                             "stepping": f["stepping"], "phase": f["phase"]}
                                 for f in final}
        following = [d["leader"] if d else None for d in final_docs]
        res.invariants["one_leader"] = bool(
            settled and leader in ids and len(set(following)) == 1 and following[0] == leader)
        res.evidence["one_leader"] = {"settled_leader": leader, "following": following,
                                      "honest_ids": sorted(ids),
                                      "is_leader": [d["is_leader"] if d else None
                                                    for d in final_docs]}
        res.invariants["ckpt_monotonic"] = not regressions
        res.evidence["ckpt_monotonic"] = regressions[:10]
        res.invariants["finite"] = all(f["finite"] for f in final)
        res.evidence["finite"] = {f["node"]: {"finite": f["finite"], "max_abs": f["max_abs"],
                                              "checkpoint": f["checkpoint"]} for f in final}
        losses = [f["heldout"] for f in final if f["heldout"] is not None]
        res.heldout_mean = float(np.mean(losses)) if len(losses) == len(final) else None
        return res


def score_node(config: Path, state_dir: Path) -> dict:
    """Held-out loss and finiteness of the newest checkpoint the node wrote (by mtime)."""
    root = state_dir / "checkpoints"
    paths = checkpoint.list_checkpoints(root)
    if not paths:
        return {"checkpoint": None, "heldout": None, "finite": False, "max_abs": None}
    path = max(paths, key=lambda p: (p / checkpoint.store.MANIFEST_FILE).stat().st_mtime_ns)
    learner = _scorer(str(config))
    try:
        manifest = checkpoint.read_manifest(path)
        tensors = load_file(str(path / checkpoint.MODEL_FILE))
        flat = np.concatenate([t.ravel() for t in tensors.values()])
        finite = bool(np.isfinite(flat).all())
        max_abs = float(np.max(np.abs(flat))) if flat.size else 0.0
        if not finite:
            return {"checkpoint": path.name, "heldout": None, "finite": False,
                    "max_abs": max_abs}
        learner.restore(path, manifest, with_state=False)
        loss = float(learner.evaluate())
    except (checkpoint.CheckpointError, OSError, ValueError) as exc:
        return {"checkpoint": path.name, "heldout": None, "finite": False, "max_abs": None,
                "error": str(exc)}
    return {"checkpoint": path.name, "heldout": loss if math.isfinite(loss) else None,
            "finite": finite, "max_abs": max_abs}


_SCORERS: dict[str, Learner] = {}


def _scorer(config: str) -> Learner:
    """A learner of the soak's configuration whose weights are replaced before each score."""
    if config not in _SCORERS:
        settings = settings_of(resolve(config, {}, {}))
        corpus = load_corpus(settings.data.path, settings.data.holdout_fraction,
                             settings.model.ctx_len + 2)
        model, _ = model_for(settings, corpus)  # as `join` builds it (LoRA: on its base)
        _SCORERS[config] = Learner(model, "0" * 32, settings.train, corpus,
                                   settings.train.batch or 8, 1, settings.eval.windows)
    return _SCORERS[config]


# -- reporting ------------------------------------------------------------------------------------


def run_soak(out: Path, seed: int, seconds: float, *, baseline: bool = True,
             fault_gap: tuple[float, float] = (3.0, 7.0),
             attack_gap: tuple[float, float] = (2.0, 5.0), settle: float = 90.0,
             log=print) -> dict:
    """Baseline (optional) then chaos; the result document (also written to out/result.json)."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"seed": seed, "seconds": seconds, "config": SOAK_TOML,
                           "fault_gap": fault_gap, "attack_gap": attack_gap}
    base = None
    if baseline:
        soak = Soak(out, "baseline", seed, seconds, chaos=False, settle=settle, log=log)
        try:
            base = soak.run()
        finally:
            soak.close()
        doc["baseline"] = asdict(base)
    soak = Soak(out, "chaos", seed, seconds, chaos=True, fault_gap=fault_gap,
                attack_gap=attack_gap, settle=settle, log=log)
    try:
        chaos = soak.run()
    finally:
        soak.close()
    if base is not None:
        ref = base.heldout_mean
        per_node = {f["node"]: f["heldout"] for f in chaos.final}
        ok = ref is not None and all(v is not None and v <= (1 + HELDOUT_TOLERANCE) * ref
                                     for v in per_node.values())
        chaos.invariants["heldout"] = ok
        chaos.evidence["heldout"] = {"baseline_mean": ref, "chaos": per_node,
                                     "limit": None if ref is None else
                                     (1 + HELDOUT_TOLERANCE) * ref}
    doc["chaos"] = asdict(chaos)
    doc["invariants"] = chaos.invariants
    doc["ok"] = all(chaos.invariants.values())
    (out / "result.json").write_text(json.dumps(doc, indent=1, default=str))
    return doc


def table(doc: dict) -> str:
    lines = []
    for name in ("baseline", "chaos"):
        run = doc.get(name)
        if run is None:
            continue
        settled = run["settled_after"]
        settled = "never" if settled is None else f"after {settled:.1f} s"
        mean = run["heldout_mean"]
        mean = "-" if mean is None else f"{mean:.4g}"
        lines.append(f"\n{name}: {run['seconds']:g}s, {len(run['faults'])} faults, "
                     f"{len(run['attacks'])} hostile attacks, settled {settled}, leader "
                     f"{str(run['leader'])[:12]}, held-out mean {mean}")
        lines.append(f"  {'node':<5}{'alive':>6}{'step':>8}{'term':>18}{'swarm samples':>18}"
                     f"{'held-out':>10}{'max |w|':>11}  checkpoint")
        for f in run["final"]:
            held = "-" if f["heldout"] is None else f"{f['heldout']:.4g}"
            mx = "-" if f["max_abs"] is None else f"{f['max_abs']:.3g}"
            alive = "yes" if f["answered"] and f["stepping"] else "NO"
            lines.append(f"  {f['node']:<5}{alive:>6}"
                         f"{str(f['step']):>8}{str(f['term']):>18}{str(f['swarm_samples']):>18}"
                         f"{held:>10}{mx:>11}  {f['checkpoint']}")
    chaos = doc["chaos"]
    kinds: dict[str, int] = {}
    for a in chaos["attacks"]:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    faults: dict[str, int] = {}
    for f in chaos["faults"]:
        faults[f["kind"]] = faults.get(f["kind"], 0) + 1
    lines.append(f"\nfaults: {faults}; attacks: {kinds}")
    lines.append("invariants:")
    for name, ok in chaos["invariants"].items():
        lines.append(f"  {name:<15} {'held' if ok else 'FAILED'}")
        if not ok:
            evidence = json.dumps(chaos["evidence"].get(name), default=str)
            lines.append(f"    evidence: {evidence[:1500]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="chaos soak (issue 13)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--settle", type=float, default=90.0)
    args = ap.parse_args(argv)
    doc = run_soak(args.out, args.seed, args.seconds, baseline=not args.no_baseline,
                   settle=args.settle)
    print(table(doc))
    print(f"\nresult: {args.out / 'result.json'}; "
          f"{'every invariant held' if doc['ok'] else 'SOME INVARIANT FAILED'}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
