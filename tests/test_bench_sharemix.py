"""tests/bench/sharemix.py: the shared-increments account over the simulator's links."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

from p2ptrain.codecs import make_codec, total_encoded_size
from sims.fleet import Training, World
from sims.scenario import load
from tests.bench import perfectmix, sharemix


def _sim(fraction: float, values: str = "fp32", start: float = 0.0, form: str = "follow",
         codec: str = "topk", work: float = 0.0):
    args = argparse.Namespace(lr=1.2e-2, ema=0.99, warmup=0, eval_every=5.0, only=False,
                              devices=["server"])
    scenario = perfectmix.variant(load("seed-100m"), args)
    world = World(scenario, 1, Training(scenario))
    method = next(m for m in scenario.methods if m.name == "gossip, the default")
    sim = sharemix.ShareMix(world, method, {"server"}, fraction, values, start, form=form,
                            codec=codec, work=work)
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
    sim, sent = _sim(0.25, values="fp16")
    first = sorted(sim.views)[0]
    x = sim.machines[first].node.learner.params
    step = np.random.default_rng(1).standard_normal(len(x)).astype(np.float32)
    x += step
    sim.share(first, sim.machines[first].generation)
    residual = x - sim.views[first]
    codec = make_codec("topk", fraction=0.25, values="fp16")
    kept = np.zeros(len(x), bool)
    kept[codec.select(step)] = True  # the proxy's vector is one chunk of the codec
    np.testing.assert_allclose(residual[~kept], step[~kept], atol=1e-6)  # not sent: kept
    assert np.all(np.abs(residual[kept]) < 1e-2)  # sent: fp16 rounding is all that is left
    planned = sim.world.charged.params
    assert sent[0][2] == total_encoded_size(codec, planned)  # the product's bytes at 100M


def test_a_part_lost_on_the_way_frees_the_sender_and_reaches_nobody():
    sim, sent = _sim(1.0)
    first, second, third = sorted(sim.views)
    sim.machines[first].node.learner.params[:] += 1.0
    before = sim.machines[second].node.learner.params.copy()
    sim.share(first, sim.machines[first].generation)
    sim.lost[0]()  # to the second: lost
    assert sim.waiting[first] == 1
    sent[1][3]()  # to the third: arrives
    assert sim.waiting[first] == 0
    np.testing.assert_array_equal(sim.machines[second].node.learner.params, before)
    sim.share(first, sim.machines[first].generation)  # free to share again
    assert len(sent) == 4


def test_parts_of_a_share_from_before_a_restart_do_not_free_the_new_incarnation():
    sim, sent = _sim(1.0)
    first = sorted(sim.views)[0]
    sim.machines[first].node.learner.params[:] += 1.0
    sim.share(first, sim.machines[first].generation)  # two parts on their way
    sim.crash(first)
    sim.start(first)  # back, a new incarnation (its joining messages go out too)
    sim.machines[first].node.learner.params[:] += 1.0
    sim.share(first, sim.machines[first].generation)

    def shares() -> list:
        return [s for s in sent if s[2] == sim.charged]

    assert sim.waiting[first] == 2 and len(shares()) == 4
    for *_, deliver in shares()[:2]:  # the old incarnation's parts land
        deliver()
    assert sim.waiting[first] == 2  # still waiting for its own
    sim.share(first, sim.machines[first].generation)
    assert len(shares()) == 4


@pytest.mark.parametrize("form", ["follow", "keep", "sync"])
def test_a_group_formed_late_starts_from_the_views_its_form_says(form):
    sim, sent = _sim(1.0, start=10.0, form=form)
    group = sorted(sim.views)
    rng = np.random.default_rng(2)
    params = [sim.machines[j].node.learner.params for j in group]
    start = [p.copy() for p in params]
    for p in params:  # each drifts its own way before the group forms
        p += rng.standard_normal(len(p)).astype(np.float32)
    drift = [p - s0 for p, s0 in zip(params, start, strict=True)]
    for j in group:
        sim.share(j, sim.machines[j].generation)  # before --start: nothing is sent
    assert not sent
    for j, p, s0 in zip(group, params, start, strict=True):
        np.testing.assert_array_equal(sim.views[j], p if form == "follow" else s0)
    sim.engine.now = 10.0  # the group forms; the first member shares
    mean = np.mean([p.copy() for p in params], axis=0)
    before = [p.copy() for p in params]
    sim.share(group[0], sim.machines[group[0]].generation)
    for *_, deliver in sent:
        deliver()
    moved = [p - b for p, b in zip(params, before, strict=True)]
    if form == "follow":  # its view was its replica: nothing of its own to give
        assert all(np.abs(m).max() < 1e-6 for m in moved)
    elif form == "keep":  # the drift since the common start is what it gives
        np.testing.assert_allclose(moved[1], drift[0] / 3, atol=1e-5)
        np.testing.assert_allclose(moved[2], drift[0] / 3, atol=1e-5)
    else:  # every member at the mean, its view with it; nothing left to send
        for j, p in zip(group, params, strict=True):
            np.testing.assert_allclose(p, mean, atol=1e-5)
            np.testing.assert_allclose(sim.views[j], mean, atol=1e-5)


def test_a_short_run_shares_and_reports(capsys):
    sharemix.main(["--scenario", "ci", "--method", "gossip", "--devices", "server,laptop",
                   "--seeds", "1"])
    out = capsys.readouterr().out
    shares = int(re.search(r"(\d+) shares", out).group(1))
    assert shares > 0 and out.strip().splitlines()[-1].startswith("ci (")
    with pytest.raises(SystemExit):
        sharemix.main(["--scenario", "ci", "--method", "gossip", "--devices", "nosuch"])


def test_a_member_that_adopts_a_checkpoint_gives_none_of_it_away():
    sim, sent = _sim(1.0)
    first, second, _ = sorted(sim.views)
    weights = np.random.default_rng(3).standard_normal(len(sim.views[first]))
    sim.fetched_data["ckpt"] = argparse.Namespace(params=weights.astype(np.float32))
    sim.adopt(first, argparse.Namespace(path="ckpt"))
    before = sim.machines[second].node.learner.params.copy()
    sim.share(first, sim.machines[first].generation)
    for *_, deliver in sent:
        deliver()
    np.testing.assert_allclose(sim.machines[second].node.learner.params, before, atol=1e-7)
    np.testing.assert_allclose(sim.machines[first].node.learner.params, weights, atol=1e-6)


def test_random_k_shares_seeded_positions_and_keeps_the_rest():
    sim, sent = _sim(0.5, codec="randomk")
    first = sorted(sim.views)[0]
    params = [sim.machines[j].node.learner.params for j in sorted(sim.views)]
    step = np.random.default_rng(4).standard_normal(len(params[0])).astype(np.float32) + 1.0
    params[0] += step
    before = [p.copy() for p in params]
    sim.share(first, sim.machines[first].generation)
    for *_, deliver in sent:
        deliver()
    moved = params[1] - before[1]
    assert moved.nonzero()[0].size == len(step) // 2  # one coordinate in each pair of two
    np.testing.assert_array_equal(moved, params[2] - before[2])
    np.testing.assert_allclose(sum(params), sum(before), rtol=1e-4, atol=1e-4)
    assert sent[0][2] == total_encoded_size(make_codec("randomk", fraction=0.5, values="fp32"),
                                            sim.world.charged.params)


def test_a_share_selected_beside_the_steps_leaves_and_is_given_away_later():
    sim, sent = _sim(1.0, work=0.4)
    first = sorted(sim.views)[0]
    x = sim.machines[first].node.learner.params
    x += 1.0
    later: list = []
    sim.engine.after = lambda delay, fn, *a: later.append((delay, fn, a))  # held, not run
    sim.share(first, sim.machines[first].generation)
    assert not sent and sim.waiting[first] == 2  # selected; on its way out in 0.4 s
    assert [delay for delay, _, _ in later] == [0.4]
    x += 1.0  # a step meanwhile: not in this share
    _, fn, args = later[0]
    fn(*args)
    assert [(s, d) for s, d, _, _ in sent] == [(first, j) for j in sorted(sim.views)[1:]]
    np.testing.assert_allclose(x - sim.views[first], 1.0, atol=1e-6)  # the step since
