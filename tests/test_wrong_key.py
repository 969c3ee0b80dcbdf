"""A node given the wrong swarm key (through `--config`) does not train alone forever: when
every peer refuses it (HTTP 401) for `net.refused_seconds`, it says that the swarm key is
wrong and exits 2; the peer it knocked at goes on. A host without the key that copies the
swarm's mDNS advertisement and refuses everything cannot make a lone node say so: its
refusals prove nothing about our key."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from aiohttp import web

from p2ptrain.net.discovery import Discovery
from p2ptrain.net.refusals import MIN_REFUSALS
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


async def _refuse_everything(lab: SwarmLab, node, port: int, window: float) -> list[float]:
    """A keyless host on loopback: advertises the swarm's id over mDNS and answers 401 (no
    MAC) to every request, until the node has been refused for `window` s and
    MIN_REFUSALS + 2 times (or the node exits); the times of the requests."""
    seen: list[float] = []

    async def refuse(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        return web.json_response({"error": "request MAC does not verify"}, status=401)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    fake = Discovery(swarm_id=lab.swarm.swarm_id, node_id=secrets.token_hex(16), port=port,
                     addresses=["127.0.0.1"], device_class="server", on_found=lambda a, n: None,
                     interfaces=["127.0.0.1"])
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await fake.start()
        end = time.monotonic() + 120
        while not (len(seen) >= MIN_REFUSALS + 2 and seen[-1] - seen[0] > window + 2):
            if not node.alive() or time.monotonic() > end:
                break
            await asyncio.sleep(0.1)  # polling a condition with a deadline
    finally:
        await fake.close()
        await runner.cleanup()
    return seen


def test_a_keyless_host_copying_the_advertisement_cannot_end_a_lone_node(tmp_path):
    with SwarmLab(tmp_path / "lab") as lab:
        node_port, fake_port = free_ports(2)
        env = lab.env(P2PTRAIN_NET_REFUSED_SECONDS="2", P2PTRAIN_NET_MDNS="true")
        node = lab.start("lone", node_port, [], env=env)
        wait_for("the lone node to answer", node.status, 60)
        seen = asyncio.run(_refuse_everything(lab, node, fake_port, 2.0))
        out = node.output()
        assert node.alive(), out[-3000:]
        assert len(seen) >= MIN_REFUSALS + 2 and seen[-1] - seen[0] > 4.0, (seen, out[-3000:])
        events = node.events()
        assert not [e for e in events if e.get("event") == "wrong_key"]
        said = [e for e in events if e.get("event") == "refused"]
        assert said and "proves nothing about our key" in said[0]["message"], out[-3000:]
        assert f"127.0.0.1:{fake_port}" in said[0]["message"]
        assert lab.stop_all() == [0]
