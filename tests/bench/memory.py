"""Peak memory per parameter of a training node (issue 15): measured against p2ptrain.memplan.

    python -m tests.bench.memory --sizes 1m,10m,100m,200m,1b [--tree DIR] [--networked]
    python -m tests.bench.memory --sizes 100m,200m --outer keep     # with outer steps
    python -m tests.bench.memory --step-time 12x768 --vocab 256,50277
    python -m tests.bench.memory --pi

Each size runs `p2ptrain join --alone --steps 3 --batch 1` (or networked, with no peers: it
leads and checkpoints at once and at the end) in a fresh process of the rwkv family member
nearest in parameters (memplan.rwkv_shape; or an explicit shape `LxC`), with a fresh state
directory in /tmp, and reads its peak RSS from wait4 (ru_maxrss). It checks that the final
checkpoint was written, so writes are part of the peak. `--tree` runs another checkout (e.g.
an export of the commit before the diet) for a before/after table. The held-out evaluation
runs on P2PTRAIN_EVAL_WINDOWS windows (32 by default: the memory of the default 256 -- at
most 32 per forward pass -- in an eighth of the time). Then a least-squares slope (MB + B/param)
over the sizes. `--step-time` times train_step in-process (vocabulary is not an option of the
CLI: set here). `--pi` prints memplan's largest trainable model for 4 and 8 GB Raspberry Pis.
This file only measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from p2ptrain import memplan
from p2ptrain.models.rwkv import RWKV, RWKVConfig

REPO = Path(__file__).resolve().parents[2]
# Started from a big process (pytest, this bench after --step-time), a child's ru_maxrss
# includes its parent's size: Linux keeps the high-water mark of the memory it forked from
# across exec. So a small launcher process starts the node and reports the node's peak.
LAUNCHER = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); "
            "_, status, usage = os.wait4(p.pid, 0); "
            "open(sys.argv[1], 'w').write(str(usage.ru_maxrss)); "
            "sys.exit(os.waitstatus_to_exitcode(status))")
GB = 10**9
GIB = 2**30
PI_OS_BYTES = 0.6 * GIB  # left to the operating system on a Pi


def shape_of(spec: str) -> RWKVConfig:
    """'12x768' -> that shape; '100m' / '1b' -> the family member nearest in parameters."""
    if "x" in spec:
        n_layer, n_embd = (int(v) for v in spec.split("x"))
        return replace(RWKVConfig(), n_layer=n_layer, n_embd=n_embd)
    target = float(spec[:-1]) * {"k": 1e3, "m": 1e6, "b": 1e9}[spec[-1].lower()]
    members = [memplan.rwkv_shape(c) for c in range(64, 8193, memplan.CHANNEL_STEP)]
    return min(members, key=lambda c: abs(math.log(RWKV(c).space.n_params / target)))


def outer_env(mode: str) -> dict[str, str]:
    """Gossip settings of a node with outer steps every 2 steps (so 3 steps share once):
    `mode` "keep" (outer_rewind false, one vector) or "rewind" (two)."""
    return {"P2PTRAIN_GOSSIP_OUTER_EVERY": "2", "P2PTRAIN_GOSSIP_FANOUT": "1",
            "P2PTRAIN_GOSSIP_AVERAGE_EVERY": "0",
            "P2PTRAIN_GOSSIP_OUTER_REWIND": "true" if mode == "rewind" else "false"}


def run_node(config: RWKVConfig, tree: Path = REPO, networked: bool = False,
             eval_windows: int = 32, port: int = 7390, resume: bool = False,
             outer: str = "") -> dict:
    """A `join` of 3 steps at batch 1 (`resume`: and a second one that resumes from its
    checkpoint): parameters, peak RSS (and the resumed run's), seconds, checkpoints."""
    with tempfile.TemporaryDirectory(prefix="p2pt-mem-") as state:
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--steps", "3", "--batch", "1",
               "--state-dir", state, "--log-format", "json"]
        cmd += (["--no-mdns", "--port", str(port), "--bind", "127.0.0.1"] if networked
                else ["--alone"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
        env.update(PYTHONPATH=str(tree), P2PTRAIN_EVAL_WINDOWS=str(eval_windows),
                   P2PTRAIN_MODEL_RWKV_N_LAYER=str(config.n_layer),
                   P2PTRAIN_MODEL_RWKV_N_EMBD=str(config.n_embd),
                   P2PTRAIN_MODEL_RWKV_CTX_LEN=str(config.ctx_len),
                   # the final checkpoint of a big model on a loaded machine may take longer
                   # than the default 20 s grace; the bench requires it
                   P2PTRAIN_NODE_GRACE_SECONDS="300")
        env.update(outer_env(outer) if outer else {})
        started = time.monotonic()
        peak, events = _join(cmd, env, tree, Path(state))
        got = {"params": next(e["params"] for e in events if e.get("event") == "start"),
               "peak": peak, "seconds": time.monotonic() - started,
               "checkpoints": sum(e.get("event") == "checkpoint" for e in events)}
        if resume:
            got["resumed"], events = _join(cmd, env, tree, Path(state))
            if not any(e.get("event") == "resumed" for e in events):
                raise RuntimeError("the second run did not resume from the first's checkpoint")
    return got


def _join(cmd: list[str], env: dict, tree: Path, state: Path) -> tuple[int, list[dict]]:
    """Run one node through the launcher: (its peak RSS in bytes, its JSON log events); the
    run must end with a final checkpoint."""
    peak_file = state.parent / f"{state.name}.peak-kib"
    try:
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(peak_file), *cmd], cwd=tree,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines = proc.stdout.decode(errors="replace").splitlines()
        if proc.returncode != 0:
            raise RuntimeError(f"join exited {proc.returncode}:\n" + "\n".join(lines[-20:]))
        peak = int(peak_file.read_text()) * 1024  # Linux: KiB
    finally:
        peak_file.unlink(missing_ok=True)
    events = [json.loads(line) for line in lines if line.startswith("{")]
    if not any(e.get("event") == "checkpoint" and e.get("final") for e in events):
        raise RuntimeError("the run wrote no final checkpoint:\n" + "\n".join(lines[-20:]))
    return peak, events


def slope(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares (intercept MB, bytes per parameter) of peak RSS against parameters."""
    n = np.array([p for p, _ in points], float)
    rss = np.array([r for _, r in points], float)
    b, a = np.polyfit(n, rss, 1)
    return a / 1e6, b


def step_seconds(config: RWKVConfig, steps: int = 3) -> float:
    """Median seconds of Learner.train_step at batch 1 (random byte windows)."""
    from p2ptrain.data.corpus import Corpus
    from p2ptrain.learner import Learner, TrainConfig

    tokens = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint8)
    corpus = Corpus("random", tokens[:180_000], tokens[180_000:])
    learner = Learner(RWKV(config), "00" * 16, TrainConfig(), corpus, batch=1, accum=1,
                      eval_count=1)
    learner.train_step()  # warm-up: scratch memory, BLAS threads
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        learner.train_step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def pi_table() -> list[str]:
    rows = ["| Pi | memory for training | mode | largest model | shape | predicted peak |",
            "|---|---:|---|---:|---|---:|"]
    for gb in (4, 8):
        budget = gb * GIB - PI_OS_BYTES
        for networked in (False, True):
            params, config = memplan.largest_trainable(budget, networked=networked)
            peak = memplan.rwkv_footprint(config, networked=networked).total
            rows.append(f"| {gb} GB | {budget / GB:.2f} GB | "
                        f"{'networked' if networked else 'alone'} | {params / 1e6:.0f}M | "
                        f"{config.n_layer} x {config.n_embd} | {peak / GB:.2f} GB |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="", help="comma-separated: 1m,10m,100m or LxC shapes")
    ap.add_argument("--tree", type=Path, default=REPO, help="checkout to run (default: this)")
    ap.add_argument("--networked", action="store_true", help="join without --alone")
    ap.add_argument("--outer", choices=("keep", "rewind"), default="",
                    help="networked, with outer steps (gossip.outer_rewind false / true)")
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--resume", action="store_true", help="also measure a resumed run")
    ap.add_argument("--step-time", default="", help="shape LxC to time train_step at")
    ap.add_argument("--vocab", default="256", help="vocabularies for --step-time")
    ap.add_argument("--pi", action="store_true", help="largest models for 4 and 8 GB Pis")
    args = ap.parse_args(argv)
    points = []
    if args.sizes:
        print("| params | shape | predicted | peak RSS | bytes/param | resumed | checkpoints "
              "| run |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for spec in filter(None, args.sizes.split(",")):
        config = shape_of(spec)
        networked = args.networked or bool(args.outer)
        got = run_node(config, args.tree, networked, args.eval_windows,
                       resume=args.resume, outer=args.outer)
        resumed = f"{got['resumed'] / GB:.3f} GB" if "resumed" in got else "-"
        predicted = memplan.rwkv_footprint(
            config, networked=networked, pushes=bool(args.outer), outer=bool(args.outer),
            outer_rewind=args.outer == "rewind").total
        shown = f"{predicted / GB:.3f} GB" if args.tree.resolve() == REPO else "-"
        points.append((got["params"], got["peak"]))
        print(f"| {got['params'] / 1e6:.2f}M | {config.n_layer} x {config.n_embd} | "
              f"{shown} | {got['peak'] / GB:.3f} GB | "
              f"{got['peak'] / got['params']:.1f} | {resumed} | {got['checkpoints']} | "
              f"{got['seconds']:.0f} s |", flush=True)
    if len(points) >= 2:
        intercept, per_param = slope(points)
        print(f"\nslope: {intercept:.0f} MB + {per_param:.2f} B/param")
    for spec in filter(None, [args.step_time]):
        for vocab in (int(v) for v in args.vocab.split(",")):
            config = replace(shape_of(spec), vocab_size=vocab)
            seconds = step_seconds(config)
            print(f"step at batch 1, {config.n_layer} x {config.n_embd}, vocab {vocab} "
                  f"({RWKV(config).space.n_params / 1e6:.1f}M params): {seconds:.2f} s", flush=True)
    if args.pi:
        print("\n".join(pi_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
