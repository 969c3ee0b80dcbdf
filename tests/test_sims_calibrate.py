"""The simulator pieces the calibration against real nodes (tests/bench/calibrate.py) rests
on: a hand-set `[train] batch` is every machine's batch, as on a real node, and a device's
`overhead` (host work beside the gradient) lengthens its steps in proportion. The comparison
with real processes itself is a benchmark (docs/BENCHMARKS.md), not a test."""

import pytest

from sims.charge import ModelSize, build_model_from
from sims.devices import PROFILES, make_device
from sims.fleet import Training, World
from sims.scenario import load


def test_the_calibration_scenario_gives_every_machine_the_set_batch_and_step_time():
    scenario = load("calibrate")
    world = World(scenario, 1, Training(scenario))
    fps = ModelSize.of(build_model_from("rwkv", {"n_layer": 2, "n_embd": 64,
                                                 "ctx_len": 32})).flops_per_sample
    assert [m.batch for m in world.members] == [32] * 4
    assert [m.outbound_only for m in world.members] == [False, False, False, True]
    for m in world.members:
        gradient = 32 * fps / (m.device.matmul_gflops * 1e9)
        assert world.compute_seconds(m) == pytest.approx(gradient * (1 + m.device.overhead))


def test_without_a_set_batch_the_hardware_chooses():
    scenario = load("calibrate")
    scenario = scenario.replace(train={k: v for k, v in scenario.train.items() if k != "batch"})
    world = World(scenario, 1, Training(scenario))
    m = world.members[0]
    assert m.batch == m.device.batch(world.charged.flops_per_sample,
                                     world.charged.activation_bytes, 0.25)[0]


def test_overhead_scales_the_step_and_is_checked():
    plain = PROFILES["laptop"]
    loaded = make_device("laptop", {"overhead": 0.5})
    assert loaded.step_seconds(8, 1e9) == pytest.approx(1.5 * plain.step_seconds(8, 1e9))
    with pytest.raises(ValueError, match="overhead"):
        make_device("laptop", {"overhead": -0.1})
