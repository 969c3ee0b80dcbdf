"""Sparse codecs: only k = round(fraction * n) elements of a chunk travel.

`topk` keeps the k largest magnitudes. The threshold is estimated from a sample of the chunk
(every s-th element for an odd s, from an offset set by the seed), the elements at or above it
become candidates, and exactly k are chosen among them, as in Deep Gradient Compression; the
sample only sets how much work the exact step does, so the result is the exact top-k (ties go
to the lower index) either way. The values travel first, then the positions, Elias-Fano coded
(positions.py: about 2 + log2(n/k) bits each), so the payload size is a function of n and k
only: k * value bytes + positions.coded_size(n, k).

`randomk` keeps a seeded stratified subset: chunk split into k strata of near-equal length, one
position drawn in each. The decoder regenerates the positions from the seed in the message
header, so only the values travel. Optional unbiased scaling (x stratum length) is applied on
decode; off by default (scaled values put spikes into Adam's moments).

This file owns index selection and value packing for these two codecs. Apart from
`exact=True` and the rare fallback to it, it allocates O(k) plus one sub-block and a byte per
element of per-thread scratch (and O(candidates) when many values tie at the threshold), never
reads the clock or global random state, and never writes the destination before the positions
and values of the whole payload are validated.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from p2ptrain.codecs.base import (
    NON_FINITE_INPUT,
    VALUE_TYPE_NAMES,
    VALUE_TYPES,
    Codec,
    CodecError,
    check_decoded_scale,
)
from p2ptrain.codecs.kernels import (
    BLOCK,
    all_finite,
    bf16_bits_to_f32,
    bit_stream,
    blocks,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    max_abs,
    max_magnitude_bits,
    scratch,
    splitmix64,
)
from p2ptrain.codecs.positions import coded_size, decode_positions, encode_positions

_PPB = 1_000_000_000  # fractions travel as integer parts per billion
_MIN_SAMPLE = 4096  # smallest threshold sample; at least 32/fraction are drawn
_CANDIDATES = 1.5  # aim the sampled threshold at this many times k candidates
_SAMPLED_ABOVE = 192  # sampled values expected above the threshold: its relative error ~7%


def _fraction_ppb(fraction: float) -> int:
    if not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    ppb = round(fraction * _PPB)
    if ppb < 1:
        raise ValueError(f"fraction below 1e-9: {fraction!r}")
    return ppb


def kept_count(n: int, ppb: int) -> int:
    """k for a chunk of n elements: round(n * fraction), at least 1 (if n > 0), at most n."""
    if n == 0:
        return 0
    return min(n, max(1, (n * ppb + _PPB // 2) // _PPB))


def _check_values(values: str) -> int:
    if values not in VALUE_TYPES:
        raise ValueError(f"values must be one of {sorted(VALUE_TYPES)}, got {values!r}")
    return VALUE_TYPES[values][1]


def _pack_values(v: np.ndarray, dst: np.ndarray, values: str) -> None:
    """Write float32 values `v` into the uint8 section `dst` in the wire value type."""
    if values == "fp32":
        np.copyto(dst.view(np.float32), v)
    elif values == "fp16":
        f32_to_f16_bits(v, dst.view(np.uint16))
    else:
        f32_to_bf16_bits(v, dst.view(np.uint16))


def _unpack_values(src: np.ndarray, values: str, what: str) -> np.ndarray:
    """The float32 values of a uint8 section; CodecError if any is not finite."""
    if values == "fp32":
        v = src.view(np.float32)
        if not all_finite(v):
            raise CodecError(f"{what}: non-finite value")
        return v
    bits = src.view(np.uint16)
    out = np.empty(bits.shape[0], np.float32)
    if values == "fp16":
        if max_magnitude_bits(bits) >= 0x7C00:
            raise CodecError(f"{what}: non-finite value")
        f16_bits_to_f32(bits, out)
    else:
        if max_magnitude_bits(bits) >= 0x7F80:
            raise CodecError(f"{what}: non-finite value")
        bf16_bits_to_f32(bits, out)
    return out


_ALL_BELOW = np.uint64(0x0101010101010101)  # eight True bytes


def _candidates(x: np.ndarray, threshold: np.float32) -> np.ndarray:
    """Sorted positions in a chunk where |x| >= threshold, or is NaN.

    np.flatnonzero costs ~20 ns per hit at 2% density, so scan 8-byte words of the mask
    "|x| < threshold" first and look inside the few words that hold a candidate. The mask is
    built sub-block by sub-block but scanned whole: fewer, larger numpy calls.
    """
    n = x.shape[0]
    padded = -(-n // 8) * 8
    magnitude = scratch("topk_abs", min(n, BLOCK), np.float32)
    below = scratch("topk_mask", padded, bool)
    for start, stop in blocks(n):
        m = magnitude[: stop - start]
        np.abs(x[start:stop], out=m)
        np.less(m, threshold, out=below[start:stop])
    below[n:] = True
    words = below.view(np.uint64)
    hit_words = np.flatnonzero(words != _ALL_BELOW)
    inside = np.flatnonzero(words[hit_words].view(np.uint8) == 0)
    return hit_words[inside >> 3] * 8 + (inside & 7)


def _finite_abs(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    if a.size and not np.isfinite(a.max()):
        raise ValueError(NON_FINITE_INPUT)
    return a


def _top_among(candidates: np.ndarray | None, magnitude: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the k largest magnitudes (ties: lowest position first) among the
    candidates (sorted positions; None means all of 0..len-1)."""
    m = magnitude.shape[0]
    if m == k:
        keep = np.ones(m, bool)
    else:
        kth = np.partition(magnitude, m - k)[m - k]
        keep = magnitude > kth
        missing = k - int(np.count_nonzero(keep))
        if missing:
            keep[np.flatnonzero(magnitude == kth)[:missing]] = True
    kept = np.flatnonzero(keep)  # then a take: faster than boolean indexing
    return kept if candidates is None else candidates[kept]


@dataclass(frozen=True, slots=True)
class TopK(Codec):
    """The k = round(fraction * n) largest magnitudes: values in `values` (2 bytes for
    fp16/bf16), then positions Elias-Fano coded (1.07 bytes each at 1%)."""

    fraction: float = 0.01  # share of elements kept, in (0, 1]
    values: str = "fp16"  # wire type of the kept values: "fp16", "bf16" or "fp32"
    exact: bool = False  # full partition instead of a sampled threshold: same result, slower
    _ppb: int = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "topk"
    codec_id: ClassVar[int] = 4
    biased: ClassVar[bool] = True
    checks_finite: ClassVar[bool] = True  # on the magnitudes it computes anyway

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ppb", _fraction_ppb(self.fraction))
        _check_values(self.values)
        if not isinstance(self.exact, bool):
            raise ValueError("exact must be a bool")

    def pack_params(self) -> bytes:
        return struct.pack("<IB3x", self._ppb, VALUE_TYPES[self.values][0])

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        ppb, code = struct.unpack("<IB3x", raw)
        values = VALUE_TYPE_NAMES.get(code)
        if values is None or not 1 <= ppb <= _PPB:
            raise CodecError(f"topk: bad parameters (fraction {ppb}e-9, value type {code})")
        return cls._checked_unpack(raw, fraction=ppb / _PPB, values=values)

    def k(self, n: int) -> int:
        """Elements kept from a chunk of n."""
        return kept_count(n, self._ppb)

    def encoded_size(self, n: int) -> int:
        k = self.k(n)
        return k * VALUE_TYPES[self.values][1] + coded_size(n, k)

    def select(self, x: np.ndarray, seed: int = 0) -> np.ndarray:
        """Sorted positions of the k largest magnitudes of chunk x (what `encode` keeps)."""
        n, k = x.shape[0], self.k(x.shape[0])
        sample = min(n, max(_MIN_SAMPLE, math.ceil(32 * _PPB / self._ppb)))
        if self.exact or k == n or 4 * sample >= n:
            return _top_among(None, _finite_abs(x), k)
        # A strided sample costs a fifth of a random one; an odd stride does not alias the
        # power-of-two row lengths of gradients (and a bad sample only costs time).
        share = min(1.0, _CANDIDATES * k / n)  # of the chunk above the threshold aimed at
        sample = min(n // 4, max(sample, math.ceil(_SAMPLED_ABOVE / share)))
        stride = (n - 1) // (sample - 1)
        stride -= 1 - stride % 2
        offset = splitmix64(seed) % (n - stride * (sample - 1))
        sampled = np.abs(x[offset : offset + stride * (sample - 1) + 1 : stride])
        rank = sample - math.ceil(sample * share)  # sampled values >= threshold: the rest
        threshold = np.partition(sampled, rank)[rank]
        candidates = _candidates(x, threshold)
        if candidates.shape[0] < k:  # the sample overestimated the threshold (rare)
            return _top_among(None, _finite_abs(x), k)
        magnitude = _finite_abs(x[candidates])  # inf and NaN are always candidates
        return _top_among(candidates, magnitude, k)

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        k = self.k(x.shape[0])
        split = k * VALUE_TYPES[self.values][1]
        positions = self.select(x, seed)
        _pack_values(x[positions], dst[:split], self.values)
        encode_positions(positions, x.shape[0], dst[split:])

    def _parse(self, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Validated (positions, float32 values) of a payload for a chunk of n."""
        k = self.k(n)
        split = k * VALUE_TYPES[self.values][1]
        pos = decode_positions(data[split:], n, k)
        return pos, _unpack_values(data[:split], self.values, "topk")

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        pos, vals = self._parse(data, out.shape[0])
        check_decoded_scale(max_abs(vals), weight, "topk")
        out[pos] += vals * np.float32(weight)

    def sq_norm(self, payload, n: int, seed: int = 0) -> float:
        _, vals = self._parse(self.payload_view(payload, n), n)
        return float(np.dot(vals.astype(np.float64), vals))


@dataclass(frozen=True, slots=True)
class RandomK(Codec):
    """k = round(fraction * n) elements at seeded stratified positions; only values travel."""

    fraction: float = 0.01  # share of elements kept, in (0, 1]
    values: str = "fp32"  # wire type of the values: "fp32", "fp16" or "bf16"
    scale: bool = False  # multiply decoded values by 1/P(kept) (unbiased, but spiky)
    _ppb: int = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "randomk"
    codec_id: ClassVar[int] = 5

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ppb", _fraction_ppb(self.fraction))
        _check_values(self.values)
        if not isinstance(self.scale, bool):
            raise ValueError("scale must be a bool")

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return not self.scale

    def pack_params(self) -> bytes:
        return struct.pack("<IBB2x", self._ppb, VALUE_TYPES[self.values][0], int(self.scale))

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        ppb, code, scale = struct.unpack("<IBB2x", raw)
        values = VALUE_TYPE_NAMES.get(code)
        if values is None or not 1 <= ppb <= _PPB or scale > 1:
            raise CodecError(f"randomk: bad parameters ({ppb}e-9, type {code}, scale {scale})")
        return cls._checked_unpack(raw, fraction=ppb / _PPB, values=values, scale=bool(scale))

    def k(self, n: int) -> int:
        """Elements kept from a chunk of n."""
        return kept_count(n, self._ppb)

    def encoded_size(self, n: int) -> int:
        return self.k(n) * VALUE_TYPES[self.values][1]

    def select(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, stratum lengths) for a chunk of n: stratum j is [j*n//k, (j+1)*n//k),
        and its position is drawn from the top 32 bits of the j-th raw draw of the seed."""
        k = self.k(n)
        bounds = (np.arange(k + 1, dtype=np.uint64) * np.uint64(n)) // np.uint64(max(k, 1))
        lengths = bounds[1:] - bounds[:-1]
        draws = bit_stream(seed).random_raw(k) >> np.uint64(32)
        positions = bounds[:-1] + ((draws * lengths) >> np.uint64(32))
        return positions.astype(np.intp), lengths

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        positions, _ = self.select(x.shape[0], seed)
        _pack_values(x[positions], dst, self.values)

    def _parse(self, data: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Validated (positions, decoded float32 values) of a payload for a chunk of n."""
        vals = _unpack_values(data, self.values, "randomk")
        positions, lengths = self.select(n, seed)
        if self.scale:
            with np.errstate(over="ignore"):  # an overflow is refused by the caller
                vals = vals * lengths.astype(np.float32)
        return positions, vals

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        positions, vals = self._parse(data, out.shape[0], seed)
        check_decoded_scale(max_abs(vals), weight, "randomk")
        out[positions] += vals * np.float32(weight)

    def sq_norm(self, payload, n: int, seed: int = 0) -> float:
        _, vals = self._parse(self.payload_view(payload, n), n, seed)
        check_decoded_scale(max_abs(vals), 1.0, "randomk")
        return float(np.dot(vals.astype(np.float64), vals))
