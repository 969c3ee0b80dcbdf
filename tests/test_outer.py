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


def make_outer(n, **kw):
    cfg = GossipConfig(outer_every=5, fanout=1, **kw)
    return OuterOptimizer(cfg, n, seed=3)


def test_lossless_outer_steps_with_lr_1_average_the_replicas_progress():
    n = 1000
    rng = np.random.default_rng(0)
    anchor = rng.normal(size=n).astype(np.float32)
    outers = [make_outer(n, codec="none", outer_lr=1.0, outer_momentum=0.0) for _ in range(3)]
    replicas = []
    for o in outers:
        moved = (rng.normal(size=n) * 0.01).astype(np.float32)
        o.progress.add(0, moved)
        replicas.append(anchor - widened(o.progress.bits))  # exactly what the sum holds
    shared = [np.empty(n, np.float32) for _ in outers]
    msgs = [o.share(c, sender=SENDER, swarm=0, weight=1.0, seed=9, chunk_elems=256)
            for o, c in zip(outers, shared, strict=True)]
    assert all(not widened(o.progress.bits).any() for o in outers)  # all of it was shared
    mean = np.mean(shared, axis=0)
    for x, o, c in zip(replicas, outers, shared, strict=True):
        x += c
        o.apply(x, mean.copy())
        np.testing.assert_allclose(x, anchor - mean, atol=1e-6)
    # the messages decode to what was shared
    for m, c in zip(msgs, shared, strict=True):
        out = np.zeros(n, np.float32)
        for chunk in m:
            parse_message(chunk).decode_into(out)
        np.testing.assert_array_equal(out, c)


def test_topk_shares_a_part_and_keeps_the_rest_for_later():
    """The accumulator is the error feedback: over rounds, what was shared plus what is left
    equals all the progress added (to bfloat16's rounding)."""
    n = 20_000
    o = make_outer(n, codec="topk", fraction=0.01)
    rng = np.random.default_rng(5)
    added = np.zeros(n, np.float64)
    shared = np.zeros(n, np.float64)
    c = np.empty(n, np.float32)
    for r in range(6):
        step = (rng.normal(size=n) * 1e-3).astype(np.float32)
        o.progress.add(0, step)
        added += step
        msgs = o.share(c, sender=SENDER, swarm=r, weight=1.0, seed=r, chunk_elems=4096)
        assert 0.008 * n <= np.count_nonzero(c) <= 0.012 * n
        assert sum(len(m) for m in msgs) < 0.05 * 4 * n  # 1% of the values travel
        shared += c
    left = widened(o.progress.bits).astype(np.float64)
    assert np.abs(shared + left - added).max() < 0.01 * np.abs(added).max()


def test_nesterov_outer_step_matches_its_formula():
    n = 5000
    o = make_outer(n, codec="none", outer_lr=0.7, outer_momentum=0.9)
    rng = np.random.default_rng(2)
    x = rng.normal(size=n).astype(np.float32)
    ref_x, ref_m = x.astype(np.float64), np.zeros(n)
    for _ in range(4):
        avg = (rng.normal(size=n) * 1e-2).astype(np.float32)
        ref_m = 0.9 * ref_m + avg
        ref_x -= 0.7 * (avg + 0.9 * ref_m)
        o.apply(x, avg.copy())
    err = np.abs(x - ref_x).max()
    assert err < 0.01 * np.abs(ref_m).max(), err  # the momentum is kept in bfloat16: 2^-8
    assert o.rounds == 4 and o.due(10) and not o.due(7)


def test_outer_settings_are_checked():
    with pytest.raises(ValueError, match="fanout"):
        GossipConfig(outer_every=10, fanout=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        GossipConfig(outer_every=10, fanout=1, outer_momentum=1.0)
