"""A run that diverges (here: a learning rate of 1e9) says so in one line and exits 1, alone
or in a swarm, and writes no checkpoint of the diverged weights: it used to end in a
traceback (alone), or write a final checkpoint whose held-out loss was NaN and crash in the
protocol -- and every later `join` on that state directory resumed it and crashed again."""

from __future__ import annotations

import pytest

from p2ptrain import checkpoint
from tests.helpers import run_cli
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes]


def newest_step(state) -> int:
    found = checkpoint.list_checkpoints(state / "checkpoints")
    return checkpoint.read_manifest(found[0]).step if found else -1


# 1e9: the loss goes NaN; 1e4: the weights blow up to ~1e10 with every value finite, and the
# gradient's float32 norm overflows (it crashed in the mixer: "internal error", a final
# checkpoint of the blown-up weights, and every later join on that state dir crashed again)
RATES = ["1e9", "1e4"]


@pytest.mark.parametrize("lr", RATES)
def test_a_diverged_alone_run_says_so_and_exits_1(tmp_path, lr):
    r = run_cli("join", "--alone", "--steps", "30", "--batch", "4", "--lr", lr,
                "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "training diverged" in out and "--lr" in out and "Traceback" not in out
    assert "RuntimeWarning" not in out  # numpy's a dozen lines each, before the one line
    assert newest_step(tmp_path / "s") <= 0  # nothing past the divergence


@pytest.mark.parametrize("lr", RATES)
def test_a_diverged_swarm_node_says_so_exits_1_and_leaves_no_poisoned_checkpoint(tmp_path, lr):
    with SwarmLab(tmp_path / "lab") as lab:
        (port,) = free_ports(1)
        env = lab.env(P2PTRAIN_NODE_MIN_PEERS="0", P2PTRAIN_EVAL_EVERY_SECONDS="1")
        node = lab.start("a", port, [], "--lr", lr, "--batch", "4", "--steps", "400",
                         env=env)
        wait_for("the node to stop", lambda: not node.alive(), 120)
        out = node.output()
        assert node.popen.returncode == 1, out[-2000:]
        assert "training diverged" in out and "Traceback" not in out
        diverged_at = max(e.get("step", 0) for e in node.events()
                          if e.get("event") == "stopping")
        assert newest_step(node.state_dir) < max(diverged_at, 1)


def test_a_duration_shorter_than_the_join_still_ends_the_run(tmp_path):
    """--duration ran out while the node waited for its first peer (join_timeout 5 s here):
    the first step was held, none ever ended to notice the limit, and the node sat idle."""
    with SwarmLab(tmp_path / "lab") as lab:
        (port,) = free_ports(1)
        node = lab.start("a", port, [], "--duration", "2")
        wait_for("the node to stop", lambda: node.popen.poll() is not None, 90)
        out = node.output()
        assert node.popen.returncode == 0, out[-2000:]
        assert "--duration" in out and "stopping" in out
        assert "finds no peer itself" in out  # mDNS off, no --peer: said at the start
