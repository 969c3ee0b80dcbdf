"""A shard damaged or replaced under a running node (a corpus copied over during a run, a USB
disk that went away) stops it with one line that says so and exit code 2 -- after writing its
final checkpoint: the batch that could not be read never reached the weights. Alone, the node
used to exit without a final checkpoint (what it trained since its last one was lost); in a
swarm it said "training step failed: TokenDataError(...)" and exited 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain import checkpoint
from p2ptrain.data.prepare import prepare
from tests.helpers import REPO, cli_env
from tests.swarmlab import SwarmLab, free_ports, wait_for
from tests.test_tokens import bpe

pytestmark = [pytest.mark.processes]

TEXT = (REPO / "p2ptrain" / "data" / "tinyshakespeare.txt").read_text()[:200_000]


def corpus(tmp: Path) -> Path:
    (tmp / "text").mkdir()
    (tmp / "text" / "a.txt").write_text(TEXT)
    out = tmp / "corpus"
    prepare([tmp / "text"], bpe(tmp / "tok.json", TEXT, 300), out, progress=False,
            say=lambda _t: None)
    return out


def newest_step(state: Path) -> int:
    found = checkpoint.list_checkpoints(state / "checkpoints")
    return checkpoint.read_manifest(found[0]).step if found else -1


def damage(data: Path) -> None:
    """What copying a new corpus over the old one looks like halfway: the shard is short."""
    with open(data / "train-00000.bin", "r+b") as f:
        f.truncate(100)


def check(out: str, code: int, state: Path) -> None:
    assert code == 2, out[-3000:]
    assert "the data cannot be read" in out and "shorter than meta.json" in out, out[-3000:]
    assert "Traceback" not in out
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    final = [e for e in events if e.get("event") == "checkpoint" and e.get("final")]
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert final and stopped and final[-1]["step"] == stopped[-1]["step"] > 2, out[-3000:]
    assert newest_step(state) == stopped[-1]["step"]


def test_an_alone_run_whose_shard_is_damaged_keeps_its_steps_and_exits_2(tmp_path):
    data, state = corpus(tmp_path), tmp_path / "s"
    (tmp_path / "c.toml").write_text("[checkpoint]\nevery_steps = 2\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2ptrain", "join", "--alone", "--data", str(data), "--batch",
         "4", "--steps", "1000000", "--state-dir", str(state), "--config",
         str(tmp_path / "c.toml"), "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), cwd=REPO)
    try:
        wait_for("a checkpoint past step 2", lambda: newest_step(state) > 2, 120)
        damage(data)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    check(out, proc.returncode, state)


def test_a_swarm_node_whose_shard_is_damaged_keeps_its_steps_and_exits_2(tmp_path):
    data = corpus(tmp_path)
    with SwarmLab(tmp_path / "lab") as lab:
        (port,) = free_ports(1)
        env = lab.env(P2PTRAIN_NODE_MIN_PEERS="0", P2PTRAIN_CHECKPOINT_EVERY_STEPS="2")
        node = lab.start("a", port, [], "--data", str(data), "--batch", "4", env=env)
        wait_for("a checkpoint past step 2", lambda: newest_step(node.state_dir) > 2, 120)
        damage(data)
        wait_for("the node to stop", lambda: not node.alive(), 120)
        check(node.output(), node.popen.returncode, node.state_dir)
