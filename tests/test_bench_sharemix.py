"""tests/bench/sharemix.py: the shared-increments account over the simulator's links."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from sims.fleet import Training, World
from sims.scenario import load
from tests.bench import perfectmix, sharemix


def _sim(fraction: float, value_bytes: int = 4, start: float = 0.0, form: str = "follow"):
    args = argparse.Namespace(lr=1.2e-2, ema=0.99, warmup=0, eval_every=5.0, only=False,
                              devices=["server"])
    scenario = perfectmix.variant(load("seed-100m"), args)
    world = World(scenario, 1, Training(scenario))
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    sim = sharemix.ShareMix(world, method, {"server"}, fraction, value_bytes, start,
                            form=form)
    for i in range(len(sim.machines)):
        sim.start(i)
    sent: list = []
    lost: list = []

    def send(src, dst, size, deliver, **kw):  # held: the test delivers
        sent.append((src, dst, size, deliver))
        lost.append(kw["on_lost"])
        return True

    sim.network.send = send
    sim.lost = lost
    return sim, sent


def test_a_share_gives_each_member_its_part_and_the_sum_of_the_replicas_is_kept():
    sim, sent = _sim(1.0)
    group = sorted(sim.views)
    assert len(group) == 3
    rng = np.random.default_rng(0)
    first = group[0]
    params = [sim.machines[j].node.learner.params for j in group]
    step = rng.standard_normal(len(params[0])).astype(np.float32)
    params[0] += step  # a step of the first: what it has not shared
    before = [p.copy() for p in params]
    sim.share(first, sim.machines[first].generation)
    assert [(s, d) for s, d, _, _ in sent] == [(first, group[1]), (first, group[2])]
    assert sim.waiting[first] == 2
    sim.share(first, sim.machines[first].generation)  # the last share is still on its way
    assert len(sent) == 2
    for *_, deliver in sent:
        deliver()
    assert sim.waiting[first] == 0
    for p, b, kept in zip(params, before, (-2 / 3, 1 / 3, 1 / 3), strict=True):
        np.testing.assert_allclose(p - b, kept * step, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sum(params), sum(before), rtol=1e-4, atol=1e-4)
    for j, p in zip(group, params, strict=True):  # nothing left unshared anywhere
        np.testing.assert_allclose(p - sim.views[j], 0.0, atol=1e-5)


def test_what_top_k_does_not_send_stays_in_the_residual_and_bytes_are_the_codecs():
    sim, sent = _sim(0.25, value_bytes=2)
    first = sorted(sim.views)[0]
    x = sim.machines[first].node.learner.params
    step = np.random.default_rng(1).standard_normal(len(x)).astype(np.float32)
    x += step
    sim.share(first, sim.machines[first].generation)
    residual = x - sim.views[first]
    k = int(len(x) * 0.25)
    sent_part = step - residual  # what left the residual: q, the top quarter
    assert np.count_nonzero(np.abs(sent_part) > 1e-3) <= k
    kept = np.abs(step) >= np.sort(np.abs(step))[-k]
    np.testing.assert_allclose(residual[~kept], step[~kept], atol=1e-6)
    assert np.all(np.abs(residual[kept]) < 1e-2)  # fp16 rounding of the values sent
    planned = sim.world.charged.params
    size = sent[0][2]
    assert 2 * round(k * planned / len(x)) < size < 3 * round(k * planned / len(x))


def test_a_short_run_shares_and_reports(capsys):
    sharemix.main(["--scenario", "ci", "--method", "gossip", "--devices", "server,laptop",
                   "--seeds", "1"])
    out = capsys.readouterr().out
    assert "shares" in out and out.strip().splitlines()[-1].startswith("ci (")


def test_a_part_lost_on_the_way_frees_the_sender_and_reaches_nobody():
    sim, sent = _sim(1.0)
    first, second, third = sorted(sim.views)
    x = sim.machines[first].node.learner.params
    x += 1.0
    before = sim.machines[second].node.learner.params.copy()
    sim.share(first, sim.machines[first].generation)
    sim.lost[0]()  # to the second: lost
    assert sim.waiting[first] == 1
    sent[1][3]()  # to the third: arrives
    assert sim.waiting[first] == 0
    np.testing.assert_array_equal(sim.machines[second].node.learner.params, before)
    sim.share(first, sim.machines[first].generation)  # free to share again
    assert len(sent) == 4


@pytest.mark.parametrize("form", ["follow", "keep", "sync"])
def test_a_group_formed_late_starts_from_the_views_its_form_says(form):
    sim, sent = _sim(1.0, start=10.0, form=form)
    group = sorted(sim.views)
    rng = np.random.default_rng(2)
    params = [sim.machines[j].node.learner.params for j in group]
    start = [p.copy() for p in params]
    for p in params:  # each drifts its own way before the group forms
        p += rng.standard_normal(len(p)).astype(np.float32)
    for j in group:
        sim.share(j, sim.machines[j].generation)  # before --start: nothing is sent
    assert not sent
    for j, p, s0 in zip(group, params, start, strict=True):
        np.testing.assert_array_equal(sim.views[j], p if form == "follow" else s0)
    sim.engine.now = 10.0  # the group forms
    mean = np.mean([p.copy() for p in params], axis=0)
    sim.share(group[0], sim.machines[group[0]].generation)
    if form == "sync":  # every member at the mean, its view with it; nothing left to send
        for j, p in zip(group, params, strict=True):
            np.testing.assert_allclose(p, mean, atol=1e-5)
            np.testing.assert_allclose(sim.views[j], mean, atol=1e-5)
    elif form == "keep":  # the drift since the start is what the first share carries
        assert len(sent) == 2
