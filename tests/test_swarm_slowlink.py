"""A stable leader on a slow uplink with no manual setting (issue 13, item 3): three real
nodes of the default model, each capped at 0.8 Mbit/s, default timing. Averaging snapshots
take seconds to upload; control messages have their own lane in the pacer and the followers'
lease stretches to the gaps they hear, so the first leader stays."""

from __future__ import annotations

import time

import pytest

from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]

DEFAULT_MODEL_TOML = """\
[train]
batch = 8
[eval]
every_seconds = 0
[checkpoint]
every_seconds = 10
"""


def test_three_capped_nodes_keep_one_leader(tmp_path):
    with SwarmLab(tmp_path, config_text=DEFAULT_MODEL_TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        nodes = [lab.start(f"n{i}", ports[i], [a for a in addrs if a != addrs[i]],
                           "--max-upload-mbps", "0.8") for i in range(3)]
        first = wait_for("one leader everyone follows", lambda: (
            lambda s: len(s) == 1 and None not in s and s.pop())(
            {p.status()["leader"] for p in nodes}), 90)
        wait_for("averaging to run", lambda: all(
            p.status()["gossip"].get("average_answered", 0) > 0 for p in nodes), 90)
        # read once averaging runs: two nodes claiming at once at the start settle with the
        # winner a term up, under the same leader
        term = max(p.status()["term"] for p in nodes)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            docs = [p.status() for p in nodes]
            assert {d["leader"] for d in docs} <= {first, None}, docs[0]["leader"]
            assert max(d["term"] for d in docs) == term
            time.sleep(1.0)  # sampling the status once a second: not waiting for a state
        uploaded = [p.status()["upload_bytes"] for p in nodes]
        assert min(uploaded) > 100_000  # the uplinks were really busy
        assert all(c == 0 for c in lab.stop_all())
