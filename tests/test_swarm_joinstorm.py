"""A join storm for real (issue 14): `p2ptrain join` processes on loopback. Two nodes join a
leader whose upload is capped at the same time; each fetches the leader's weights from the
leader and from the other joiner (which serves the chunks it has verified), so bytes flow
between the joiners, and both adopt the leader's checkpoint."""

from __future__ import annotations

import pytest

from p2ptrain import checkpoint
from p2ptrain.checkpoint.manifest import checkpoint_name
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


# The leader checkpoints every 3 s and keeps 20 (a minute): a joiner that starts after a newer
# checkpoint than the one an earlier joiner is fetching can still have the earlier one.
STAGGERED_TOML = BIG_WEIGHTS_TOML.replace("[checkpoint]\nevery_seconds = 30",
                                          "[checkpoint]\nevery_seconds = 3\nkeep = 20")


def _fetched(proc) -> str:
    return checkpoint.list_checkpoints(proc.state_dir / "fetched")[0].name


def test_a_later_joiner_takes_the_checkpoint_the_earlier_one_is_fetching(tmp_path):
    """The leader wrote a newer checkpoint after the first joiner began fetching: the second
    joiner asks for the one the first is on (the most holders: joining.swarm_choice) and the
    two trade chunks, instead of splitting into two fetches that share nothing."""
    assert "every_seconds = 3\nkeep = 20" in STAGGERED_TOML
    with SwarmLab(tmp_path, STAGGERED_TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        lead = lab.start("lead", ports[0], [], "--max-upload-mbps", "2")
        wait_for("a leader checkpoint with samples", lambda: _leader_samples(lead) > 300, 90)
        first = lab.start("j1", ports[1], [addrs[0]])
        held = wait_for("the first joiner to hold part of a checkpoint",
                        lambda: first.status().get("holds"), 120)
        newest = lambda: max(checkpoint.read_manifest(c).step  # noqa: E731
                             for c in checkpoint.list_checkpoints(lead.state_dir / "checkpoints"))
        wait_for("a newer leader checkpoint", lambda: newest() > held["step"], 60)
        second = lab.start("j2", ports[2], [addrs[0]])
        for j in (first, second):
            starts = wait_for(f"{j.addr} to start training", lambda j=j: [
                e for e in j.events() if e.get("event") == "training_starts"], 150)
            assert starts[-1]["reason"].startswith("weights from the leader's checkpoint")
        assert _fetched(second) == _fetched(first) == checkpoint_name(held["term"],
                                                                      held["step"])
        served = [j.status()["runtime"].get("served_bytes", 0) for j in (first, second)]
        print(f"joiners fetched {_fetched(first)}, {_fetched(second)}; served {served}")
        assert served[0] > 0, "the first joiner served the second nothing"
        codes = lab.stop_all()
        assert all(c == 0 for c in codes), codes
