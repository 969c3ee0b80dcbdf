"""The `/v1/status` document of a training node (node.py's `Node.status`): its phase, join,
losses, counters, leader, traffic, gossip statistics, offenders, and one row per member it
knows (state, class, progress, rate, traffic, RTT, bandwidth, holdings, gradients used,
averaging snapshots refused). Plain data; reads the node, changes nothing."""

from __future__ import annotations

from typing import Any

from p2ptrain.proto.records import holding_doc


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
        "bytes_in": sum(node.bytes_in.values()), "bytes_out": sum(node.bytes_out.values()),
        "consensus_distance": trainer.distance, "skipped_steps": node.skipped,
        "peers_last_mix": 0 if mix is None else len(mix.peers),
        "gossip": {**trainer.stats, "average_fallbacks": trainer.guard.fallbacks},
        "drops": dict(trainer.mixer.drops),
        "members": members,
        "offenders": node.offenders.status(node.control.now),
    }
