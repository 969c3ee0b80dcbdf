"""The simulator's event core and device model: event order, cancellation, the clock, seeded
streams; batch choice and compute time of the device profiles (hand-computed)."""

from __future__ import annotations

import pytest

from sims.devices import PROFILES, calibrate, make_device
from sims.engine import Engine, SimulationError
from sims.fleet import failure_schedule


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    engine = Engine(seed=0)
    seen = []
    engine.at(2.0, seen.append, "c")
    engine.at(1.0, seen.append, "a")
    engine.at(1.0, seen.append, "b")  # same instant: after "a", scheduled first
    engine.after(0.5, seen.append, "first")
    engine.run_until(10.0)
    assert seen == ["first", "a", "b", "c"]
    assert engine.now == 10.0 and engine.events_run == 4


def test_events_scheduled_while_running_keep_the_order():
    engine = Engine(seed=0)
    seen = []

    def chain(k):
        seen.append((engine.now, k))
        if k < 3:
            engine.after(0.0, chain, k + 1)  # same instant, runs after what is queued
    engine.at(1.0, chain, 0)
    engine.at(1.0, seen.append, "other")
    engine.run_until(2.0)
    assert seen == [(1.0, 0), "other", (1.0, 1), (1.0, 2), (1.0, 3)]


def test_cancel_stop_and_the_past():
    engine = Engine(seed=0)
    seen = []
    timer = engine.at(1.0, seen.append, "cancelled")
    engine.at(2.0, lambda: (seen.append("stop"), engine.stop()))
    engine.at(3.0, seen.append, "later")
    timer.cancel()
    engine.run_until(10.0)
    assert seen == ["stop"] and engine.now == 2.0  # stop leaves the clock at the event
    with pytest.raises(SimulationError):
        engine.at(1.0, seen.append, "past")
    with pytest.raises(SimulationError):
        engine.after(-1.0, seen.append, "negative")
    engine.run_until(10.0)
    assert seen == ["stop", "later"] and engine.now == 10.0


def test_named_streams_are_reproducible_and_independent():
    a, b = Engine(seed=5), Engine(seed=5)
    first = [a.rng("x").random() for _ in range(3)]
    b.rng("y").random()  # another consumer does not shift stream x
    assert [b.rng("x").random() for _ in range(3)] == first
    assert Engine(seed=6).rng("x").random() != first[0]
    assert a.np_rng("z").integers(0, 1 << 30) == b.np_rng("z").integers(0, 1 << 30)


def test_failure_schedule_adds_up_the_exponential_draws():
    class Draws:
        def __init__(self, values):
            self.values = list(values)
            self.means = []

        def expovariate(self, rate):
            self.means.append(1.0 / rate)
            return self.values.pop(0)

    rng = Draws([10.0, 2.0, 5.0, 1.0, 100.0])
    # up 10, down 2, up 5, down 1, then the next failure (118) is past the horizon
    assert failure_schedule(rng, mttf=60.0, mttr=3.0, horizon=50.0) == [(10.0, 12.0),
                                                                         (17.0, 18.0)]
    assert rng.means == [60.0, 3.0, 60.0, 3.0, 60.0]


def test_batch_and_step_time_of_the_profiles_for_the_default_rwkv():
    flops, act = 5.41e6 * 64, 4_000_000  # default rwkv: 5.41 MFLOP/token, 64 tokens
    batches = {name: PROFILES[name].batch(flops, act)[0] for name in PROFILES}
    # samples a 0.25 s step can take: 25e9*0.35/flops*0.25 = 6.3 -> 8; 150: 37.9 -> 32;
    # 250: 63.2 -> 64; 800: 202 -> capped at 128 (the seed: Pi near 8, server near 128)
    assert batches == {"rpi4": 8, "laptop": 32, "desktop": 64, "server": 128}
    pi = PROFILES["rpi4"]
    assert pi.step_seconds(8, flops) == pytest.approx(8 * flops / (25e9 * 0.35))
    import random

    jittered = [pi.step_seconds(8, flops, random.Random(k)) for k in range(2000)]
    assert sum(jittered) / len(jittered) == pytest.approx(pi.step_seconds(8, flops), rel=0.02)


def test_calibration_from_bench_json_and_overrides():
    bench = {"model": "rwkv", "matmul_gflops": 21.5, "model_gflops": 6.0, "ratio": 0.279}
    pi = calibrate(PROFILES["rpi4"], bench)
    assert pi.matmul_gflops == 21.5 and pi.efficiency == 0.279
    assert pi.flops == pytest.approx(21.5e9 * 0.279)
    fast = make_device("fastpi", {"profile": "rpi4", "memory_gib": 8.0, "wifi_mbps": 50.0})
    assert fast.name == "fastpi" and fast.memory_gib == 8.0 and fast.matmul_gflops == 25.0
    assert fast.nic_bytes_per_second("wifi") == 50e6 / 8
    with pytest.raises(ValueError):
        make_device("x", {"profile": "rpi4", "warp_drive": 1})
    assert PROFILES["server"].fits(10**9) and not PROFILES["desktop"].fits(10**9)


def test_the_simulator_is_pure():
    """No wall clock, sockets or global randomness outside the CLI driver."""
    import ast
    from pathlib import Path

    forbidden = {"time", "datetime", "socket", "asyncio", "aiohttp", "zeroconf", "threading"}
    for path in sorted((Path(__file__).parent.parent / "sims").glob("*.py")):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""]
                assert not {n.split(".")[0] for n in names} & forbidden, (path.name, names)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if owner == "random":  # the module's global state: only Random(seed)
                    assert node.func.attr == "Random" and node.args, (path.name, owner)
                if owner == "np.random":  # only seeded generators
                    assert node.func.attr == "default_rng" and node.args, (path.name, owner)
