"""Three real nodes sharing compressed pseudo-gradients (gossip.outer_every): every node takes
outer steps with its peers' progress, and what it sends per trained sample is at least 250x
less than one dense fp32 gradient per step (the least a dense gradient exchange sends)."""

from __future__ import annotations

import pytest

from p2ptrain.models.rwkv import RWKV, RWKVConfig
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = pytest.mark.slow

SHAPE = RWKVConfig(n_layer=2, n_embd=64, ctx_len=16)
BATCH = 4
TOML = f"""\
[model]
name = "rwkv"
[model.rwkv]
n_layer = {SHAPE.n_layer}
n_embd = {SHAPE.n_embd}
ctx_len = {SHAPE.ctx_len}
[train]
batch = {BATCH}
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
outer_every = 20
fanout = 1
codec = "topk"
fraction = 0.01
average_every = 0
"""


def test_three_nodes_share_pseudo_gradients_with_250x_fewer_bytes(tmp_path):
    with SwarmLab(tmp_path, TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        nodes = [lab.start(f"n{i}", ports[i], [addrs[(i + 1) % 3]]) for i in range(3)]

        def rounds(p) -> bool:
            doc = p.status()
            return (doc["gossip"].get("outer_steps", 0) >= 5
                    and sum(m["gradients_used"] for m in doc["members"]) >= 3)

        wait_for("5 outer steps on every node, with peers' progress",
                 lambda: all(rounds(p) for p in nodes), 180)
        docs = [p.status() for p in nodes]
        assert all(p.alive() for p in nodes)
    n = RWKV(SHAPE).space.n_params
    sent = sum(d["bytes_out"] for d in docs)
    samples = sum(d["samples"] for d in docs)
    dense = 4 * n / BATCH  # bytes per sample of one dense fp32 gradient per step
    ratio = dense / (sent / samples)
    print(f"outer steps: {[d['gossip']['outer_steps'] for d in docs]}; sent {sent:,} B for "
          f"{samples:,} samples: {sent / samples:,.0f} B/sample against {dense:,.0f} dense "
          f"fp32: {ratio:,.0f}x fewer")
    assert ratio >= 250
    assert all(d["eval_loss"] is not None for d in docs)
