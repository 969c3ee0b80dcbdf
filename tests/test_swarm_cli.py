"""The networked subcommands as a user runs them: init, join --config from init's files,
status (table and JSON), and the end of a run at train.total_samples."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from p2ptrain import checkpoint
from p2ptrain.swarm import parse_token
from tests.helpers import cli_env, run_cli
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def test_init_writes_a_private_key_a_config_and_prints_the_token(tmp_path):
    out = tmp_path / "fleet"
    r = run_cli("init", "--name", "fleet", "--out", str(out), "--model", "mlp")
    assert r.returncode == 0, r.stderr
    token = next(w for w in r.stdout.split() if w.startswith("p2pt1."))
    swarm = parse_token(token)
    assert swarm.name == "fleet"
    assert (out / "swarm.key").read_bytes() == swarm.key
    assert stat.S_IMODE(os.stat(out / "swarm.key").st_mode) == 0o600
    assert f"p2ptrain join --token {token}" in r.stdout
    text = (out / "swarm.toml").read_text()
    assert 'name = "fleet"' in text and 'key_file = "swarm.key"' in text
    assert 'name = "mlp"' in text  # the swarm-wide options start from the flags given
    again = run_cli("init", "--name", "fleet", "--out", str(out))
    assert again.returncode == 2 and "already holds a swarm" in again.stderr
    assert (out / "swarm.key").read_bytes() == swarm.key
    # the written configuration is accepted as it is
    shown = run_cli("config", "show", "--config", str(out / "swarm.toml"))
    assert shown.returncode == 0, shown.stderr


def test_join_with_inits_config_and_status_shows_the_swarm(tmp_path):
    out = tmp_path / "fleet"
    assert run_cli("init", "--name", "fleet", "--out", str(out)).returncode == 0
    config = out / "small.toml"  # init's key, with a small model as a user would choose
    config.write_text('[swarm]\nname = "fleet"\nkey_file = "swarm.key"\n' + SMALL_SWARM_TOML)
    with SwarmLab(tmp_path / "lab") as lab:
        ports = free_ports(2)
        env = {k: v for k, v in lab.env().items() if k != "P2PTRAIN_TOKEN"}
        a = lab.start("a", ports[0], [f"127.0.0.1:{ports[1]}"], "--config", str(config),
                      config=False, env=env)
        b = lab.start("b", ports[1], [a.addr], "--config", str(config), config=False, env=env)
        wait_for("both to train together", lambda: all(
            p.status()["step"] > 5 and len(p.status()["members"]) == 1 for p in (a, b)), 90)
        wait_for("a leader both follow", lambda: a.status()["leader"] and
                 a.status()["leader"] == b.status()["leader"], 60)
        r = run_cli("status", "--peer", a.addr, env=cli_env())
        assert r.returncode == 0, r.stderr
        assert "swarm 'fleet'" in r.stdout and b.status()["node_id"][:12] in r.stdout
        # one row a node: this one starred, the leader marked, every class and loss shown
        rows = [re.match(r"([0-9a-f]{12})(\*?)( L)?\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)",
                         line) for line in r.stdout.splitlines()[1:]]
        rows = [m.groups() for m in rows if m]
        assert len(rows) == 2 and [row[1] for row in rows] == ["*", ""], r.stdout
        assert sum(row[2] == " L" for row in rows) == 1, r.stdout
        assert all(row[4] != "-" and float(row[7]) > 0 for row in rows), r.stdout
        doc = json.loads(run_cli("status", "--peer", a.addr, "--json").stdout)
        assert doc["swarm"] == "fleet" and doc["members"][0]["node_id"] == \
            b.status()["node_id"]
        assert lab.stop_all() == [0, 0]
    nobody = run_cli("status", "--peer", f"127.0.0.1:{ports[0]}")
    assert nobody.returncode == 2 and nobody.stderr == (  # plain words, not aiohttp's
        f"p2ptrain: error: nothing listens at 127.0.0.1:{ports[0]} (connection refused); "
        "is `p2ptrain join` running there?\n"), nobody.stderr


def test_the_run_ends_for_everyone_at_total_samples_with_a_final_checkpoint(tmp_path):
    config = SMALL_SWARM_TOML.replace("total_samples = 100000000", "total_samples = 6000")
    with SwarmLab(tmp_path, config) as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [f"127.0.0.1:{ports[1]}"])
        b = lab.start("b", ports[1], [a.addr])
        for p in (a, b):
            assert p.popen.wait(180) == 0, p.output()[-3000:]
        stopped = [next(e for e in p.events() if e.get("event") == "stopped") for p in (a, b)]
        assert all("total_samples" in e["reason"] for e in stopped), stopped
        finals = {p: [e for e in p.events() if e.get("event") == "checkpoint" and e.get("final")]
                  for p in (a, b)}
        assert finals[a] or finals[b]
        # the leader wrote the run's final checkpoint: as the leader ("leader, final") or, when
        # the run ended as it took the lead (this small model's nodes may train the whole run
        # alone while a fresh swarm waits a lease for its leader), on stopping
        led = [p for p in (a, b) if any(e.get("event") == "leader" and
                                        e["message"].startswith("leading") for e in p.events())]
        assert led and finals[led[-1]], finals
        manifest = checkpoint.read_manifest(checkpoint.list_checkpoints(
            led[-1].state_dir / "checkpoints")[0])
        assert manifest.swarm_samples >= 6000
