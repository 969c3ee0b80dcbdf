"""Three real nodes tracking each other (gossip.track_peers): each pushes the sign of its
replica minus its public copy to the two others over HTTP, follows their copies and mixes
toward them, as the protocol tests (test_tracking.py) and the simulator do."""

from __future__ import annotations

import pytest

from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = pytest.mark.slow

TOML = """\
[model]
name = "rwkv"
[model.rwkv]
n_layer = 2
n_embd = 64
ctx_len = 16
[train]
batch = 4
warmup_samples = 8
total_samples = 100000000
[eval]
windows = 8
every_seconds = 2
[net]
timing = "local"
[checkpoint]
every_seconds = 0
[gossip]
average_every = 0
track_peers = 2
track_warmup = 4
"""


def test_three_nodes_track_each_other_over_http(tmp_path):
    with SwarmLab(tmp_path, TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        nodes = [lab.start(f"n{i}", ports[i], [addrs[(i + 1) % 3]]) for i in range(3)]

        def tracking(p) -> bool:
            g = p.status()["gossip"]
            return g.get("track_mixes", 0) >= 10 and g.get("track_parts_applied", 0) >= 10

        wait_for("every node mixing toward copies it follows of the others",
                 lambda: all(tracking(p) for p in nodes), 180)
        docs = [p.status() for p in nodes]
        assert all(p.alive() for p in nodes)
    for d in docs:
        g = d["gossip"]
        print({k: v for k, v in g.items() if k.startswith("track")})
        assert g["track_pushes"] >= 10 and g.get("track_timeout", 0) == 0
        assert g["track_bytes_sent"] > 0
