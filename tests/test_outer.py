"""Pseudo-gradient gossip's pieces (issue 17): the optimiser's progress accumulator in
stochastically rounded bfloat16, the outer optimiser's share (compression with the
accumulator as error feedback) and apply (Nesterov), and the arithmetic that makes lossless
outer steps with lr 1 and no momentum exactly parameter averaging of progress."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.codecs import parse_message
from p2ptrain.codecs.kernels import bf16_bits_to_f32
from p2ptrain.optim import AdamW, Progress
from p2ptrain.params import ParamSpace
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.outer import OuterOptimizer

SENDER = bytes(16)


def widened(bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.shape[0], np.float32)
    bf16_bits_to_f32(bits, out)
    return out


def test_progress_sums_small_steps_without_bias():
    """Steps 1000x below a bfloat16 unit of the sum still add up (round-to-nearest would
    stall at the first step below half a unit)."""
    p = Progress(4096, seed=1)
    p.add(0, np.full(4096, 1.0, np.float32))
    for _ in range(500):
        p.add(0, np.full(4096, 1e-5, np.float32))
    got = widened(p.bits)
    assert abs(got.mean() - 1.005) < 2e-4, got.mean()


def test_adamw_adds_what_each_step_moved_to_the_progress():
    space = ParamSpace([("w", (64, 64)), ("b", (64,))])
    params = np.random.default_rng(0).normal(size=space.size).astype(np.float32)
    start = params.copy()
    opt, progress = AdamW(space, weight_decay=0.1), Progress(space.size, seed=2)
    rng = np.random.default_rng(1)
    for _ in range(20):
        opt.step(params, rng.normal(size=space.size).astype(np.float32), 1e-2, progress)
    moved = start - params
    err = widened(progress.bits) - moved  # 20 stochastic roundings to 8 significant bits
    rms = float(np.sqrt(np.mean(moved**2)))
    assert float(np.sqrt(np.mean(err**2))) < 0.01 * rms
    assert abs(float(err.mean())) < 0.001 * rms  # no drift


# (bits of e, the rms of e's rounding error it is held to, relative to e's rms)
FEEDBACK = [(16, 0.01), (8, 0.05)]


def make_outer(n, **kw):
    cfg = GossipConfig(**{"outer_every": 5, "fanout": 1, **kw})
    return OuterOptimizer(cfg, n, seed=3)


def test_lossless_outer_steps_with_lr_1_average_the_replicas_progress():
    """No compression, lr 1, no decay: every replica ends at the anchor minus the average of
    the rounds' progress -- parameter averaging of progress, exactly."""
    n = 1000
    rng = np.random.default_rng(0)
    anchor = rng.normal(size=n).astype(np.float32)
    outers = [make_outer(n, codec="none", outer_lr=1.0, outer_momentum=0.0) for _ in range(3)]
    replicas = []
    for o in outers:
        o.progress.add(0, (rng.normal(size=n) * 0.01).astype(np.float32))
        replicas.append(anchor - o.progress.values())  # exactly what the sum holds
    shared = [np.empty(n, np.float32) for _ in outers]
    msgs = [o.share(c, sender=SENDER, swarm=0, weight=1.0, seed=9, chunk_elems=256)
            for o, c in zip(outers, shared, strict=True)]
    assert all(not o.feedback.any() for o in outers)  # all of it was sent
    mean = np.mean(shared, axis=0)
    for x, o in zip(replicas, outers, strict=True):
        o.rewind(x)
        np.testing.assert_allclose(x, anchor, rtol=1e-6, atol=1e-7)  # the round's start
        assert not o.progress.any()  # the next round starts from nothing
        o.apply(x, mean.copy())
        np.testing.assert_allclose(x, anchor - mean, atol=1e-6)
    for m, c in zip(msgs, shared, strict=True):  # the messages decode to what was shared
        out = np.zeros(n, np.float32)
        for chunk in m:
            parse_message(chunk).decode_into(out)
        np.testing.assert_array_equal(out, c)


@pytest.mark.parametrize("bits, tolerance", FEEDBACK)
def test_topk_sends_a_part_and_owes_the_rest(bits, tolerance):
    """With decay 1 the accumulator is plain error feedback: over rounds, what was sent plus
    what is owed equals all the progress (to e's stochastic rounding); with decay beta the
    owed part shrinks by beta each round (SparseLoCo's momentum)."""
    n = 20_000
    for beta in (1.0, 0.5):
        o = make_outer(n, codec="topk", fraction=0.01, outer_momentum=beta,
                       outer_feedback_bits=bits)
        rng = np.random.default_rng(5)
        owed = np.zeros(n, np.float64)
        sent = np.zeros(n, np.float64)
        c = np.empty(n, np.float32)
        x = np.zeros(n, np.float32)
        for r in range(6):
            step = (rng.normal(size=n) * 1e-3).astype(np.float32)
            o.progress.add(0, step)
            owed = beta * owed + step
            msgs = o.share(c, sender=SENDER, swarm=r, weight=1.0, seed=r, chunk_elems=4096)
            o.rewind(x)
            assert 0.008 * n <= np.count_nonzero(c) <= 0.012 * n
            assert sum(len(m) for m in msgs) < 0.05 * 4 * n  # 1% of the values travel
            owed -= c
            sent += c
        err = o.feedback.values().astype(np.float64) - owed  # stochastic roundings
        rms = float(np.sqrt(np.mean(owed**2)))
        assert float(np.sqrt(np.mean(err**2))) < tolerance * rms
        assert abs(err.mean()) < 1e-3 * rms
    assert np.abs(x).max() > 0  # rewind added each round's progress


def test_the_outer_step_moves_by_lr_times_the_average():
    o = make_outer(100, codec="none", outer_lr=0.5)
    x = np.ones(100, np.float32)
    o.apply(x, np.full(100, 0.2, np.float32))
    np.testing.assert_allclose(x, 0.9)
    assert o.rounds == 1 and o.due(10) and not o.due(7)


def test_outer_settings_are_checked():
    with pytest.raises(ValueError, match="fanout"):
        GossipConfig(outer_every=10, fanout=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        GossipConfig(outer_every=10, fanout=1, outer_momentum=1.5)
    with pytest.raises(ValueError, match="outer_feedback_bits"):
        GossipConfig(outer_every=10, fanout=1, outer_feedback_bits=12)


@pytest.mark.parametrize("bits, tolerance", FEEDBACK)
def test_keeping_unsent_progress_gives_back_only_what_was_sent(bits, tolerance):
    """outer_rewind = false: the replica keeps the progress it still owes -- after the
    outer step it sits at the round's start minus what e holds (to e's rounding)."""
    n = 8000
    o = make_outer(n, codec="topk", fraction=0.05, outer_momentum=1.0, outer_rewind=False,
                   outer_feedback_bits=bits)
    rng = np.random.default_rng(4)
    anchor = rng.normal(size=n).astype(np.float32)
    o.progress.add(0, (rng.normal(size=n) * 1e-2).astype(np.float32))
    x = anchor - o.progress.values()
    c = np.empty(n, np.float32)
    o.share(c, sender=SENDER, swarm=0, weight=1.0, seed=1, chunk_elems=2048)
    o.give_back(x, c)
    assert o.progress is o.feedback  # one vector: the steps add to what is owed
    err = x - (anchor - o.feedback.values())
    assert float(np.abs(err).max()) < 2 * tolerance * float(np.abs(o.feedback.values()).max())
    with pytest.raises(RuntimeError):
        o.rewind(x)


@pytest.mark.parametrize("bits, tolerance", FEEDBACK)
def test_without_rewinding_one_vector_holds_what_two_did(bits, tolerance):
    """outer_rewind = false keeps e alone (1 byte a parameter at 8 bits, 2 at 16): the steps
    add to it and a share leaves beta (e - c) -- at every share e is beta e' + d as with two
    vectors."""
    n = 20_000
    o = make_outer(n, codec="topk", fraction=0.02, outer_momentum=0.5, outer_rewind=False,
                   outer_feedback_bits=bits)
    assert o.feedback.nbytes < (bits / 8 + 0.02) * n + 256  # + the last group's padding
    rng = np.random.default_rng(8)
    owed = np.zeros(n, np.float64)  # e after the last share, before the decay
    c = np.empty(n, np.float32)
    for r in range(5):
        for _ in range(3):  # three local steps' progress
            step = (rng.normal(size=n) * 1e-3).astype(np.float32)
            o.progress.add(0, step)
            owed += step
        expected = owed.copy()  # e at this share: beta (e' - c') + d
        o.share(c, sender=SENDER, swarm=r, weight=1.0, seed=r, chunk_elems=4096)
        assert 0.015 * n <= np.count_nonzero(c) <= 0.025 * n
        np.testing.assert_allclose(c[c != 0], expected[c != 0], rtol=2 * tolerance)  # the top
        owed = 0.5 * (expected - c)
    err = o.feedback.values().astype(np.float64) - owed
    rms = float(np.sqrt(np.mean(owed**2)))
    assert float(np.sqrt(np.mean(err**2))) < tolerance * rms
    assert abs(err.mean()) < 1e-3 * rms


@pytest.mark.parametrize("size", [65504.0, 5.0])  # refused as absurd / under the limit
def test_one_peers_huge_vector_cannot_wreck_a_first_outer_round(size):
    """A node's first outer round has no norm history: a peer's pseudo-gradient judged
    against max_norm alone and clipped by the median of [own norm, its norm] went straight
    into the weights (4x the own weight): one push took max |w| from 3.9 to 52,405. The
    reference is bounded by the own norms now, and the applied average by the own share."""
    from p2ptrain.codecs import encode_vector
    from p2ptrain.proto.gossip.messages import GradientPush
    from p2ptrain.proto.gossip.trainer import GossipTrainer
    from tests.test_node import learner

    hostile_id, me = "a" * 32, "b" * 32
    cfg = GossipConfig(outer_every=4, fanout=1, average_every=0)

    def run(push: bool):
        t = GossipTrainer(cfg, learner(me), np.random.default_rng(2), average_timeout=90.0,
                          chunk_elems=1 << 20)
        codec = cfg.make_codec()
        vec = np.zeros(t.n, np.float32)
        vec[np.random.default_rng(0).choice(t.n, codec.k(t.n), replace=False)] = size
        for m in encode_vector(codec, vec, sender_id=bytes.fromhex(hostile_id),
                               swarm_samples=1, weight=cfg.max_sample_weight, seed=1,
                               chunk_elems=1 << 20):
            body = GradientPush(1, 1.0, bytes(m))
            if push:  # every check a peer's push gets, then taken
                t.on_body(0.0, hostile_id, "x", body, t.parse(hostile_id, body), busy=False,
                          outbound_sender=False, out=[])
        before = t.learner.params.copy()
        for step in range(cfg.outer_every):
            report = t.step(float(step), t.learner.compute_gradient(), [], [], [])
        return t, report, before

    honest, _, before = run(False)
    attacked, report, _ = run(True)
    moved = float(np.linalg.norm(attacked.learner.params - honest.learner.params))
    own = report.own_norm
    assert own > 0 and moved <= (cfg.clip_multiple + 1) * own, (moved, own)
    assert float(np.abs(attacked.learner.params).max()) < 2 * float(np.abs(before).max())
    assert attacked.learner.compute_gradient() < honest.learner.compute_gradient() + 0.5
    if size > 1000:
        assert attacked.mixer.drops["norm"] == 1 and not report.peers


@pytest.mark.parametrize("averaging", ["full", "subset"])
def test_averaging_within_a_round_moves_the_anchors_not_the_partial_progress(averaging):
    """Outer steps that rewind, with parameter averaging beside (every step here): two
    replicas that start a round at one anchor and average mid-round must still share it after
    their rewinds. Snapshots of the replicas carried each side's partial progress into the
    other: the rewind took back only the own steps, so the anchors ended apart by the
    difference of their partial progress (RMS 0.014 in a review's two-replica run). The
    snapshots are the anchors now, x + d."""
    from p2ptrain.proto.gossip.trainer import GossipTrainer
    from tests.test_gossip_crossing import ADDR, deliver, rms
    from tests.test_node import learner

    a_id, b_id = "a" * 32, "b" * 32
    cfg = GossipConfig(outer_every=1000, fanout=1, average_every=1, averaging=averaging,
                       average_every_fast=0)
    a, b = (GossipTrainer(cfg, learner(i), np.random.default_rng(k), average_timeout=90.0,
                          chunk_elems=1 << 20) for k, i in enumerate((a_id, b_id)))
    b.learner.params[:] = a.learner.params  # one anchor
    for _ in range(3):  # partial progress: a trains, b does not
        a.step(1.0, a.learner.compute_gradient(), [], [], [])
    assert rms(a.learner.params, b.learner.params) > 1e-3
    out: list = []
    a.step(2.0, a.learner.compute_gradient(), [], [(b_id, ADDR[b_id])], out)
    [request] = out
    [reply] = deliver(b, a_id, request.body, 2.1)
    assert reply.body.chunks and b.stats["average_applied"] == 1
    assert deliver(a, b_id, reply.body, 2.2) == [] and a.stats["average_applied"] == 1
    for t in (a, b):
        t.outer.rewind(t.learner.params)
    assert rms(a.learner.params, b.learner.params) < 1e-4  # was 2.6e-3 (full), 9e-4 (subset)
