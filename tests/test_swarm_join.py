"""Joining a trained swarm for real (issue 13, items 1 and 4): `p2ptrain join` processes on
loopback. A fresh node adopts the leader's checkpoint before its first step; a node restarted
from an older checkpoint of its own adopts the newer one instead of keeping its stale weights;
partial downloads left by an earlier fetch are cleaned when the join is over."""

from __future__ import annotations

import signal

import pytest

from p2ptrain import checkpoint
from p2ptrain.net.fetch import PARTIAL_PREFIX
from p2ptrain.net.joinflow import FETCHED_DIR
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _join_reason(proc) -> str:
    starts = wait_for(f"{proc.addr} to start training",
                      lambda: [e for e in proc.events() if e.get("event") == "training_starts"],
                      90)
    return starts[-1]["reason"]


def _leader_samples(proc) -> int:
    done = [checkpoint.read_manifest(c).swarm_samples
            for c in checkpoint.list_checkpoints(proc.state_dir / "checkpoints")]
    return max(done, default=0)


def test_joiners_adopt_the_leaders_newer_checkpoint(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        first = [lab.start(f"n{i}", ports[i], [addrs[1 - i]]) for i in range(2)]
        leader_id = wait_for("one leader", lambda: (lambda s: len(s) == 1 and None not in s
                                                   and s.pop())(
            {p.status()["leader"] for p in first}), 60)
        lead = next(p for p in first if p.status()["node_id"] == leader_id)
        wait_for("a leader checkpoint with samples", lambda: _leader_samples(lead) > 500, 90)

        # a fresh node, with junk a broken earlier download left behind
        state = tmp_path / "n2"
        partial = state / FETCHED_DIR / f"{PARTIAL_PREFIX}t1-s1"
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_bytes(b"\0" * 1024)
        joiner = lab.start("n2", ports[2], [addrs[0]], state=state)
        reason = _join_reason(joiner)
        assert reason.startswith("weights from the leader's checkpoint"), reason
        assert not list((state / FETCHED_DIR).glob(f"{PARTIAL_PREFIX}*"))
        doc = joiner.status()
        assert doc["join"]["state"] == "done" and doc["swarm_samples"] > 500

        # it stops (its own final checkpoint), the swarm trains on, it comes back: it must
        # take the newer weights, not keep the stale replica it resumes from
        wait_for("the joiner to step", lambda: joiner.status()["step"] > 5, 60)
        lab.kill(joiner, signal.SIGTERM)
        assert joiner.popen.wait(60) == 0
        own = _leader_samples(joiner)
        assert own > 0, "the stopped node wrote its resume state"
        wait_for("the swarm to train well past the stopped node",
                 lambda: _leader_samples(lead) > own + 2000, 90)
        back = lab.start("n2-back", ports[2], [addrs[0]], state=state)
        reason = _join_reason(back)
        assert reason.startswith("weights from the leader's checkpoint"), reason
        assert back.status()["swarm_samples"] > own + 2000
        codes = lab.stop_all()
        assert all(c == 0 for c in codes[:2] + codes[3:]), codes


def test_a_networked_node_takes_exactly_the_steps_asked(tmp_path):
    with SwarmLab(tmp_path) as lab:
        node = lab.start("n0", free_ports(1)[0], [], "--steps", "2")
        assert node.popen.wait(90) == 0
        stopped = [e for e in node.events() if e.get("event") == "stopped"]
        assert stopped and stopped[-1]["step"] == 2, stopped
