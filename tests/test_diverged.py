"""A run that diverges (here: a learning rate of 1e9) says so in one line and exits 1, alone
or in a swarm, and writes no checkpoint of the diverged weights: it used to end in a
traceback (alone), or write a final checkpoint whose held-out loss was NaN and crash in the
protocol -- and every later `join` on that state directory resumed it and crashed again."""

from __future__ import annotations

import json

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
        starts = [e for e in node.events() if e.get("event") == "training_starts"]
        # (it said training starts, then sat at step 0 for the join timeout, saying nothing)
        assert not starts or "training waits up to" in starts[0]["reason"], starts


def test_a_run_that_diverges_where_it_resumed_names_the_checkpoint_to_move(tmp_path):
    """A diverging run can write checkpoints of weights that are finite yet give a NaN
    gradient; a restart at a lower rate resumed them and diverged again, every time, with the
    hint to lower the rate. Now the second run says which checkpoint to move aside."""
    state, conf = tmp_path / "s", tmp_path / "c.toml"
    conf.write_text("[checkpoint]\nevery_steps = 1\n")
    common = ("join", "--alone", "--steps", "30", "--batch", "4", "--config", str(conf),
              "--state-dir", str(state))
    first = run_cli(*common, "--lr", "1e6")
    assert first.returncode == 1 and "training diverged" in first.stderr + first.stdout
    resumed = newest_step(state)
    assert resumed > 0, first.stdout + first.stderr  # a step of 1e6, written, then NaN
    again = run_cli(*common, "--lr", "1e-3")
    out = again.stdout + again.stderr
    assert again.returncode == 1 and "training diverged" in out, out
    assert f"resumed at step {resumed}" in out and "move it out of the checkpoints" in out, out


def test_an_alone_run_does_not_write_its_last_step_twice(tmp_path):
    """--steps a multiple of checkpoint.every_steps wrote the last step's checkpoint, then the
    same again as the final one (at 1B, ~12 GB of writes for nothing, and room for a second
    copy: a full disk then said steps were lost when none were)."""
    conf = tmp_path / "c.toml"
    conf.write_text("[checkpoint]\nevery_steps = 5\n")
    r = run_cli("join", "--alone", "--steps", "10", "--batch", "4", "--config", str(conf),
                "--state-dir", str(tmp_path / "s"), "--log-format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    written = [e["step"] for e in events if e.get("event") == "checkpoint"]
    final = [e for e in events if e.get("event") == "checkpoint" and e.get("final")]
    assert written == [5, 10, 10] and len(final) == 1 and final[0]["step"] == 10, written
    assert "the final one" in final[0]["message"]
    assert [c.name[-4:] for c in checkpoint.list_checkpoints(tmp_path / "s" / "checkpoints")
            ] == ["0010", "0005"]


def test_a_token_without_peers_or_mdns_says_there_is_nobody_to_ask(tmp_path):
    """A node given a token but no --peer and mDNS off said "no member of swarm answered
    within 10s" a millisecond after "fetching the configuration": it had asked nobody."""
    with SwarmLab(tmp_path / "lab") as lab:
        (port,) = free_ports(1)
        node = lab.start("a", port, [], "--duration", "1", config=False,
                         env=lab.env(P2PTRAIN_NODE_MIN_PEERS="0"))
        wait_for("the node to stop", lambda: node.popen.poll() is not None, 90)
        out = node.output()
        assert node.popen.returncode == 0, out[-2000:]
        assert "no --peer and mDNS off" in out and "answered within" not in out, out[-2000:]
