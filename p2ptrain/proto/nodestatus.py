"""The `/v1/status` document of a training node (node.py's `Node.status`): its phase, join,
losses, counters, leader, traffic, gossip statistics, offenders, and one row per member it
knows (state, class, progress, rate, traffic, RTT, bandwidth, holdings, gradients used,
averaging snapshots refused). Plain data; `node_status` reads the node, changes nothing.

Those per-member figures are kept per node id the node has heard, so `forget_gone` drops the
ids the membership table forgot (it is bounded; made-up members listed by a key holder come
and go through it), keeping the traffic totals whole."""

from __future__ import annotations

from typing import Any

from p2ptrain.proto.membership.table import MAX_MEMBERS
from p2ptrain.proto.records import holding_doc

FIGURES_BOUND = 2 * MAX_MEMBERS  # ids in a per-member figure before forgotten ones are dropped


def _figures(node: Any) -> tuple[dict, ...]:
    trainer = node.trainer
    tracking = () if trainer.tracker is None else (trainer.tracker.guard.refused,)
    return (node.bytes_in, node.bytes_out, trainer.peer_progress, trainer.guard.refused,
            trainer.mixer.used, trainer.served, trainer.benched, *tracking)


def forget_gone(node: Any) -> None:
    """Drop the per-member figures of ids the table no longer holds, once any of them holds
    more than FIGURES_BOUND (the traffic they carried stays in the node's totals)."""
    figures = _figures(node)
    if max(len(f) for f in figures) <= FIGURES_BOUND:
        return
    known = node.control.members()
    for i, figure in enumerate(figures):
        for key in [k for k in figure if (k.hex() if type(k) is bytes else k) not in known]:
            value = figure.pop(key)
            if i < 2:
                node.bytes_gone[i] += value


def node_status(node: Any) -> dict[str, Any]:
    """`node` (a training Node) as plain data (`swarm` is the driver's to add)."""
    learner, trainer = node.learner, node.trainer
    rows = node.control.status()
    holdings = node.control.membership.holdings
    members = []
    for row in rows[1:]:
        peer = row["node_id"]
        stats = trainer.peers.get(peer)
        step, loss = trainer.peer_progress.get(peer, (None, None))
        members.append({
            "node_id": peer, "addr": row["addr"], "state": row["state"],
            "device_class": row["device_class"], "outbound_only": row["outbound_only"],
            "leader": row["leader"], "step": step, "loss": loss, "samples": row["samples"],
            "samples_per_s": node.control.sample_rate(peer),
            "bytes_in": node.bytes_in[peer], "bytes_out": node.bytes_out[peer],
            "rtt_ms": None if stats.rtt is None else stats.rtt * 1e3,
            "bandwidth": stats.bandwidth, "holds": holding_doc(holdings.of(peer)),
            "gradients_used": trainer.mixer.used[bytes.fromhex(peer)],
            "averages_refused": trainer.guard.refused[peer]})
    mix = trainer.last_mix
    return {
        "node_id": node.node_id, "device_class": rows[0]["device_class"],
        "phase": node.phase, "step": learner.step,
        "join": {"state": node.join.state, "attempts": node.join.attempt,
                 "reason": node.join.reason, "steps": node.join_steps},
        "loss": node.loss, "eval_loss": node.eval_loss, "samples": learner.samples,
        "swarm_samples": learner.count.total, "leader": node.control.leader,
        "term": node.control.term, "is_leader": node.control.is_leader,
        "holds": holding_doc(holdings.mine),
        "bytes_in": sum(node.bytes_in.values()) + node.bytes_gone[0],
        "bytes_out": sum(node.bytes_out.values()) + node.bytes_gone[1],
        "consensus_distance": trainer.distance, "skipped_steps": node.skipped,
        "peers_last_mix": 0 if mix is None else len(mix.peers),
        "gossip": {**trainer.stats, "average_fallbacks": trainer.guard.fallbacks},
        "drops": dict(trainer.mixer.drops),
        "members": members,
        "offenders": node.offenders.status(node.control.now),
    }
