"""Real `p2ptrain join` processes on loopback with static seeds: membership, one leader,
gossip training, checkpoints served and fetched, leader fail-over after kill -9, rejoin, and
a node that joins with nothing but the token."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from p2ptrain import checkpoint
from tests.helpers import run_cli
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _alive_peers(doc: dict) -> set[str]:
    return {m["node_id"] for m in doc["members"] if m["state"] == "alive"}


def _leaders(procs) -> set[str | None]:
    return {p.status()["leader"] for p in procs}


def _evals(proc) -> list[float]:
    return [e["eval_loss"] for e in proc.events() if e.get("event") == "eval"]


def test_four_nodes_train_checkpoint_fail_over_and_rejoin(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(4)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        # knowing one peer is enough: every node is told only of node 0 (node 0 of node 1)
        nodes = [lab.start(f"n{i}", ports[i], [addrs[1] if i == 0 else addrs[0]])
                 for i in range(4)]
        ids = wait_for("every node to answer", lambda: [p.status()["node_id"] for p in nodes],
                       60)
        wait_for("all four to know each other",
                 lambda: all(_alive_peers(p.status()) == set(ids) - {p.status()["node_id"]}
                             for p in nodes), 60)
        def one_leader() -> str | None:
            leaders = _leaders(nodes)
            return (leaders.pop() if len(leaders) == 1 and None not in leaders
                    and sum(p.status()["is_leader"] for p in nodes) == 1 else None)

        wait_for("one leader everyone follows", one_leader, 60)
        # a node's fresh weights score ln(256) on the bytes; one that learned is well below,
        # however late it started (then its first eval is of the swarm's checkpoint)
        learned = math.log(256) - 0.5

        def trained_together(p) -> bool:
            used = [m["gradients_used"] for m in p.status()["members"]]
            evals = _evals(p)
            return sum(1 for u in used if u > 0) >= 2 and len(evals) >= 3 and evals[-1] < learned

        wait_for("every node to use gradients of 2+ peers and improve its held-out loss",
                 lambda: all(trained_together(p) for p in nodes), 120)
        leader = wait_for("one leader everyone follows, still or again", one_leader, 60)
        lead = nodes[ids.index(leader)]
        served = wait_for("a checkpoint signed by the leader",
                          lambda: [c for c in checkpoint.list_checkpoints(
                              lead.state_dir / "checkpoints")
                              if checkpoint.read_manifest(c).leader == leader], 60)

        # a fifth process fetches the leader's latest checkpoint through any node
        out = tmp_path / "fetched"
        other = nodes[(ids.index(leader) + 1) % 4]
        r = run_cli("checkpoint", "fetch", "--peer", other.addr, "--out", str(out),
                    "--token", lab.swarm.token(), env=lab.env())
        assert r.returncode == 0, r.stderr
        got = out / r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1]
        manifest = checkpoint.read_manifest(got)
        assert manifest.leader == leader
        assert f"checkpoint at step {manifest.step}: " in r.stderr, r.stderr
        original = lead.state_dir / "checkpoints" / got.name
        if original.exists():  # not yet pruned by the leader's keep-K
            assert manifest == checkpoint.read_manifest(original)
        tensors = load_file(str(got / checkpoint.MODEL_FILE))
        assert tensors and all(np.isfinite(t).all() for t in tensors.values())
        assert served

        # kill -9 the leader: the others elect a new one and keep training
        killed_at = time.monotonic()
        lab.kill(lead)
        rest = [p for p in nodes if p is not lead]
        new_leader = wait_for("a new leader among the survivors",
                              lambda: (lambda s: len(s) == 1 and None not in s
                                       and leader not in s and s.pop())(_leaders(rest)), 60)
        failover = time.monotonic() - killed_at
        print(f"fail-over after kill -9: new leader {new_leader[:12]} in {failover:.2f}s")
        steps = [p.status()["step"] for p in rest]
        wait_for("the survivors to keep stepping",
                 lambda: all(p.status()["step"] > s + 20 for p, s in zip(rest, steps,
                                                                          strict=True)), 60)

        # the killed node comes back: rejoins, fetches the new leader's checkpoint, trains
        back = lab.start("n_back", ports[ids.index(leader)], [rest[0].addr],
                         state=lead.state_dir)
        wait_for("the restarted node to be alive again for the others",
                 lambda: all(leader in _alive_peers(p.status()) for p in rest), 60)
        starts = wait_for("the restarted node to start training",
                          lambda: [e for e in back.events()
                                   if e.get("event") == "training_starts"], 60)
        assert "leader's checkpoint" in starts[0]["reason"], starts[0]
        wait_for("the restarted node to step",
                 lambda: back.status()["step"] > 20, 60)
        codes = lab.stop_all()
        assert codes == [-9, 0, 0, 0, 0] or sorted(codes)[1:] == [0, 0, 0, 0], codes


def _final_weights(proc) -> np.ndarray:
    path = checkpoint.list_checkpoints(proc.state_dir / "checkpoints")[0]
    tensors = load_file(str(path / checkpoint.MODEL_FILE))
    return np.concatenate([tensors[k].ravel() for k in sorted(tensors)])


def _consensus(tmp_path, **env: str) -> float:
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(4)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        nodes = [lab.start(f"n{i}", ports[i], [a for a in addrs if a != addrs[i]],
                           "--duration", "10", env=lab.env(**env)) for i in range(4)]
        for p in nodes:
            p.popen.wait(240)
        assert [p.popen.returncode for p in nodes] == [0] * 4, [p.output()[-2000:]
                                                              for p in nodes]
        stack = np.stack([_final_weights(p) for p in nodes]).astype(np.float64)
        return float(np.sqrt(np.mean((stack - stack.mean(axis=0)) ** 2)))


def test_gossip_keeps_replicas_closer_than_no_communication(tmp_path):
    together = _consensus(tmp_path / "gossip")
    apart = _consensus(tmp_path / "alone", P2PTRAIN_GOSSIP_FANOUT="0",
                       P2PTRAIN_GOSSIP_AVERAGE_EVERY="0")
    print(f"consensus distance: gossip {together:.5f}, no communication {apart:.5f}")
    assert together < apart


def test_a_node_with_only_the_token_adopts_the_swarm_configuration(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(2)
        first = lab.start("first", ports[0], [])
        wait_for("the first node", first.status, 60)
        second = lab.start("second", ports[1], [first.addr], config=False)
        adopted = wait_for("the configuration to be adopted",
                           lambda: [e for e in second.events()
                                    if e.get("event") == "config_adopted"], 60)
        assert adopted[0]["peer"] == first.addr
        start = wait_for("the second node to start", lambda: [
            e for e in second.events() if e.get("event") == "start"], 60)[0]
        assert start["model"] == "mlp"  # the swarm's model, not the default rwkv
        wait_for("both to know each other",
                 lambda: len(_alive_peers(first.status())) == 1
                 and len(_alive_peers(second.status())) == 1, 60)
        assert lab.stop_all() == [0, 0]


def test_a_node_nobody_can_reach_turns_outbound_only_and_still_trains(tmp_path):
    """It advertises an address where nothing listens (as behind NAT): its own requests
    succeed, nobody's reach it; it detects that, rejoins outbound-only, and trains."""
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(4)
        a = lab.start("a", ports[0], [f"127.0.0.1:{ports[1]}"])
        b = lab.start("b", ports[1], [a.addr])
        hidden = lab.start("hidden", ports[2], [a.addr], "--advertise",
                           f"127.0.0.1:{ports[3]}")  # nothing listens on ports[3]
        switched = wait_for("the hidden node to detect that nobody reaches it",
                            lambda: [e for e in hidden.events()
                                     if e.get("event") == "outbound_only"], 90)
        assert switched[0]["incarnation"] >= 2
        me = hidden.status()["node_id"]

        def seen_as_outbound_only(p) -> bool:
            row = next((m for m in p.status()["members"] if m["node_id"] == me), None)
            return row is not None and row["state"] == "alive" and row["outbound_only"]

        wait_for("the others to hold it alive and outbound-only",
                 lambda: seen_as_outbound_only(a) and seen_as_outbound_only(b), 60)

        def trains_with_peers() -> bool:
            doc = hidden.status()
            return (doc["outbound_only"] and not doc["is_leader"]
                    and any(m["gradients_used"] > 0 for m in doc["members"])
                    and doc["gossip"].get("average_applied", 0) > 0)

        wait_for("it to use peer gradients and average (all through its own requests)",
                 trains_with_peers, 60)
        assert lab.stop_all() == [0, 0, 0]


def test_a_node_that_cannot_keep_a_new_incarnation_stays_as_it_is_and_says_why(tmp_path):
    """The switch to outbound-only writes a new incarnation; on a disk gone read-only (here:
    the incarnation file made a directory after the start) it failed without a word, and
    the reachability check never ran again. Now it says so and trains on, reachable-only."""
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(3)
        a = lab.start("a", ports[0], [])
        hidden = lab.start("hidden", ports[1], [a.addr], "--advertise",
                           f"127.0.0.1:{ports[2]}")  # nothing listens on ports[2]
        wait_for("the hidden node to start", lambda: [
            e for e in hidden.events() if e.get("event") == "start"], 60)
        incarnation = hidden.state_dir / "incarnation"
        incarnation.unlink()
        incarnation.mkdir()  # load_or_create: "incarnation is not a regular file"
        failed = wait_for("the switch to fail", lambda: [
            e for e in hidden.events() if e.get("event") == "outbound_only_failed"], 90)
        assert "cannot go outbound-only" in failed[0]["message"], failed[0]
        assert not [e for e in hidden.events() if e.get("event") == "outbound_only"]
        step = hidden.status()["step"]
        wait_for("it to train on", lambda: hidden.status()["step"] > step + 2, 60)
        assert hidden.status()["outbound_only"] is False
        incarnation.rmdir()  # its last checkpoint is written at the stop
        assert lab.stop_all() == [0, 0]
