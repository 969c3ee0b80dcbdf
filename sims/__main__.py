"""`python -m sims`: list the shipped scenarios, or run one.

    python -m sims list
    python -m sims run seed-fleet [--seed N] [--out DIR] [--jobs J] [--no-plots]
    python -m sims seeds DIR [DIR ...]

`run` writes DIR/results.json (deterministic for a seed), DIR/table.md and the PNG plots
(with the `plot` extra), prints the table, and reports the wall-clock time on stderr and in
DIR/run.log -- never in results.json. `seeds` prints one table over several runs' output
directories (seeds of one scenario, or several scenarios): time to target per seed, the
median, and the best single machine's and the coordinator's time over each method's.
Only this driver reads the wall clock.
"""

from __future__ import annotations

import os

# One BLAS thread per process, set before anything imports numpy: the models are small, and
# on a 2-core machine a second BLAS thread fights the other job for the core.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from sims import run, scenario

    parser = argparse.ArgumentParser(prog="python -m sims",
                                     description="p2ptrain's network simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the shipped scenarios")
    p_run = sub.add_parser("run", help="run a scenario (a name or a .toml path)")
    p_run.add_argument("scenario")
    p_run.add_argument("--seed", type=int, default=None, help="run seed (default: the file's)")
    p_run.add_argument("--out", type=Path, default=None,
                       help="output directory (default: sims-out/SCENARIO)")
    p_run.add_argument("--jobs", type=int, default=None,
                       help="methods run in parallel processes (default: the file's, or 1)")
    p_run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p_seeds = sub.add_parser("seeds", help="one table over several runs (results.json dirs)")
    p_seeds.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)

    if args.command == "seeds":
        import json

        from sims import report

        docs = []
        for d in args.dirs:
            try:
                doc = json.loads((d / "results.json").read_text())
                if not isinstance(doc, dict) or not {"seed", "scenario", "methods"} <= doc.keys():
                    raise ValueError("not a run's results")
                docs.append(doc)
            except (OSError, ValueError) as exc:  # not a run's directory, or a damaged one
                print(f"error: {d}: no readable results.json ({exc.__class__.__name__}: "
                      f"{exc}); give directories `python -m sims run` wrote", file=sys.stderr)
                return 2
        print(report.seeds_table(docs), end="")
        return 0

    if args.command == "list":
        names = scenario.available()
        width = max((len(name) for name in names), default=0)
        for name in names:
            sc = scenario.load(name)
            print(f"{name:{width}s}  {sc.mode:8s} {sc.node_count:5d} machines  {sc.description}")
        return 0
    try:
        sc = scenario.load(args.scenario)
    except scenario.ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("sims-out") / sc.name
    started = time.perf_counter()
    results = run.run_scenario(sc, args.seed, args.jobs)
    notes = run.write_outputs(results, out, plots=not args.no_plots)
    elapsed = time.perf_counter() - started
    (out / "run.log").write_text(f"scenario {sc.name} seed {results['seed']}: "
                                 f"{elapsed:.1f} s wall clock\n")
    print((out / "table.md").read_text())
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {out}/results.json, table.md ({elapsed:.1f} s wall clock)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
