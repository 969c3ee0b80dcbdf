"""Final loss and bytes per trained sample of several gossip configurations in a real 3-node
run (issue 17: "bytes per trained sample against dense fp32 gradient exchange and final loss
against the best configuration").

    python -m tests.bench.realgossip [--configs A,B,B3,B3o,I,F16,F8,C,D,D16,E,F,S] [--seeds 2]
                                     [--first-seed 0] [--total-samples 200000] [--timeout 900]
                                     [--json OUT] [--keep DIR] [--lora RANK]
    python -m tests.bench.realgossip --table OUT [OUT ...]   # the table of saved runs

Each run: three `p2ptrain join` processes on loopback (tests/swarmlab.py: a fresh swarm key,
its own state directories, mDNS off), the same rwkv 2 x 64 on the built-in corpus, the same
`train.seed`, batches 4, 6 and 8 (unequal speeds: the step time is mostly fixed overhead at
this size, so the batch-8 node trains more samples per second than the batch-4 one; 1.2-1.5x
on the loaded 2-core machine of docs/BENCHMARKS.md section 17). With `--lora RANK` the nodes
train adapters of that rank on one frozen base of the same shape (fresh weights, written once
per invocation; the held-out scores load each checkpoint's adapters on it) instead.
Training starts once a node sees both peers. The run ends by itself: a node stops when the
swarm's sample count it knows reaches `train.total_samples` (and writes a final checkpoint),
so every configuration trains the same swarm budget whatever the machine's load; compare
results at that budget, never by wall time.

Figures of a run, read from each node's last `/v1/status` before it exited (polled every
0.25 s) and from its log and checkpoints:
- bytes per trained sample: every body byte every node sent (`upload_bytes`: requests and
  responses, control plane and checkpoint serving included; `sent_by_kind` gives the message
  kinds) over every sample trained (the steps of each node's `stopped` log line times its
  batch); the status polled last may miss the final fraction of a second (`missed_steps`
  says how many steps it missed, and the bytes of Leave messages are not in it);
- dense fp32 / config: one dense fp32 gradient sent per step is 4 bytes x parameters per
  step, that is 4 x parameters x steps / samples per sample (batches differ: the swarm's
  mean), over the configuration's bytes per sample;
- held-out loss of each node's final checkpoint (tests/bench/chaos_soak.py `score_node`:
  `eval.windows` = 512 fixed windows of the held-out tail, the same for every run); the
  leader's is the deliverable (the leader the nodes followed in the last poll where all three
  answered); "mean replica" is the mean over the three nodes.

Configurations (`gossip.*` keys, p2ptrain/proto/gossip/config.py), CONFIGS below, and S, the
serial reference: one `join --alone` node trains the whole budget at batch 6. The table gives
the mean over seeds. A seed fixes the initial weights only: node ids, so data shards and
partner choices, are new each run. Every process is ended on exit, also on failure or Ctrl-C. This
file measures; it changes neither the node nor its defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from p2ptrain.lora.basefile import base_from_init
from p2ptrain.models.rwkv import RWKVConfig
from tests.bench.chaos_soak import score_node
from tests.swarmlab import Proc, SwarmLab, free_ports, wait_for

MODEL = {"n_layer": 2, "n_embd": 64, "ctx_len": 32}
BATCHES = (4, 6, 8)  # one node each: unequal sample rates
HELDOUT_WINDOWS = 512
POLL = 0.25  # s between status polls (the last one before a node exits is its figure)
CONFIGS: dict[str, tuple[str, dict | None]] = {  # None: one node alone
    # A, B, B3, B3o, C: pinned to fp16 values, as measured (the default is int8 now)
    "A": ("old default (averaging every 5, subset fp16 10%, pull 0.5)",
          {"average_pull_max": 0.5, "averaging": "subset_fp16"}),
    "B": ("rate-weighted averaging (pull max 0.9)",
          {"average_pull_max": 0.9, "average_pull_power": 1.0, "averaging": "subset_fp16"}),
    # the default from 2026-12-02 (B was the default before) until int8 values (I)
    "B3": ("B with pull power 3, pull at most 0.99 (values in fp16)",
           {"average_pull_max": 0.99, "average_pull_power": 3.0, "averaging": "subset_fp16"}),
    # B3 with partners drawn as before 2026-12-02 evening (B3 itself draws as the default
    # does: rates cubed, only once observed)
    "B3o": ("B3 with draws by the rate itself, unknown rates at the median",
            {"average_pull_max": 0.99, "average_pull_power": 3.0, "average_draw_power": 1.0,
             "average_known_rates": False, "averaging": "subset_fp16"}),
    # the default since 2026-12-02, late
    "I": ("B3 with the values in int8, a scale per 256 (subset_int8)",
          {"average_pull_max": 0.99, "average_pull_power": 3.0, "averaging": "subset_int8"}),
    # every coordinate, as auto averages in LoRA mode on a big base (run with --lora)
    "F16": ("every coordinate in fp16 (LoRA mode's default until int8)", {"averaging": "fp16"}),
    "F8": ("every coordinate in int8 (LoRA mode's default)", {"averaging": "int8"}),
    "C": ("rate-weighted averaging every step", {"average_pull_max": 0.9, "average_every": 1,
                                                 "average_pull_power": 1.0,
                                                 "averaging": "subset_fp16"}),
    "D": ("outer steps H 20, top-k 5% to 1 peer, no averaging, no rewind",
          {"outer_every": 20, "fanout": 1, "fraction": 0.05, "average_every": 0,
           "outer_momentum": 1.0, "outer_rewind": False}),  # e in 8 bits (the default)
    "D16": ("D with the error feedback in bfloat16 (outer_feedback_bits 16)",
            {"outer_every": 20, "fanout": 1, "fraction": 0.05, "average_every": 0,
             "outer_momentum": 1.0, "outer_rewind": False, "outer_feedback_bits": 16}),
    "E": ("dense fp32 gradient to 1 peer every step", {"fanout": 1, "codec": "none",
                                                       "average_every": 0}),
    "F": ("no communication", {"average_every": 0}),
    # the reference: the whole budget trained serially by one node (`join --alone`)
    "S": ("one node alone, batch 6, the whole budget (serial reference)", None),
}
SOLO_BATCH = 6  # the swarm's mean batch


def swarm_toml(gossip: dict, seed: int, total: int, lora: tuple[int, str] | None = None
               ) -> str:
    """The swarm's config; `lora` (rank, base directory): LoRA mode on that base."""
    lines = ["[model]", 'name = "rwkv"', "[model.rwkv]"]
    lines += [f"{k} = {v}" for k, v in MODEL.items()]
    lines += ["[train]", f"seed = {seed}", f"total_samples = {total}",
              f"warmup_samples = {total // 20}"]
    if lora is not None:
        lines += ['mode = "lora"', "[lora]", f"rank = {lora[0]}", f"base = {json.dumps(lora[1])}"]
    lines += ["[eval]", f"windows = {HELDOUT_WINDOWS}",
              "every_seconds = 0", "[net]", 'timing = "local"', "[checkpoint]",
              "every_seconds = 0", "[gossip]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in gossip.items()]
    return "\n".join(lines) + "\n"


def logged(proc: Proc, event: str) -> list[dict]:
    return [e for e in proc.events() if e.get("event") == event]


def run_alone(seed: int, total: int, timeout: float, tmp: Path) -> dict:
    """One node trains the whole budget alone; its figures, in the shape of `run_one`'s."""
    started = time.monotonic()
    with SwarmLab(tmp, swarm_toml({}, seed, total), name="realgossip") as lab:
        proc = lab.start("solo", free_ports(1)[0], [], "--alone", "--batch", str(SOLO_BATCH))
        wait_for("the node alone to end at train.total_samples", lambda: not proc.alive(),
                 timeout, poll=POLL)
        stopped = logged(proc, "stopped")
        step = stopped[-1]["step"] if stopped else 0
        node = {"node_id": "solo", "batch": SOLO_BATCH, "exit_code": proc.popen.returncode,
                "steps": step, "samples": step * SOLO_BATCH, "missed_steps": 0,
                "upload_bytes": 0, "message_bytes": 0, "sent_by_kind": {},
                "warnings": dict(Counter(e.get("event") for e in proc.events()
                                         if e.get("level") == "warning")),
                "params": (logged(proc, "start") or [{}])[0].get("params"),
                **score_node(lab.config, proc.state_dir)}
    return {"seconds": time.monotonic() - started, "nodes": [node], "leader": "solo",
            "leaders_seen": ["solo"]}


def run_one(gossip: dict, seed: int, total: int, timeout: float, tmp: Path,
            lora: tuple[int, str] | None = None) -> dict:
    """One 3-node run to `total` swarm samples; its figures."""
    started = time.monotonic()
    with SwarmLab(tmp, swarm_toml(gossip, seed, total, lora), name="realgossip") as lab:
        ports = free_ports(len(BATCHES))
        addrs = [f"127.0.0.1:{p}" for p in ports]
        env = lab.env(P2PTRAIN_NODE_MIN_PEERS=str(len(BATCHES) - 1),
                      P2PTRAIN_NODE_JOIN_TIMEOUT="30")
        procs = [lab.start(f"n{i}", ports[i], [a for a in addrs if a != addrs[i]],
                           "--batch", str(b), env=env) for i, b in enumerate(BATCHES)]
        last: list[dict | None] = [None] * len(procs)
        leaders: list[str] = []  # the leader all nodes followed, per poll where all answered

        def all_ended() -> bool:
            for i, p in enumerate(procs):
                if p.alive():
                    with contextlib.suppress(OSError, ValueError):
                        last[i] = p.status()
            docs = [d for d in last if d is not None]
            if len(docs) == len(procs) and all(p.alive() for p in procs):
                follow = {d["leader"] for d in docs}
                if len(follow) == 1 and None not in follow:
                    leaders.append(follow.pop())
            return not any(p.alive() for p in procs)

        wait_for("every node to end at train.total_samples", all_ended, timeout, poll=POLL)
        codes = [p.popen.returncode for p in procs]
        seconds = time.monotonic() - started
        nodes = []
        for i, p in enumerate(procs):
            doc = last[i] or {}
            stopped = logged(p, "stopped")
            saves = logged(p, "checkpoint")
            step = stopped[-1]["step"] if stopped else doc.get("step", 0)
            nodes.append({
                "node_id": doc.get("node_id"), "batch": BATCHES[i], "exit_code": codes[i],
                "stop_reason": stopped[-1].get("reason") if stopped else None,
                "steps": step, "samples": step * BATCHES[i],
                "missed_steps": step - doc.get("step", 0),
                "upload_bytes": doc.get("upload_bytes", 0),
                "message_bytes": sum(k["bytes"] for k in doc.get("sent_by_kind", {}).values()),
                "sent_by_kind": doc.get("sent_by_kind", {}),
                "swarm_samples": doc.get("swarm_samples"),
                "consensus_distance": doc.get("consensus_distance"),
                "gossip": doc.get("gossip"), "drops": doc.get("drops"),
                "runtime": doc.get("runtime"),
                "final_save_step": saves[-1]["step"] if saves else None,
                "warnings": dict(Counter(e.get("event") for e in p.events()
                                         if e.get("level") == "warning")),
                "params": (logged(p, "start") or [{}])[0].get("params"),
                **score_node(lab.config, p.state_dir)})
    leader = leaders[-1] if leaders else None
    return {"seconds": seconds, "nodes": nodes, "leader": leader,
            "leaders_seen": sorted(set(leaders))}


def figures(run: dict) -> dict:
    nodes = run["nodes"]
    samples = sum(n["samples"] for n in nodes)
    steps = sum(n["steps"] for n in nodes)
    params = nodes[0]["params"]
    sent = sum(n["upload_bytes"] for n in nodes)
    dense = 4 * params * steps / samples  # B/sample of one dense fp32 gradient per step
    per_sample = sent / samples
    leader = next((n for n in nodes if n["node_id"] == run["leader"]), None)
    losses = [n["heldout"] for n in nodes]
    return {"samples": samples, "bytes_per_sample": per_sample,
            "message_bytes_per_sample": sum(n["message_bytes"] for n in nodes) / samples,
            "dense_per_sample": dense, "dense_ratio": dense / per_sample if sent else None,
            "leader_loss": leader["heldout"] if leader else None,
            "mean_loss": statistics.fmean(losses) if None not in losses else None,
            "seconds": run["seconds"]}


def describe(node: dict, leads: bool) -> str:
    """One node of a run in a few words (for the progress output)."""
    loss = "-" if node["heldout"] is None else f"{node['heldout']:.4f}"
    return (f"batch {node['batch']}{' (leader)' if leads else ''}: exit {node['exit_code']}, "
            f"{node['samples']:,} samples, loss {loss}, warnings {node['warnings'] or 'none'}, "
            f"{node['missed_steps']} steps after the last poll"
            + ("" if node.get("final_save_step", node["steps"]) == node["steps"] else
               f", LAST CHECKPOINT AT STEP {node['final_save_step']} OF {node['steps']}"))


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def table(results: dict[str, list[dict]]) -> str:
    """The markdown table: each configuration's mean over its seeds; "vs the best leader"
    against the best swarm configuration (the serial reference is not one)."""
    rows = {}
    for name, runs in results.items():
        figs = [r["figures"] for r in runs if "figures" in r]
        rows[name] = {k: mean([f[k] for f in figs]) for k in
                      ("bytes_per_sample", "dense_ratio", "leader_loss", "mean_loss", "seconds")}
        leaders = [f["leader_loss"] for f in figs if f["leader_loss"] is not None]
        rows[name]["range"] = (min(leaders), max(leaders)) if len(leaders) > 1 else None
        rows[name]["runs"] = len(figs)
        rows[name]["failed"] = len(runs) - len(figs)
    best = min((r["leader_loss"] for name, r in rows.items()
                if r["leader_loss"] is not None and CONFIGS[name][1] is not None), default=None)
    out = ["| configuration | bytes per trained sample | dense fp32 / config | leader's final "
           "held-out loss (seeds' range) | mean replica's | vs the best leader | runs "
           "(mean wall s) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        vs = (None if r["leader_loss"] is None or best is None
              else 100 * (r["leader_loss"] / best - 1))
        failed = f", {r['failed']} failed" if r["failed"] else ""
        spread = "" if r["range"] is None else f" ({r['range'][0]:.4f}-{r['range'][1]:.4f})"
        ratio = "-" if not r["dense_ratio"] else f"{r['dense_ratio']:,.1f}x"
        cells = [f"{name}: {CONFIGS[name][0]}", number(r["bytes_per_sample"], ",.0f"), ratio,
                 number(r["leader_loss"], ".4f") + spread, number(r["mean_loss"], ".4f"),
                 "-" if vs is None else f"{vs:+.2f}%",
                 f"{r['runs']}{failed} ({number(r['seconds'], '.0f')})"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seeds", type=int, default=2, help="train.seed 0 .. this - 1")
    ap.add_argument("--first-seed", type=int, default=0, help="add this to every seed")
    ap.add_argument("--total-samples", type=int, default=200_000)
    ap.add_argument("--timeout", type=float, default=900.0, help="s per run, at most")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--keep", type=Path, help="keep each run's logs and checkpoints here")
    ap.add_argument("--lora", type=int, metavar="RANK", help="train adapters of this rank on "
                    "a base of the same shape (fresh weights, written once) instead")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSON",
                    help="print the table of runs saved with --json (merged), run nothing")
    args = ap.parse_args(argv)
    if args.table:
        merged: dict[str, list[dict]] = {}
        for path in args.table:
            for name, runs in json.loads(path.read_text()).items():
                merged.setdefault(name, []).extend(runs)
        print(table(merged), end="")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown} (known: {', '.join(CONFIGS)})")
    results: dict[str, list[dict]] = {n: [] for n in names}
    if args.lora and "S" in names:
        ap.error("--lora: the serial reference (S) trains in full; leave it out")
    with contextlib.ExitStack() as outer:
        lora = None
        if args.lora:  # one base for every run, removed at the end
            root = Path(outer.enter_context(tempfile.TemporaryDirectory(prefix="rg-base-")))
            lora = (args.lora, str(base_from_init(RWKVConfig(**MODEL), 7, root).path))
        run_all(args, names, results, lora)
    print()
    print(table(results), flush=True)
    return 0


def run_all(args: argparse.Namespace, names: list[str], results: dict[str, list[dict]],
            lora: tuple[int, str] | None) -> None:
    """Every configuration at every seed, each run's line printed as it ends."""
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name in names:
            with open("/proc/loadavg") as f:
                load = " ".join(f.read().split()[:3])
            with contextlib.ExitStack() as stack:
                if args.keep:
                    tmp = args.keep / f"{name}-seed{seed}"
                else:
                    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rg-")))
                try:
                    gossip = CONFIGS[name][1]
                    run = (run_alone(seed, args.total_samples, args.timeout, tmp)
                           if gossip is None else
                           run_one(gossip, seed, args.total_samples, args.timeout, tmp,
                                   lora))
                except AssertionError as exc:  # a run that does not end: said, not fatal
                    results[name].append({"seed": seed, "load": load, "error": str(exc)})
                    print(f"{name} seed {seed}: FAILED: {exc}", flush=True)
                    continue
            run.update(seed=seed, load=load, figures=figures(run))
            results[name].append(run)
            f = run["figures"]
            odd = [describe(n, n["node_id"] == run["leader"]) for n in run["nodes"]]
            print(f"{name} seed {seed} (load {load}): {f['seconds']:.0f} s, "
                  f"{f['samples']:,} samples, {f['bytes_per_sample']:,.0f} B/sample "
                  f"({f['message_bytes_per_sample']:,.0f} in messages), leader "
                  f"{f['leader_loss']}, mean {f['mean_loss']}; {'; '.join(odd)}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
