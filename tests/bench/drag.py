"""A member holding the key that drags a few coordinates of one victim's replica, for as long
as you like (section 11 of docs/BENCHMARKS.md; tests/test_gossip_drag.py runs it short).

    python -m tests.bench.drag [--nodes 6] [--requests 2400]

Node 1 of N sends node 0 one averaging request per 0.5 s step of node 0, its seed following
the pair's chain (seeds.py): when the seed's subset holds the output biases of the ten most
frequent bytes, its snapshot is its own replica but for those, each put below the victim's
own by what an RMS distance of 0.045 allows (never refused: under min_distance); else its own
replica. Prints, six times, the requests the victim applied, how many carried the drag, the
ten biases of the victim and of an honest node, their held-out losses and the requests
declined (share, seed). The real protocol nodes and learners on the byte model, virtual time:
the figures do not depend on the machine's load."""

from __future__ import annotations

import argparse
import sys

from tests.test_gossip_drag import _drag


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.drag", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=6, help="nodes of the swarm, at least 3")
    ap.add_argument("--requests", type=int, default=2400, help="the member's requests")
    args = ap.parse_args(argv)
    if args.nodes < 3 or args.requests < 6:
        ap.error("--nodes must be at least 3 and --requests at least 6")

    def report(victim, honest, coords, applied, dragged, k) -> None:
        v, h = victim.learner, honest.learner
        print(f"{k:5d} requests: applied {applied}, dragging {dragged}; the ten biases "
              f"{v.params[coords].mean():+.2f} (an honest node's {h.params[coords].mean():+.2f});"
              f" held-out loss {v.evaluate():.3f} (honest {h.evaluate():.3f}); declined: share "
              f"{victim.trainer.stats['average_declined_crowded']}, seed "
              f"{victim.trainer.stats['average_declined_seed']}", flush=True)

    _drag(args.nodes, args.requests, every=args.requests // 6, report=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
