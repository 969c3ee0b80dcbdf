"""The clip of an averaging exchange's moves (spread.py): SPREAD x the median |difference|,
found from a histogram of bit patterns, and the RMS of the clipped difference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from p2ptrain.proto.gossip.spread import SPREAD, Spread, clip_sq


def _spread(d: np.ndarray, pieces: int = 1) -> Spread:
    s = Spread()
    for piece in np.array_split(d, pieces):
        s.add(piece)
    return s


def _clipped_rms(d: np.ndarray, peak: float) -> float:
    c = np.clip(d.astype(np.float64), -peak, peak)
    return float(np.sqrt(np.mean(c * c)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_peak_is_spread_times_the_median_within_a_bin(seed):
    rng = np.random.default_rng(seed)
    d = (rng.standard_normal(100_003) * 10.0 ** rng.uniform(-6, 2)).astype(np.float32)
    median = float(np.median(np.abs(d)))
    s = _spread(d)
    assert SPREAD * median <= s.peak() <= SPREAD * median * 1.25 * (1 + 1e-6)
    peak = s.peak()
    sq = clip_sq(d, peak)
    assert float(np.abs(d).max()) <= peak
    assert math.sqrt(sq / d.shape[0]) == pytest.approx(_clipped_rms(d, peak), rel=1e-6)


def test_a_few_huge_values_are_clipped_and_counted_clipped():
    rng = np.random.default_rng(4)
    d = (rng.standard_normal(10_000) * 0.01).astype(np.float32)
    plain_rms = float(np.sqrt(np.mean(d.astype(np.float64) ** 2)))
    d[:10] = 50.0  # RMS 1.6 unclipped: the spike would dominate any RMS judgement
    peak = _spread(d).peak()
    assert peak < 1.0
    assert math.sqrt(clip_sq(d, peak) / d.shape[0]) < 2 * plain_rms


def test_both_sides_of_an_exchange_find_the_same_scale_whatever_the_pieces():
    rng = np.random.default_rng(5)
    d = (rng.standard_normal(300_001) * 0.3).astype(np.float32)
    d[:3] = 1e3  # (with a few clipped)
    a, b = _spread(d, 1), _spread(-d, 7)
    assert a.peak() == b.peak() < 1e3


def test_zeros_infinities_and_nothing():
    assert Spread().peak() < 1e-35
    assert _spread(np.zeros(1000, np.float32)).peak() < 1e-35
    d = np.full(10, np.inf, np.float32)  # (mine - peer overflowed): nothing is clipped
    assert _spread(d).peak() == math.inf and clip_sq(d, math.inf) == math.inf
    mostly = np.ones(1000, np.float32)
    mostly[0] = np.inf  # one infinity among ordinary values is clipped like any spike
    peak = _spread(mostly).peak()
    assert peak == pytest.approx(SPREAD * 1.25, rel=1e-6)
    assert math.isfinite(clip_sq(mostly, peak))


def test_when_most_coordinates_agree_exactly_the_few_that_differ_still_move():
    """int8 values of close replicas round alike: the median difference is 0, and the
    coordinates a quantum apart (5% here) must still move; a few spikes among zeros (0.5%,
    under 1 / FLOOR^2) stay clipped."""
    rng = np.random.default_rng(6)
    d = np.zeros(100_000, np.float32)
    some = rng.choice(d.shape[0], 5_000, replace=False)
    d[some] = np.float32(0.004) * rng.choice([-1, 1], some.shape[0])
    assert _spread(d).peak() > 0.004  # not clipped
    spikes = np.zeros(100_000, np.float32)
    spikes[rng.choice(d.shape[0], 500, replace=False)] = 3.0
    assert _spread(spikes).peak() < 1e-30


def test_spikes_on_a_sixty_fourth_of_the_coordinates_are_clipped_at_the_median_scale():
    """The floor (for a median of 0) beside the median let spikes on 1/64 of the
    coordinates through whole (a review: ten on the output biases and twenty elsewhere)."""
    rng = np.random.default_rng(7)
    d = (rng.standard_normal(1_000) * 0.01).astype(np.float32)
    median = float(np.median(np.abs(d)))
    d[rng.choice(d.shape[0], 30, replace=False)] = 2.0  # 3% of them, RMS ~0.35
    assert _spread(d).peak() <= SPREAD * median * 1.25 * 1.1  # ~0.5, not 2
