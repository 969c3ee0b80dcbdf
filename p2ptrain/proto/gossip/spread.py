"""How far one averaging exchange may move a coordinate (averaging.py's clip), from a scale of
the exchange's difference a peer cannot inflate cheaply: its median magnitude.

Until session 30 each coordinate's move was clipped at 128x the exchange's RMS distance, the
figure the distance guard judges. A member holding the key could keep that RMS ordinary
while putting it all on a few coordinates: ten output biases of the byte model went from
-0.07 to -22 in 120 requests, and the victim's wrecked replica was then refused by its
honest peers (its RMS distance to them was now huge), so nothing mended it. Clipped at
SPREAD times the *median* |x_peer - x_self|, a spike moves a coordinate no farther than an
ordinary coordinate's difference allows: to raise the median a peer has to move half the
coordinates, which the guard sees. And the guard judges the RMS of the clipped difference --
the move the exchange would make -- so a replica with a few wrecked coordinates is averaged
with, not refused, and its honest peers pull those back by the same bound per exchange.

When most coordinates agree (exactly: int8 values of close replicas round alike, so the
median is 0; or nearly: fp16 replicas averaged on half their coordinates, a quarter or more
of the values lying beyond SPREAD x the median), the clip is at least the highest p with
p <= FLOOR x the RMS of the difference clipped at p -- the coordinates that differ still move
if they are more than 1 / FLOOR^2 of them, while a few spikes among zeros stay clipped
(their clipped RMS is too small). Only then: as a floor beside the median always, it let
spikes on 1/64 of the coordinates through whole (a review put ten on the output biases and
twenty elsewhere: 26x the drag); a member that wants it must move a quarter of them.

The median is taken from a histogram of the float32 bit patterns of |d| (exponent and two
mantissa bits: four bins an octave), accumulated sub-block by sub-block: no copy of the
difference, one pass, and both sides of an exchange -- whose differences are exact negatives
of each other -- find the same scale and clip alike (the pair's sum is kept). The clipped
difference's RMS is then summed from the clipped values (`clip_sq`). Pure: no I/O, no clock,
no randomness.
"""

from __future__ import annotations

import math

import numpy as np

from p2ptrain.codecs.kernels import blocks, sum_squares

SHIFT = 21  # float32 bits dropped: what is left is the exponent and 2 mantissa bits
BINS = 1 << (31 - SHIFT)  # of |d|'s bit pattern (sign masked): 1024
PER_OCTAVE = 1 << (23 - SHIFT)  # bins per factor of two: 4
INF_BIN = 0x7F800000 >> SHIFT  # bins from here on hold inf (no NaN: inputs are finite)
# a coordinate moves at most this many times the median |difference| (over two, at a pull of
# one half); honest exchanges measured: see BENCHMARKS 11 (session 30)
SPREAD = 64.0
_SPREAD_BINS = PER_OCTAVE * int(math.log2(SPREAD))
FLOOR = 8.0  # the clip is at least this many times the RMS of the clipped difference
# every bin's lower edge, below the infinities (float64: squared without overflow)
_EDGES = (np.arange(INF_BIN, dtype=np.int32) << SHIFT).view(np.float32).astype(np.float64)
_MID_SQ = ((_EDGES + np.append(_EDGES[1:], 2 * _EDGES[-1])) / 2) ** 2  # a bin's middle, squared


class Spread:
    """The histogram of one exchange's |difference|, added to a piece at a time."""

    def __init__(self) -> None:
        self.counts = np.zeros(BINS, np.int64)

    def add(self, d: np.ndarray) -> None:
        """Count the float32 values `d` (finite or inf, never NaN)."""
        for start, stop in blocks(d.shape[0]):
            bins = np.bitwise_and(d[start:stop].view(np.int32), 0x7FFFFFFF)
            np.right_shift(bins, SHIFT, out=bins)
            self.counts += np.bincount(bins, minlength=BINS)

    def peak(self) -> float:
        """The largest move of a coordinate before the pull (inf: none is clipped): SPREAD
        times the upper edge of the bin holding the median, or, when that bin holds 0 or a
        quarter of the values lie beyond, the floor (`_floor_bin`) if higher; a bin edge."""
        total = int(self.counts.sum())
        cum = np.cumsum(self.counts)
        median_bin = int(np.searchsorted(cum, (total + 1) // 2))
        b = min(median_bin + 1 + _SPREAD_BINS, INF_BIN)
        if median_bin == 0 or 4 * (total - int(cum[b - 1])) >= total:  # two kinds of
            b = max(b, self._floor_bin(cum, total))  # coordinates, not a few spikes
        return math.inf if b >= INF_BIN else float(_EDGES[b])

    def _floor_bin(self, cum: np.ndarray, total: int) -> int:
        """The highest bin edge p with p <= FLOOR x the RMS of the difference clipped at p
        (module docstring), each value counted at its bin's middle."""
        if total == 0:
            return 0
        below_sq = np.concatenate(([0.0], np.cumsum(self.counts[: INF_BIN - 1] * _MID_SQ[:-1])))
        above = total - np.concatenate(([0], cum[: INF_BIN - 1]))  # values in bins >= b
        ok = _EDGES * _EDGES * total <= FLOOR * FLOOR * (below_sq + above * _EDGES * _EDGES)
        ok[0] = True
        return int(np.flatnonzero(ok)[-1])


def clip_sq(d: np.ndarray, peak: float) -> float:
    """Clip `d` to [-peak, peak] in place; the sum of squares of the result."""
    if math.isfinite(peak):
        np.clip(d, np.float32(-peak), np.float32(peak), out=d)
    return sum_squares(d)
