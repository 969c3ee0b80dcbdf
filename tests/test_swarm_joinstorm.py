"""A join storm for real (issue 14): `p2ptrain join` processes on loopback. Two nodes join a
leader whose upload is capped at the same time; each fetches the leader's weights from the
leader and from the other joiner (which serves the chunks it has verified), so bytes flow
between the joiners, and both adopt the leader's checkpoint."""

from __future__ import annotations

import pytest

from p2ptrain import checkpoint
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

# an mlp of ~0.7M parameters: 2.8 MB of weights, 11 chunks of 256 KiB. The leader checkpoints
# every 30 s, not every 2 s: the joiners start right after its first checkpoint and must both
# fetch that one to trade chunks (a fetch started after the next checkpoint takes the newer
# one, and two fetches of different checkpoints share nothing -- that made this test flaky).
BIG_WEIGHTS_TOML = SMALL_SWARM_TOML.replace("n_hidden = 32", "n_hidden = 1536").replace(
    "n_embd = 8", "n_embd = 24").replace("[checkpoint]\nevery_seconds = 2",
                                         "[checkpoint]\nevery_seconds = 30")

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _leader_samples(proc) -> int:
    done = [checkpoint.read_manifest(c).swarm_samples
            for c in checkpoint.list_checkpoints(proc.state_dir / "checkpoints")]
    return max(done, default=0)


def _weights_bytes(proc) -> int:
    fetched = checkpoint.list_checkpoints(proc.state_dir / "fetched")
    return checkpoint.read_manifest(fetched[0], (checkpoint.MODEL_FILE,)).size(
        (checkpoint.MODEL_FILE,))


def test_joiners_fetch_from_each_other_as_well_as_from_the_leader(tmp_path):
    assert "every_seconds = 30" in BIG_WEIGHTS_TOML and "n_hidden = 1536" in BIG_WEIGHTS_TOML
    with SwarmLab(tmp_path, BIG_WEIGHTS_TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        # 2 Mbit/s: the weights take the leader ~13 s per joiner
        lead = lab.start("lead", ports[0], [], "--max-upload-mbps", "2")
        wait_for("a leader checkpoint with samples", lambda: _leader_samples(lead) > 300, 90)
        joiners = [lab.start(f"j{i}", ports[i], [addrs[0]]) for i in (1, 2)]
        for j in joiners:
            starts = wait_for(f"{j.addr} to start training", lambda j=j: [
                e for e in j.events() if e.get("event") == "training_starts"], 150)
            assert starts[-1]["reason"].startswith("weights from the leader's checkpoint"), \
                starts[-1]
        served = [j.status()["runtime"].get("served_bytes", 0) for j in joiners]
        lead_served = lead.status()["runtime"].get("served_bytes", 0)
        print(f"checkpoint bytes served: leader {lead_served:,}, joiners {served}")
        assert sum(served) > 0, "the joiners served each other nothing"
        assert lead_served < 2 * _weights_bytes(joiners[0])  # less than a copy per joiner
        held = [j.status()["holds"] for j in joiners]  # both hold (and serve) what they took
        assert held[0] is not None and held[0] == held[1], held
        codes = lab.stop_all()
        assert all(c == 0 for c in codes), codes
