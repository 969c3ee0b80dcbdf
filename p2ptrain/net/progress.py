"""The networked node's progress line, every `log.every_seconds`: training, peers, leader,
swarm samples and traffic rates -- all read from the node's status document (the same one
`/v1/status` serves), so the line and the API never disagree. A driver loop: it sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from p2ptrain.report import Reporter, human_count


def progress_line(doc: dict[str, Any], rate_in: float, rate_out: float
                  ) -> tuple[str, dict[str, Any]]:
    """The text of one progress line and its JSON fields, from a status document."""
    members = doc["members"]
    alive = sum(1 for m in members if m["state"] == "alive")
    leader = doc["leader"]
    lead = "none" if leader is None else ("me" if leader == doc["node_id"] else leader[:12])
    swarm = doc["swarm_samples"]
    pct = 100.0 * swarm / max(doc["total_samples"], 1)
    loss = "-" if doc["loss"] is None else f"{doc['loss']:.3f}"
    held = "-" if doc["eval_loss"] is None else f"{doc['eval_loss']:.3f}"
    text = (f"step {doc['step']:>6} | loss {loss} | held-out {held} | peers {alive}/"
            f"{len(members)} | leader {lead} (term {doc['term']}) | swarm "
            f"{human_count(swarm)} samples ({pct:.1f}%) | up {human_count(rate_out)}B/s down "
            f"{human_count(rate_in)}B/s | {doc['phase']}")
    fields = dict(step=doc["step"], loss=doc["loss"], eval_loss=doc["eval_loss"], peers=alive,
                  leader=leader, term=doc["term"], swarm_samples=swarm,
                  samples=doc["samples"], up_bytes_per_s=rate_out, down_bytes_per_s=rate_in,
                  phase=doc["phase"])
    return text, fields


class Repeats:
    """Says whether a progress line is worth printing: not when it is the same as the last one
    printed (an idle, finished or joining node), unless `quiet` seconds passed since."""

    def __init__(self, quiet: float = 60.0):
        self.quiet = quiet
        self.last: str | None = None
        self.at = -float("inf")

    def fresh(self, text: str, now: float) -> bool:
        if text == self.last and now - self.at < self.quiet:
            return False
        self.last, self.at = text, now
        return True


async def progress_loop(every: float, status: Callable[[], dict[str, Any]],
                        now: Callable[[], float], reporter: Reporter) -> None:
    """Print a progress line every `every` seconds until cancelled (a line that says nothing
    new is held back: see `Repeats`)."""
    last_in = last_out = 0
    last_t = now()
    repeats = Repeats()
    while True:
        await asyncio.sleep(every)
        doc = status()
        bytes_in, bytes_out = doc["bytes_in"], doc["upload_bytes"]
        t = now()
        span = max(t - last_t, 1e-9)
        rate_in, rate_out = (bytes_in - last_in) / span, (bytes_out - last_out) / span
        last_in, last_out, last_t = bytes_in, bytes_out, t
        text, fields = progress_line(doc, rate_in, rate_out)
        if repeats.fresh(text, t):
            reporter.info(text, event="progress", **fields)


def say_membership(reporter: Reporter, action: Any) -> None:
    """One log line for a MemberUp, MemberDown, Refused or Offender action."""
    kind = type(action).__name__
    if kind == "Offender":
        reporter.warn(f"member {action.node_id[:12]} ignored: {action.refusals} of its values "
                      f"refused (last: {action.reason})", event="offender",
                      node_id=action.node_id, refusals=action.refusals, reason=action.reason)
    elif kind == "MemberUp":
        info = action.info
        reporter.info(f"member {info.node_id[:12]} up at {info.addr} ({info.device_class})",
                      event="member_up", node_id=info.node_id, addr=info.addr)
    elif kind == "MemberDown":
        word = "left" if action.left else "down"
        reporter.info(f"member {action.node_id[:12]} {word}", event="member_down",
                      node_id=action.node_id, left=action.left)
    else:
        reporter.warn(f"{'refused by' if action.by_peer else 'refusing'} {action.addr}: "
                      f"{action.reason}", event="refused", addr=action.addr,
                      keys=list(action.keys))


async def every_second(job: Callable[[], None]) -> None:
    """Run `job()` once a second until cancelled."""
    while True:
        await asyncio.sleep(1.0)
        job()


def say_leader(reporter: Reporter, action: Any, own_id: str, stopping: bool = False) -> None:
    """One log line for a LeaderChanged action (`stopping`: this node is leaving)."""
    fields = dict(event="leader", leader=action.leader, term=action.term)
    if action.leader == own_id:
        reporter.info(f"leading the swarm (term {action.term})", **fields)
    elif action.leader is None:
        reporter.info("no leader: this node is stopping" if stopping else
                      "no leader: lease lapsed", **fields)
    else:
        reporter.info(f"leader is {action.leader[:12]} (term {action.term})", **fields)


class FirstExchange:
    """Says once when the first complete peer gradient arrived (a join-time figure)."""

    def __init__(self, reporter: Reporter):
        self.reporter, self.said = reporter, False

    def check(self, node: Any, now: float) -> None:
        if self.said or node is None:
            return
        if node.trainer.stats.get("gradient_complete", 0) > 0:
            self.said = True
            self.reporter.info(f"first gradient from a peer after {now:.2f}s",
                               event="first_exchange", elapsed_s=now)
