"""An accumulator in 8 bits a coordinate: the error feedback of outer steps
(proto/gossip/outer.py) at about half the bytes of bfloat16.

Coordinates are stored as int8 codes in groups of GROUP, each group with one float32 scale
(its largest magnitude over 127), so a coordinate costs 1 + 4/GROUP bytes. Every write rounds
stochastically -- code = floor(127 x / max + u), u uniform in [0, 1) -- so the stored value's
expectation is x exactly (to 2^-16 of a level): small increments on a large sum neither vanish
nor drift, as with `optim.Progress`'s bfloat16. What it gives up against bfloat16: a
coordinate far smaller than the largest of its group is held to an absolute 1/127 of that
largest, not to 8 significant bits of its own. For error feedback that is what matters least:
top-k sends the largest entries, whose relative error is the smallest.

The interface is `optim.Progress`'s: `add` (what an optimiser step moved), `read` / `write`
of any span (a span that cuts a group re-rounds the group's other coordinates, unbiased too),
`values`, `reset`. Pure: no I/O, no clock; randomness from the seed given.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs.kernels import bit_stream, uniform_u16

GROUP = 256  # coordinates per scale: 1 + 4/256 = 1.016 bytes a coordinate
SPAN = 1 << 16  # coordinates converted at once (a multiple of GROUP): the scratch's size
_LEVELS = np.float32(127.0)
_U16 = np.float32(2.0**-16)
_TINY = np.float32(2.0**-100)  # a group whose largest magnitude is below this is scaled up
_UP = np.float32(2.0**100)  # by this before its codes are taken


class Owed8:
    """n float coordinates held as 8-bit codes with a float32 scale per GROUP of them."""

    def __init__(self, n: int, seed: int):
        self.n = int(n)
        groups = -(-self.n // GROUP)
        self.codes = np.zeros(groups * GROUP, np.int8)  # the tail group is padded with zeros
        self.scales = np.zeros(groups, np.float32)
        self.stream = bit_stream(seed)  # the rounding's random bits
        self._wide = np.zeros(min(groups * GROUP, SPAN), np.float32)
        self._draws = np.zeros(self._wide.shape[0], np.float32)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @staticmethod
    def bytes_for(n: int) -> int:
        """The bytes an accumulator of n coordinates holds (what `nbytes` will say)."""
        groups = -(-int(n) // GROUP)
        return groups * (GROUP + 4)

    def _decode(self, a: int, b: int, out: np.ndarray) -> None:
        """out = the values of groups [a, b) (out: float32, (b - a) x GROUP)."""
        rows = out.reshape(b - a, GROUP)
        np.multiply(self.codes[a * GROUP : b * GROUP].reshape(b - a, GROUP),
                    self.scales[a:b, None], out=rows)

    def _encode(self, a: int, b: int, values: np.ndarray) -> None:
        """groups [a, b) = values (float32, (b - a) x GROUP, finite; overwritten)."""
        rows = values.reshape(b - a, GROUP)
        top = np.abs(rows).max(axis=1)
        scale = top / _LEVELS
        tiny = (top < _TINY) & (top > 0)  # 127 / top would overflow to inf (NaN codes): such
        if tiny.any():  # a group is scaled up by a power of two first, its ratios exact
            rows[tiny] *= _UP
            top = np.where(tiny, top * _UP, top)
        rows *= (_LEVELS / np.where(top > 0, top, np.float32(np.inf)))[:, None]  # all-zero: 0
        u = self._draws[: rows.size]
        np.copyto(u, uniform_u16(self.stream, rows.size), casting="unsafe")
        u *= _U16
        values += u
        np.floor(values, out=values)
        np.clip(values, -_LEVELS, _LEVELS, out=values)  # float rounding may reach 127 + u
        np.copyto(self.codes[a * GROUP : b * GROUP], values, casting="unsafe")
        self.scales[a:b] = scale

    def _spans(self, lo: int, hi: int):
        """(lo, hi, first group, end group) pieces of [lo, hi), each inside at most
        SPAN / GROUP whole groups (the scratch holds them)."""
        while lo < hi:
            a = lo // GROUP
            stop = min(hi, (a * GROUP) + SPAN)
            yield lo, stop, a, -(-stop // GROUP)
            lo = stop

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """out[:] = values[lo:hi] (float32)."""
        for s, e, a, b in self._spans(lo, hi):
            wide = self._wide[: (b - a) * GROUP]
            self._decode(a, b, wide)
            out[s - lo : e - lo] = wide[s - a * GROUP : e - a * GROUP]

    def write(self, lo: int, hi: int, src: np.ndarray) -> None:
        """values[lo:hi] = src, rounded stochastically (src is not changed)."""
        self._update(lo, hi, src, add=False)

    def add(self, lo: int, delta: np.ndarray) -> None:
        """values[lo : lo + len(delta)] += delta."""
        self._update(lo, lo + delta.shape[0], delta, add=True)

    def _update(self, lo: int, hi: int, src: np.ndarray, add: bool) -> None:
        for s, e, a, b in self._spans(lo, hi):
            wide = self._wide[: (b - a) * GROUP]
            part = wide[s - a * GROUP : e - a * GROUP]
            whole = part.shape[0] == wide.shape[0]
            if add or not whole:
                self._decode(a, b, wide)
            if add:
                part += src[s - lo : e - lo]
            else:
                part[:] = src[s - lo : e - lo]
            if b * GROUP > self.n:  # the padding stays zero
                wide[self.n - a * GROUP :] = 0.0
            self._encode(a, b, wide)

    def values(self) -> np.ndarray:
        """All n values as a new float32 array."""
        out = np.empty(self.n, np.float32)
        self.read(0, self.n, out)
        return out

    def any(self) -> bool:
        return bool(self.codes.any())

    def reset(self) -> None:
        self.codes.fill(0)
        self.scales.fill(0)
