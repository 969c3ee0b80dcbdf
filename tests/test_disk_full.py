"""A full disk, for real: a small tmpfs mounted by the test (root needed; skipped elsewhere,
a failure under CI=true), filled to the last byte, holding the node's state directory.

A node that starts there (networked, alone in its swarm, so it becomes the leader; or the
alone loop) says "no space left" in one line per failed write -- no traceback -- keeps
stepping, retries, and writes its checkpoint once space is freed (a node whose final
checkpoint cannot be written exits 1). A node with no identity
yet cannot make one there and exits 2 with one line."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from p2ptrain import checkpoint
from p2ptrain.identity import load_or_create
from tests.helpers import REPO, run_cli
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _need_root_and_mount() -> None:
    missing = ("not root" if os.geteuid() != 0 else
               "no mount command" if shutil.which("mount") is None else None)
    if missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but cannot mount a tmpfs: {missing}")
    pytest.skip(f"mounting a small tmpfs needs root and mount: {missing}")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, unmounted at the end even when the test fails."""
    _need_root_and_mount()
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs",
                        str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"mount -t tmpfs failed: {r.stderr.strip()}")
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk) -> None:
    """Write zeros until the file system refuses another byte."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for size in (65536, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    assert os.statvfs(disk).f_bavail == 0


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text, text[-4000:]


def test_a_node_without_an_identity_on_a_full_disk_exits_2_in_one_line(small_disk):
    fill(small_disk)
    r = run_cli("join", "--state-dir", str(small_disk / "fresh"), "--model", "mlp",
                "--steps", "1", timeout=120)
    _no_traceback(r.stdout + r.stderr)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "no space left" in lines[0].lower() and str(small_disk / "fresh") in lines[0]


def test_a_leader_on_a_full_disk_keeps_training_and_checkpoints_once_space_is_freed(
        tmp_path, small_disk):
    state = small_disk / "state"
    load_or_create(state)  # the node has an identity from an earlier life
    fill(small_disk)
    with SwarmLab(tmp_path / "lab") as lab:
        node = lab.start("node", free_ports(1)[0], [], state=state)
        wait_for("it to lead", lambda: [e for e in node.events() if e.get("event") == "leader"
                                        and e.get("leader")], 60)
        failed = wait_for("a checkpoint to fail", lambda: [
            e for e in node.events() if e.get("event") == "checkpoint_failed"], 60)
        assert "no space left" in failed[0]["message"].lower(), failed[0]
        assert failed[0]["reason"] == "new leader", failed[0]  # not lost with the term file
        assert [e for e in node.events() if e.get("event") == "term_not_recorded"]
        step = node.status()["step"]
        wait_for("it to keep stepping", lambda: node.status()["step"] > step + 20, 60)
        wait_for("the write to be retried (and fail again)", lambda: len(
            [e for e in node.events() if e.get("event") == "checkpoint_failed"]) >= 2, 60)
        assert checkpoint.list_checkpoints(state / "checkpoints") == []
        _no_traceback(node.output())
        for line in node.output().splitlines():
            assert line.startswith("{"), line  # every line is one JSON event
        (small_disk / "filler").unlink()
        written = wait_for("a checkpoint once space is freed", lambda: [
            e for e in node.events() if e.get("event") == "checkpoint"], 60)
        path = checkpoint.list_checkpoints(state / "checkpoints")[0]
        manifest = checkpoint.read_manifest(path)
        assert manifest.step >= step and written[0]["path"].startswith(str(state))
        assert node.alive()
        assert lab.stop_all() == [0]
        _no_traceback(node.output())


def test_a_networked_node_whose_final_checkpoint_fails_exits_1(tmp_path, small_disk):
    """As the alone loop does: it warned and exited 0, so a script could not tell that what
    it trained since its last checkpoint was lost."""
    state = small_disk / "state"
    load_or_create(state)
    fill(small_disk)
    with SwarmLab(tmp_path / "lab") as lab:
        node = lab.start("node", free_ports(1)[0], [], state=state)
        wait_for("a few steps", lambda: node.status()["step"] >= 5, 60)
        assert lab.stop_all() == [1]
        lost = [e for e in node.events() if e.get("event") == "final_checkpoint_lost"]
        assert lost and "are lost" in lost[0]["message"], node.output()[-2000:]
        _no_traceback(node.output())


def test_the_alone_loop_on_a_full_disk_keeps_training(tmp_path, small_disk):
    state = small_disk / "state"
    load_or_create(state)
    fill(small_disk)
    config = tmp_path / "small.toml"
    config.write_text(SMALL_SWARM_TOML.replace("every_seconds = 2", "every_seconds = 0\n"
                                               "every_steps = 10"))
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--alone", "--config",
                        str(config), "--state-dir", str(state), "--steps", "40",
                        "--log-format", "json"], capture_output=True, text=True, cwd=REPO,
                       timeout=180, env={**{k: v for k, v in os.environ.items()
                                            if not k.startswith("P2PTRAIN_")},
                                         "OPENBLAS_NUM_THREADS": "1"})
    _no_traceback(r.stdout + r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines and all(line.startswith("{") for line in lines), lines
    assert any("no space left" in line.lower() for line in lines)
    assert '"step": 40' in r.stdout.splitlines()[-1]
    # all 40 steps trained, none saved: the exit says so, not 0
    assert r.returncode == 1, r.stderr[-3000:]
    assert '"event": "final_checkpoint_lost"' in lines[-1] and "start" in lines[-1], lines[-1]


def test_a_disk_that_holds_keep_checkpoints_but_not_one_more_still_takes_the_next(small_disk):
    """The write prunes only after it succeeded: with `keep` checkpoints there and room for
    no more, every write failed for the rest of the run. The oldest, which the write would
    prune anyway, goes first now; with fewer than `keep` there nothing is given up."""
    import numpy as np

    from p2ptrain.params import ParamSpace

    space = ParamSpace([("w", (180_000,))])  # 0.7 MB of weights, as much of moments
    params = np.random.default_rng(0).normal(size=space.size).astype(np.float32)
    ident = load_or_create(small_disk / "state")
    root = small_disk / "state" / "checkpoints"

    def snap(step):
        return checkpoint.Snapshot(step=step, term=0, swarm_count={"n": step}, fingerprint="fp",
                                   arch={"model": "test"}, model_tensors=[("w", params)],
                                   state_tensors=[("adam.m", params)], state_meta={"step": step})

    for step in (1, 2):
        checkpoint.save(root, snap(step), ident, keep=2)
    with pytest.raises(OSError):  # keep 3: the two there are kept, no room for a third
        checkpoint.save(root, snap(3), ident, keep=3)
    assert [p.name[-2:] for p in checkpoint.list_checkpoints(root)] == ["02", "01"]
    checkpoint.save(root, snap(3), ident, keep=2)  # keep 2: the oldest goes first
    assert [p.name[-2:] for p in checkpoint.list_checkpoints(root)] == ["03", "02"]
    assert checkpoint.find_latest(root, "fp").manifest.step == 3
    shutil.rmtree(checkpoint.list_checkpoints(root)[1])
    fill(small_disk)  # one checkpoint there, keep 1, no room: the newest never goes (a review)
    with pytest.raises(OSError):
        checkpoint.save(root, snap(4), ident, keep=1)
    assert [p.name[-2:] for p in checkpoint.list_checkpoints(root)] == ["03"]
