"""One process per state directory: a second `join` (networked or alone) on a directory a
running node holds exits 2 with one line naming the directory and the holder's pid, and
`checkpoint fetch --out` into that node's checkpoints does the same; the lock goes with the
process that held it."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _one_line_refusal(r, state, pid: int) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr + r.stdout
    assert len(lines) == 1, lines
    assert str(state) in lines[0] and f"pid {pid}" in lines[0], lines[0]


def test_a_second_process_on_a_held_state_directory_exits_2(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(3)
        first = lab.start("first", ports[0], [])
        wait_for("the first node to answer", first.status, 60)
        state = first.state_dir
        pid = first.popen.pid
        # the networked node, the alone loop, and a fetch into its checkpoints all refuse
        env = lab.env(P2PTRAIN_LOG_FORMAT="text")
        args = ["--state-dir", str(state), "--config", str(lab.config), "--bind", "127.0.0.1"]
        second = run_cli("join", *args, "--port", str(ports[1]), env=env, timeout=120)
        _one_line_refusal(second, state, pid)
        alone = run_cli("join", *args, "--alone", env=env, timeout=120)
        _one_line_refusal(alone, state, pid)
        fetch = run_cli("checkpoint", "fetch", "--peer", first.addr, "--timeout", "5",
                        "--out", str(state / "checkpoints"), "--token", lab.swarm.token(),
                        env=env, timeout=120)
        _one_line_refusal(fetch, state, pid)
        assert first.alive() and first.status()["node_id"]
        assert lab.stop_all() == [0]
        # the lock went with its process: the directory is usable again
        again = run_cli("join", *args, "--alone", "--steps", "2", env=env, timeout=120)
        assert again.returncode == 0, again.stderr
