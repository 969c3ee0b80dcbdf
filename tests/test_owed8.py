"""The outer steps' error feedback in 8 bits (p2ptrain/owed8.py): unbiased stochastic
rounding, spans that cut a group, the padding of the last group, and the bytes it takes."""

from __future__ import annotations

import numpy as np

from p2ptrain.owed8 import GROUP, SPAN, Owed8


def test_small_increments_add_up_without_bias():
    """Increments 1000x below a level of the group (1/127 of its largest) still add up."""
    n = 4096
    o = Owed8(n, seed=1)
    o.add(0, np.full(n, 1.0, np.float32))
    for _ in range(500):
        o.add(0, np.full(n, 1e-5, np.float32))
    got = o.values()
    assert abs(float(got.mean()) - 1.005) < 5e-4, got.mean()


def test_a_write_is_within_a_level_and_unbiased():
    n = 50_000
    rng = np.random.default_rng(2)
    x = (rng.normal(size=n) * np.repeat(rng.uniform(0.1, 10, -(-n // GROUP)), GROUP)[:n]
         ).astype(np.float32)
    o = Owed8(n, seed=3)
    total = np.zeros(n, np.float64)
    for _ in range(200):
        o.write(0, n, x)
        total += o.values()
    levels = np.repeat(np.abs(x[: n // GROUP * GROUP]).reshape(-1, GROUP).max(axis=1) / 127,
                       GROUP)
    one = o.values()
    assert np.all(np.abs(one[: levels.shape[0]] - x[: levels.shape[0]]) <= levels * 1.0001)
    err = total / 200 - x  # the mean of 200 roundings: within ~level / sqrt(200) / 2
    assert np.all(np.abs(err[: levels.shape[0]]) < 0.25 * levels)
    assert abs(float(err.mean())) < 1e-3 * float(levels.mean())


def test_spans_that_cut_groups_leave_the_rest_as_it_was():
    """A write or add of an unaligned span longer than SPAN changes that span only; the
    other coordinates of the groups it cuts keep their values (to their level)."""
    n = 3 * SPAN + 123  # the last group is partly padding
    rng = np.random.default_rng(4)
    x = rng.normal(size=n).astype(np.float32)
    o = Owed8(n, seed=5)
    o.write(0, n, x)
    before = o.values()
    lo, hi = GROUP // 3, SPAN + 5 * GROUP + 7
    delta = rng.normal(size=hi - lo).astype(np.float32)
    o.add(lo, delta)
    after = o.values()
    level = np.abs(x).max() / 127 * 1.01
    assert np.all(np.abs(after[lo:hi] - (before[lo:hi] + delta)) <= 2 * level)
    untouched = np.r_[0:lo, hi:n]
    assert np.all(np.abs(after[untouched] - before[untouched]) <= level)
    assert np.array_equal(after[hi + GROUP:], before[hi + GROUP:])  # whole groups not touched
    part = np.empty(hi - lo, np.float32)
    o.read(lo, hi, part)
    np.testing.assert_array_equal(part, after[lo:hi])
    o.write(n - 50, n, np.full(50, 3.0, np.float32))  # the tail: padding stays zero
    assert not o.codes[n:].any()
    np.testing.assert_allclose(o.values()[n - 50:], 3.0, rtol=0.02)


def test_it_takes_a_byte_a_coordinate_and_resets():
    n = 1_000_000
    o = Owed8(n, seed=6)
    assert n <= o.nbytes == Owed8.bytes_for(n) <= 1.02 * n + GROUP
    o.add(0, np.ones(n, np.float32))
    assert o.any()
    o.reset()
    assert not o.any() and not o.values().any()


def test_a_group_of_tiny_values_keeps_them_without_warnings():
    """127 / max overflowed to inf for a group whose largest magnitude is below ~3.7e-37: its
    zeros became NaN codes (cast to int8) and its small values jumped to +-max, with three
    RuntimeWarnings on stderr. (Honest progress reaches it on a group of parameters that has
    seen hundreds of zero gradients.)"""
    import warnings

    acc = Owed8(512, 3)
    src = np.zeros(512, np.float32)
    src[:3] = [1e-38, -5e-39, 0.0]
    src[256:259] = [1.0, 0.5, -0.25]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.write(0, 512, src.copy())
        got = acc.values()
    assert got[2] == 0.0 and np.all(got[3:256] == 0.0)
    assert abs(got[0] - 1e-38) <= 1e-38 / 127 * 1.01 and abs(got[1] + 5e-39) <= 1e-38 / 127 * 1.01
    assert np.allclose(got[256:259], src[256:259], atol=1.0 / 127)
