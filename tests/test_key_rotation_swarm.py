"""Shutting a member out by rotating the swarm key, on a live fleet (real processes on
loopback, a fresh key, never the demo swarm).

Three nodes A, B, C run on key K1, each from its own copy of the swarm's files. The operator
runs `p2ptrain key rotate` (K2, K1 kept as the previous key, a short grace) and restarts A,
then B, with the new files, one at a time: training and membership go on (one leader, the
swarm's sample count keeps growing, everyone sees everyone while the grace lasts). When the
grace is over on A and B, C (still on K1) is refused by both, says its swarm key is wrong
(the peers say it was rotated) and exits 2; A and B train on together.
"""

from __future__ import annotations

import shutil
import signal

import pytest

from p2ptrain.swarm import write_init_files
from tests.helpers import run_cli
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]

GRACE = 20.0  # s of each restarted node's running time; covers restarting the other node


def _alive(doc: dict) -> set[str]:
    return {m["node_id"] for m in doc["members"] if m["state"] == "alive"}


def _events(proc, name: str) -> list[dict]:
    return [e for e in proc.events() if e.get("event") == name]


def test_rotating_the_key_shuts_out_a_member_while_training_goes_on(tmp_path):
    with SwarmLab(tmp_path / "lab") as lab:
        ops = tmp_path / "swarm-lab"  # the operator's files, as `init` wrote them
        _, config = write_init_files(lab.swarm, ops, SMALL_SWARM_TOML.replace(
            "[model]", '[swarm]\nname = "lab"\nkey_file = "swarm.key"\n\n[model]', 1))
        c_files = tmp_path / "c-files"  # C's own copy, made before the rotation
        shutil.copytree(ops, c_files)
        env = {k: v for k, v in lab.env(P2PTRAIN_NET_REFUSED_SECONDS="4").items()
               if k != "P2PTRAIN_TOKEN"}
        ports = dict(zip("abc", free_ports(3), strict=True))
        addrs = {n: f"127.0.0.1:{p}" for n, p in ports.items()}

        def start(name: str, cfg, state=None):
            peers = [addrs[o] for o in "abc" if o != name]
            return lab.start(name, ports[name], peers, "--config", str(cfg), config=False,
                             env=env, state=state)

        nodes = {"a": start("a", config), "b": start("b", config),
                 "c": start("c", c_files / "swarm.toml")}
        ids = wait_for("every node to answer",
                       lambda: {n: p.status()["node_id"] for n, p in nodes.items()}, 60)
        samples: list[int] = []

        def together(names: str) -> bool:
            docs = {n: nodes[n].status() for n in names}
            samples.append(max(d["swarm_samples"] for d in docs.values()))
            leaders = {d["leader"] for d in docs.values()}
            return (all(_alive(docs[n]) >= {ids[o] for o in names if o != n} for n in names)
                    and len(leaders) == 1 and None not in leaders
                    and sum(d["is_leader"] for d in docs.values()) == 1)

        wait_for("A, B and C to know each other and follow one leader",
                 lambda: together("abc"), 60)
        before = samples[-1]

        r = run_cli("key", "rotate", "--config", str(config), "--grace", f"{GRACE:g}")
        assert r.returncode == 0, r.stderr
        print(r.stdout)
        assert "new join token" in r.stdout and (ops / "swarm.previous.key").exists()

        for name in "ab":  # one at a time, with the new key and the previous one
            lab.kill(nodes[name], signal.SIGTERM)
            assert nodes[name].popen.wait(30) == 0
            nodes[name] = start(name, config, state=nodes[name].state_dir)
            wait_for(f"{name.upper()} back, with A, B and C knowing each other and one leader",
                     lambda: together("abc"), 60)
            grace = _events(nodes[name], "key_grace")
            assert len(grace) == 1 and grace[0]["grace_left_s"] == pytest.approx(GRACE, abs=1)
        # still within A's grace: C was in the swarm throughout
        assert not _events(nodes["a"], "key_retired"), "the grace ran out during the restarts"
        assert samples[-1] > before
        assert nodes["c"].alive()

        code = wait_for("C, still on the old key, to be shut out and exit",
                        nodes["c"].popen.poll, 2 * GRACE + 60)
        out = nodes["c"].output()
        assert code == 2, out[-3000:]
        said = _events(nodes["c"], "wrong_key")
        assert len(said) == 1 and "swarm key is wrong" in said[0]["message"], out[-3000:]
        assert "rotated" in said[0]["message"]
        for name in "ab":
            assert len(_events(nodes[name], "key_retired")) == 1
        after_c = samples[-1]
        wait_for("A and B to train on together with one leader",
                 lambda: together("ab") and samples[-1] > after_c, 60)
        assert all(n.alive() for n in (nodes["a"], nodes["b"]))
        assert lab.stop_all()[-2:] == [0, 0]
