"""Three real nodes in LoRA mode on one base: they train, average and checkpoint the adapters
only, and an averaging exchange carries the adapters' share of the full model's bytes (the
same swarm of full models measured beside it)."""

from __future__ import annotations

import pytest

from p2ptrain import checkpoint
from p2ptrain.checkpoint.safetensors_io import read_header
from p2ptrain.lora.basefile import base_from_init
from p2ptrain.lora.setup import lora_model
from p2ptrain.models.lora import LoRAConfig
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = pytest.mark.slow

SHAPE = RWKVConfig(n_layer=2, n_embd=64, ctx_len=16)
RANK = 4
TOML = f"""\
[model]
name = "rwkv"
[model.rwkv]
n_layer = {SHAPE.n_layer}
n_embd = {SHAPE.n_embd}
ctx_len = {SHAPE.ctx_len}
[train]
batch = 4
warmup_samples = 8
total_samples = 100000000
[lora]
rank = {RANK}
[eval]
windows = 8
every_seconds = 2
[net]
timing = "local"
[checkpoint]
every_seconds = 2
[gossip]
average_every = 2
"""


def run_swarm(tmp, *args) -> tuple[float, list[dict], list]:
    """Three nodes until each has averaged a few times and the leader has checkpointed: the
    mean snapshot bytes of one averaging request, the nodes' status, the leader's checkpoints."""
    with SwarmLab(tmp, TOML) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        nodes = [lab.start(f"n{i}", ports[i], [addrs[(i + 1) % 3]], *args) for i in range(3)]

        def averaged(p) -> bool:
            g = p.status()["gossip"]
            return g.get("average_applied", 0) >= 3 and g.get("average_parts_sent", 0) >= 3

        wait_for("every node to average 3 times", lambda: all(averaged(p) for p in nodes), 180)
        leader = wait_for("a leader", lambda: nodes[0].status()["leader"], 60)
        lead = next(p for p in nodes if p.status()["node_id"] == leader)
        ckpts = wait_for("a checkpoint by the leader", lambda: checkpoint.list_checkpoints(
            lead.state_dir / "checkpoints"), 60)
        docs = [p.status() for p in nodes]
        assert all(p.alive() for p in nodes), [p.output()[-2000:] for p in nodes]
    sent = sum(d["gossip"]["average_bytes_sent"] for d in docs)
    parts = sum(d["gossip"]["average_parts_sent"] for d in docs)
    return sent / parts, docs, ckpts


def test_lora_swarm_averages_adapters_only(tmp_path):
    base = base_from_init(SHAPE, 7, tmp_path / "bases")
    model = lora_model(base, LoRAConfig(rank=RANK), SHAPE.ctx_len, SHAPE.wkv_chunk)
    lora_bytes, docs, ckpts = run_swarm(tmp_path / "lora", "--mode", "lora", "--base",
                                        str(base.path))
    full_bytes, _, _ = run_swarm(tmp_path / "full")

    # every node trained adapters on the same base and the checkpoint holds only them
    assert all(d["step"] > 0 and d["eval_loss"] is not None for d in docs)
    manifest = checkpoint.read_manifest(ckpts[0])
    assert manifest.arch["lora"]["base"] == base.id
    with open(ckpts[0] / checkpoint.MODEL_FILE, "rb") as f:
        header, _ = read_header(f)
    assert set(header) - {"__metadata__"} == {s.name for s in model.space}  # A and B only
    checkpoint.load_tensors(ckpts[0], checkpoint.MODEL_FILE,
                            model.space.views(model.space.zeros()))
    full_params = RWKV(SHAPE).space.n_params
    ratio = model.space.n_params / full_params
    # all 7 linear maps of every block adapted: 20 r C per block against 13 C^2 of matrices
    block_ratio = 20 * RANK / (13 * SHAPE.n_embd)
    assert model.space.n_params == block_ratio * 13 * SHAPE.n_embd**2 * SHAPE.n_layer
    measured = lora_bytes / full_bytes
    print(f"averaging request: LoRA {lora_bytes:.0f} B, full {full_bytes:.0f} B, measured "
          f"ratio {measured:.4f}, parameters {ratio:.4f}, blocks 20r/13C {block_ratio:.4f}")
    assert measured == pytest.approx(ratio, rel=0.15)


def test_a_node_on_another_base_is_refused_naming_the_base(tmp_path):
    ours = base_from_init(SHAPE, 7, tmp_path / "bases", "bf16")
    other = base_from_init(SHAPE, 8, tmp_path / "bases", "bf16")  # same shape, other weights
    with SwarmLab(tmp_path / "lab", TOML) as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [], "--mode", "lora", "--base", str(ours.path))
        b = lab.start("b", ports[1], [a.addr], "--mode", "lora", "--base", str(other.path))
        refused = wait_for("a refusal", lambda: [
            e for p in (a, b) for e in p.events() if e.get("event") == "refused"], 60)
        assert all(e["keys"] == ["arch", "base"] for e in refused), refused
        assert "base" in refused[0]["message"]
        assert a.status()["members"] == [] and b.status()["members"] == []
        lab.stop_all()
