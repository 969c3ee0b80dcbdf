"""Checkpoints from many holders across network namespaces (issue 14): three holders, each
shaped by `tc tbf` to the same upload rate, one fetcher. Each holder serves a fair share and
every byte verifies; a holder killed mid-fetch leaves the others to finish. The rates are a
benchmark (tests/bench/swarmfetch.py, docs/BENCHMARKS.md §13), not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.checkpoint import store
from p2ptrain.net.auth import derive_mac_key
from tests.bench.swarmfetch import REPO, Lab
from tests.netlab import NetLab, require_netns

pytestmark = [pytest.mark.netns, pytest.mark.processes, pytest.mark.slow]

RATE_MBIT = 40  # per holder
CHUNK = 256 * 1024


def verified(path: str, lab: Lab) -> bool:
    """The fetched weights hash right, chunk by chunk, against the leader's manifest."""
    got = store.read_manifest(Path(path), (store.MODEL_FILE,))
    return got == lab.manifest


def test_three_shaped_holders_each_serve_a_share_and_every_byte_verifies(tmp_path):
    require_netns()
    with NetLab(4, prefix="ckfs") as net:
        lab = Lab(net, tmp_path, size_mb=12, rate_mbit=RATE_MBIT, chunk=CHUNK)
        r = lab.fetch(lab.addrs, tmp_path / "out")
        shares = [r["served"].get(a, 0) / r["chunks"] for a in lab.addrs]
        print(f"{r['bytes'] / 1e6:.1f} MB from 3 holders at {RATE_MBIT} Mbit/s each in "
              f"{r['seconds']:.2f}s; shares {[round(s, 2) for s in shares]}")
        assert sum(r["served"].values()) == r["chunks"] and not r["dropped"]
        assert all(s >= 0.2 for s in shares), shares
        assert verified(r["path"], lab)


def test_the_leader_killed_mid_fetch_leaves_the_others_to_finish(tmp_path):
    require_netns()
    with NetLab(4, prefix="ckfk") as net:
        lab = Lab(net, tmp_path, size_mb=24, rate_mbit=RATE_MBIT / 2, chunk=CHUNK)
        out = tmp_path / "out"
        fetcher = net.popen(3, [sys.executable, "-m", "tests.bench.swarmfetch", "fetch",
                                "--out", str(out), "--key", derive_mac_key(lab.key).hex(),
                                "--leader", lab.manifest.leader, *lab.addrs],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
        progress = out / f".partial-{lab.manifest.id}" / "progress.json"
        deadline = time.monotonic() + 60
        while not progress.exists():  # chunks are arriving: kill the leader's process now
            assert time.monotonic() < deadline and fetcher.poll() is None, "no progress"
            time.sleep(0.05)
        lab.holders[0].kill()
        stdout, _ = fetcher.communicate(timeout=120)
        assert fetcher.returncode == 0
        r = json.loads(stdout.strip().splitlines()[-1])
        print(f"served {r['served']}, dropped {r['dropped']}")
        assert sum(r["served"].values()) == r["chunks"]
        assert r["served"][lab.addrs[0]] < r["chunks"] / 3
        assert verified(r["path"], lab)
