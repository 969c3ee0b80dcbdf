"""A node given the wrong swarm key (through `--config`) does not train alone forever: when
every peer refuses it (HTTP 401) for `net.refused_seconds`, it says that the swarm key is
wrong and exits 2; the peer it knocked at goes on."""

from __future__ import annotations

import time

import pytest

from p2ptrain.swarm import new_swarm, write_init_files
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def test_a_node_with_the_wrong_key_says_so_and_exits_2(tmp_path):
    other = new_swarm("lab")  # same name, another key
    _, config = write_init_files(other, tmp_path / "wrong", SMALL_SWARM_TOML.replace(
        "[model]", '[swarm]\nname = "lab"\nkey_file = "swarm.key"\n\n[model]', 1))
    with SwarmLab(tmp_path / "lab") as lab:
        ports = free_ports(2)
        right = lab.start("right", ports[0], [])
        wait_for("the right node to answer", right.status, 60)
        env = {k: v for k, v in lab.env(P2PTRAIN_NET_REFUSED_SECONDS="4").items()
               if k != "P2PTRAIN_TOKEN"}
        started = time.monotonic()
        wrong = lab.start("wrong", ports[1], [right.addr], "--config", str(config),
                          config=False, env=env)
        code = wait_for("the wrong-key node to give up", wrong.popen.poll, 90)
        took = time.monotonic() - started
        out = wrong.output()
        assert code == 2, out[-3000:]
        assert "Traceback" not in out
        said = [e for e in wrong.events() if e.get("event") == "wrong_key"]
        assert len(said) == 1, out[-3000:]
        assert "swarm key" in said[0]["message"] and "wrong" in said[0]["message"]
        assert right.addr in said[0]["message"]
        assert took < 60, took
        assert right.alive() and right.status()["members"] == []
        assert lab.stop_all() == [0, 2]
