"""The simulator's LoRA charge: a `[charge]` spec with `lora_rank` is charged for the adapters
(lora_sizes' count and FLOPs) and holds the 16-bit base in memory; traffic per exchange
shrinks by the adapter-to-full ratio; a 1B LoRA fits a 4 GB Pi where full training does
not; the traffic sweep's `charges` add points without moving the `params` points."""

from __future__ import annotations

import pytest

from p2ptrain.models.lora import LoRAConfig, lora_sizes
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from sims import report, run, traffic
from sims.charge import ModelSize
from sims.devices import BYTES_PER_PARAM_TRAINING, GIB, PROFILES
from sims.fleet import World
from sims.scenario import parse

SMALL = {"model": "rwkv", "n_layer": 2, "n_embd": 256, "ctx_len": 64}
SEED_1B = {"model": "rwkv", "preset": "seed-1b", "vocab_size": 50277, "ctx_len": 64}


def lora(spec: dict, rank: int = 16) -> dict:
    return {**spec, "lora_rank": rank}


def sweep_doc(charges: list[dict], device: str = "server", **sweep) -> dict:
    return {
        "name": "lora-traffic", "mode": "traffic", "duration": 3.0, "seed": 5,
        "charge": {"params": 1e6, "ctx_len": 64},
        "sites": [{"name": "dc"}],
        "nodes": [{"device": device, "count": 2, "site": "dc", "medium": "wired"}],
        "sweep": {"nodes": [4], "charges": charges, **sweep},
        "methods": [{"name": "gossip", "kind": "gossip", "averaging": "subset_fp16"},
                    {"name": "gossip full", "kind": "gossip", "averaging": "full",
                     "average_every": 1},
                    {"name": "coordinator", "kind": "coordinator", "pull": "fp16"}],
    }


@pytest.mark.parametrize("rank", [4, 16])
def test_lora_charge_is_lora_sizes(rank):
    config = RWKVConfig(vocab_size=50277, n_layer=24, n_embd=1664, ctx_len=64)
    adapters, flops = lora_sizes(config, LoRAConfig(rank=rank))
    size = ModelSize.from_spec(lora(SEED_1B, rank))
    full = ModelSize.from_spec(SEED_1B)
    assert size.lora and not full.lora
    assert size.params == adapters == 24 * 20 * rank * 1664  # 7 maps: 20 r C per block
    assert size.flops_per_token == flops
    assert size.base_params == full.params == RWKV(config).space.n_params
    assert size.ctx_len == full.ctx_len == 64
    assert size.activation_bytes == full.activation_bytes
    assert size.resident_bytes == adapters * BYTES_PER_PARAM_TRAINING + 2 * full.params
    assert 0.6 < size.flops_per_token / full.flops_per_token < 0.7  # ~4/6 plus adapters
    assert f"LoRA r{rank}" in size.name


def test_lora_targets_and_refusals():
    att = ModelSize.from_spec({**lora(SMALL), "lora_targets": "blocks.*.att.*"})
    _, flops = lora_sizes(RWKVConfig(n_layer=2, n_embd=256),
                          LoRAConfig(targets="blocks.*.att.*"))
    assert att.params == 2 * 16 * 8 * 256 and att.flops_per_token == flops
    assert "on blocks.*.att.*" in att.name
    for bad in ({**SMALL, "lora_targets": "blocks.*.att.*"},  # targets without a rank
                lora(SMALL, 0),
                {**lora(SMALL), "lora_targets": "nothing.*"},
                {"model": "mlp", "lora_rank": 16},
                {"model": "mlp", "preset": "seed-1b"},
                {**SEED_1B, "preset": "rwkv-2t"}):
        with pytest.raises(ValueError):
            ModelSize.from_spec(bad)


def test_a_1b_lora_fits_a_pi_where_full_training_does_not():
    pi = PROFILES["rpi4"]
    full, adapted = ModelSize.from_spec(SEED_1B), ModelSize.from_spec(lora(SEED_1B))
    assert not pi.holds(full.resident_bytes) and pi.holds(adapted.resident_bytes)
    assert adapted.resident_bytes < 2.5 * GIB  # 2 B/param of base + the adapters' state
    scenario = parse(sweep_doc([SEED_1B, lora(SEED_1B)], device="rpi4"))
    with pytest.raises(ValueError, match="does not fit in a rpi4"):
        World(scenario, 0, None, full)
    world = World(scenario, 0, None, adapted)
    assert len(world.members) == 2 and world.charged is adapted
    row = traffic.run_point(scenario, {"nodes": 4, "charge": 1, "method": 0}, 0)
    assert row["charge"]["mode"] == "lora" and row["model_params"] == adapted.params


def test_traffic_per_exchange_shrinks_by_the_adapter_ratio():
    scenario = parse(sweep_doc([SMALL, lora(SMALL)]))
    full, adapted = (ModelSize.from_spec(s) for s in (SMALL, lora(SMALL)))
    ratio = adapted.params / full.params  # ~0.09 for this shape
    results = run.run_scenario(scenario)
    assert run.dumps(results) == run.dumps(run.run_scenario(scenario))
    rows = {(r["name"], r["charge"]["mode"]): r for r in results["points"]}
    assert len(rows) == 6
    for name, key in (("gossip", "push_bytes"), ("gossip", "average_bytes"),
                      ("gossip full", "average_bytes"), ("coordinator", "push_bytes"),
                      ("coordinator", "pull_bytes")):
        f, a = (rows[(name, mode)][key] - traffic.HEADER_BYTES for mode in ("full", "lora"))
        assert a / f == pytest.approx(ratio, rel=0.02), (name, key)
    for name in ("gossip", "gossip full", "coordinator"):
        assert rows[(name, "lora")]["model_params"] == adapted.params
        assert rows[(name, "lora")]["charge"]["base_params"] == full.params
        assert "base_params" not in rows[(name, "full")]["charge"]
    table = report.markdown(results)
    assert table.count("adapters (LoRA; base") == 3 and table.count("(full): rwkv(") == 3


def test_auto_averaging_covers_every_adapter_in_lora_mode():
    """The default (`averaging = "auto"`) in traffic mode resolves by the charged model: a 10%
    subset for the full model, every coordinate for its adapters (LoRA computes far more per
    travelling coordinate) -- ten times the subset's share of a vector 0.09 the size."""
    doc = sweep_doc([SMALL, lora(SMALL)])
    doc["methods"] = [{"name": "auto", "kind": "gossip"},
                      {"name": "subset", "kind": "gossip", "averaging": "subset_int8"}]
    rows = {(r["name"], r["charge"]["mode"]): r["average_bytes"] - traffic.HEADER_BYTES
            for r in run.run_scenario(parse(doc))["points"]}
    assert rows[("auto", "full")] == rows[("subset", "full")]
    assert rows[("auto", "lora")] == pytest.approx(10 * rows[("subset", "lora")], rel=0.02)


def test_charges_follow_the_params_points_unchanged():
    doc = sweep_doc([lora(SMALL)], params=[1e6])
    with_charges, plain = parse(doc), parse({**doc, "sweep": {"nodes": [4], "params": [1e6]}})
    points = traffic.sweep_points(with_charges)
    assert points[:3] == traffic.sweep_points(plain) == [
        {"nodes": 4, "params": 1000000, "method": k} for k in range(3)]
    assert points[3:] == [{"nodes": 4, "charge": 0, "method": k} for k in range(3)]
    assert run.dumps(traffic.run_point(with_charges, points[0], 1)) == \
        run.dumps(traffic.run_point(plain, points[0], 1))
    only = traffic.sweep_points(parse(sweep_doc([lora(SMALL)])))  # charges alone: no params
    assert [p.get("charge") for p in only] == [0, 0, 0]
    with pytest.raises(ValueError, match="unknown key"):
        traffic.sweep_points(parse(sweep_doc([], param=[1e6])))
    with pytest.raises(ValueError):
        traffic.sweep_points(parse(sweep_doc([{**SMALL, "lora_rank": 0}])))
