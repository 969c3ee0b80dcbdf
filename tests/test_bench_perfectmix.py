"""tests/bench/perfectmix.py: the simulator's ceiling with some replicas mixed perfectly."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from sims.fleet import Training, World
from sims.scenario import load
from tests.bench import perfectmix


def _args(**kw) -> argparse.Namespace:
    base = dict(lr=1.2e-2, ema=0.99, warmup=0, eval_every=5.0, only=True, devices=["server"],
                period=0.28, start=0.0, weighted=False, delay=0.0, outer_lr=None,
                outer_momentum=0.9)
    return argparse.Namespace(**(base | kw))


def test_a_mix_sets_the_chosen_replicas_to_their_rate_weighted_mean():
    args = _args(only=False, devices=["server", "desktop"], weighted=True)
    scenario = perfectmix.variant(load("seed-100m"), args)
    assert scenario.train["lr"] == 1.2e-2 and scenario.train["warmup_samples"] == 0
    world = World(scenario, 1, Training(scenario))
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    sim = perfectmix.PerfectMix(world, method, {"server", "desktop"}, 0.28, 0.0, True)
    for i in range(len(sim.machines)):
        sim.start(i)
    rng = np.random.default_rng(0)
    for m in sim.machines:
        m.node.learner.params[:] = rng.standard_normal(len(m.node.learner.params))
    chosen = [m for m in sim.machines if m.member.device.name in ("server", "desktop")]
    others = [m.node.learner.params.copy() for m in sim.machines if m not in chosen]
    rates = np.array([m.member.batch / world.compute_seconds(m.member) for m in chosen])
    assert len(chosen) == 13 and rates.max() > 2.5 * rates.min()  # a server's and a desktop's
    want = (rates[:, None] * np.stack([m.node.learner.params for m in chosen])).sum(0)
    sim._mix()
    for m in chosen:
        np.testing.assert_allclose(m.node.learner.params, want / rates.sum(), rtol=1e-5,
                                   atol=1e-6)
    after = [m.node.learner.params for m in sim.machines if m not in chosen]
    assert all(np.array_equal(a, b) for a, b in zip(after, others, strict=True))
    assert sim.mixes == 1


def test_a_late_mix_lands_as_a_move_that_keeps_the_steps_taken_meanwhile():
    scenario = perfectmix.variant(load("seed-100m"), _args())
    world = World(scenario, 1, Training(scenario))
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    sim = perfectmix.PerfectMix(world, method, {"server"}, 1.0, 0.0, False, delay=0.5)
    for i in range(len(sim.machines)):
        sim.start(i)
    rng = np.random.default_rng(1)
    for m in sim.machines:
        m.node.learner.params[:] = rng.standard_normal(len(m.node.learner.params))
    snapshots = [m.node.learner.params.copy() for m in sim.machines]
    later: list = []
    sim.engine.after = lambda delay, fn, *a: later.append((delay, fn, a))  # held, not run
    sim._mix()
    assert [d for d, _, _ in later] == [0.5, 1.0] and sim.mixes == 0  # the landing, the next
    assert all(np.array_equal(m.node.learner.params, s)
               for m, s in zip(sim.machines, snapshots, strict=True))  # nothing moved yet
    step = np.float32(0.25)
    sim.machines[0].node.learner.params += step  # a step taken while the mix travels
    _, land, args = later[0]
    land(*args)
    mean = np.mean(snapshots, axis=0)
    np.testing.assert_allclose(sim.machines[0].node.learner.params, mean + step, atol=1e-5)
    np.testing.assert_allclose(sim.machines[1].node.learner.params, mean, atol=1e-5)
    assert sim.mixes == 1


def _outer_sim(outer: tuple[float, float]) -> perfectmix.PerfectMix:
    scenario = perfectmix.variant(load("seed-100m"), _args())
    world = World(scenario, 1, Training(scenario))
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    sim = perfectmix.PerfectMix(world, method, {"server"}, 1.0, 0.0, False, outer=outer)
    for i in range(len(sim.machines)):
        sim.start(i)
    sim.engine.after = lambda delay, fn, *a: None  # each mix called by hand
    return sim


def test_an_outer_step_moves_the_anchor_by_nesterov_on_the_pseudo_gradient():
    sim = _outer_sim((0.7, 0.9))
    rng = np.random.default_rng(2)
    rounds = [[rng.standard_normal(len(m.node.learner.params)).astype(np.float32)
               for m in sim.machines] for _ in range(3)]
    anchor, momentum = None, None
    for i, values in enumerate(rounds):
        for m, v in zip(sim.machines, values, strict=True):
            m.node.learner.params[:] = v
        mean = np.mean(values, axis=0)
        if anchor is None:
            anchor, momentum = mean, np.zeros_like(mean)  # the first mix: the plain mean
        else:  # written out independently of the bench: d, m = 0.9 m + d, a -= 0.7 (d + 0.9 m)
            d = anchor - mean
            momentum = 0.9 * momentum + d
            anchor = anchor - 0.7 * (d + 0.9 * momentum)
        sim._mix()
        for m in sim.machines:
            np.testing.assert_allclose(m.node.learner.params, anchor, rtol=1e-5, atol=1e-5)
        if i == 2:  # the momentum carries the earlier rounds: not the plain mean any more
            assert np.abs(anchor - mean).max() > 0.1
    assert sim.mixes == 3


def test_an_outer_step_of_lr_1_without_momentum_is_the_plain_mix():
    plain, outer = _outer_sim((1.0, 0.0)), _outer_sim((1.0, 0.0))
    plain.outer = None
    rng = np.random.default_rng(3)
    for _ in range(3):
        values = [rng.standard_normal(len(m.node.learner.params)) for m in plain.machines]
        for sim in (plain, outer):
            for m, v in zip(sim.machines, values, strict=True):
                m.node.learner.params[:] = v
            sim._mix()
        for a, b in zip(plain.machines, outer.machines, strict=True):
            np.testing.assert_allclose(a.node.learner.params, b.node.learner.params, atol=1e-6)


def test_the_servers_mixed_perfectly_reach_the_target_sooner_than_unmixed_and_repeat():
    args = _args()
    scenario = perfectmix.variant(load("seed-100m"), args)
    assert [g.device for g in scenario.nodes] == ["server"] and scenario.stop_at_target
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    mixed = perfectmix.run(scenario, method, 1, args)
    assert mixed is not None and mixed == perfectmix.run(scenario, method, 1, args)
    unmixed = perfectmix.run(scenario, method, 1, _args(devices=[]))
    assert unmixed is not None and mixed < unmixed  # 50 s against 80 s when written


def test_the_command_line_prints_each_run_and_the_ratio_to_the_server_alone(capsys):
    perfectmix.main(["--only", "--seeds", "1", "--lr", "1.2e-2", "--ema", "0.99",
                     "--warmup", "0", "--eval-every", "5", "--solo", "--solo-lr", "8e-3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixed: gossip, the default, seed 1: ")
    assert out[1].startswith("solo: one server alone, seed 1: ")
    assert "perfect mix: server mean every 0.28 s from 0 s" in out[2] and out[2].endswith("x")


def test_the_command_line_runs_an_outer_step_mix(capsys):
    perfectmix.main(["--only", "--seeds", "1", "--period", "2.8", "--outer-lr", "0.7",
                     "--outer-momentum", "0.8"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixed: gossip, the default, seed 1: ") and "not reached" not in out[0]
    assert "as an outer step (lr 0.7, Nesterov momentum 0.8)" in out[1]


def test_the_command_line_refuses_what_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        perfectmix.main(["--only", "--devices", ""])
    assert "name at least one class" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        perfectmix.main(["--method", "one server alone"])  # not a gossip method
    assert "no gossip method" in capsys.readouterr().err
