"""Numeric kernels shared by the codecs: float16/bfloat16 bit conversions, finiteness checks,
sub-block iteration and seeded bit streams.

Everything here works on caller-provided numpy buffers in sub-blocks of `BLOCK` elements, so
temporaries stay in cache (FIELD-NOTES: numpy's own float16 cast runs at ~0.05x memcpy, these
integer-op versions at ~0.25x encode / ~0.5x decode). Temporaries come from `scratch`, a
per-thread cache of reusable buffers: a fresh megabyte-sized numpy array costs hundreds of page
faults on every call on our VMs, as much as the work itself. This file never reads the clock,
never draws from global random state, never starts threads and never does I/O.

Byte order: these kernels view float32 as uint32/uint16 pairs and assume a little-endian host
(x86-64 and aarch64 are); importing on a big-endian host fails loudly.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import numpy as np

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("p2ptrain.codecs assumes a little-endian host")

# Elements per sub-block of the blocked kernels (1 MiB of float32). Measured on our EPYCs
# (512 KiB L2, 32 MiB L3): 2^18 beats 2^16..2^17, whose per-call numpy overhead costs more
# than the cache misses they avoid.
BLOCK = 1 << 18

F16_MAX = 65504.0  # largest finite float16
_F16_SCALE_DOWN = np.float32(2.0**-112)  # moves the float16 exponent range onto float32's bottom
_F16_SCALE_UP = 2.0**112
_MASK64 = (1 << 64) - 1


_SCRATCH = threading.local()  # slot name -> uint8 buffer, per thread


def scratch(slot: str, n: int, dtype: np.dtype | type) -> np.ndarray:
    """A reusable temporary array of n elements for the calling thread (contents undefined).
    Each live temporary needs its own slot name; never return a scratch array to a caller."""
    dt = np.dtype(dtype)
    nbytes = n * dt.itemsize
    buf = _SCRATCH.__dict__.get(slot)
    if buf is None or buf.shape[0] < nbytes:
        buf = np.empty(max(nbytes, 64), np.uint8)
        _SCRATCH.__dict__[slot] = buf
    return buf[:nbytes].view(dt)


def blocks(n: int, block: int = BLOCK) -> Iterator[tuple[int, int]]:
    """(start, stop) pairs covering range(n) in steps of `block`."""
    for start in range(0, n, block):
        yield start, min(n, start + block)


def bucket_blocks(n: int, bucket: int) -> Iterator[tuple[int, int]]:
    """(start, stop) pairs covering range(n): sub-blocks of whole buckets (about `BLOCK`
    elements each), then the final partial bucket on its own."""
    whole = n - n % bucket
    yield from blocks(whole, bucket * max(1, BLOCK // bucket))
    if whole < n:
        yield whole, n


def all_finite(a: np.ndarray) -> bool:
    """True if every element of the float array is finite, in one read-only pass.

    The sum of finite values is finite unless it overflows, and inf/NaN always poison the sum,
    so a finite sum proves the array is finite; only an overflowing sum needs the exact check.
    """
    if a.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(a)):
            return True
    flat = a.reshape(-1)  # a piece at a time: no bool copy of the whole
    return all(bool(np.isfinite(flat[i : i + (1 << 20)]).all())
               for i in range(0, flat.shape[0], 1 << 20))


def finite_norm(a: np.ndarray) -> bool:
    """True if every element of the float32 vector is finite *and* its squared norm does not
    overflow float32 (what the mixer and the optimiser's clip compute): a gradient of finite
    but huge elements (a run blowing up at a moderate learning rate) is as unusable as one
    holding inf. One BLAS pass."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.dot(a, a)))


def max_abs(a: np.ndarray) -> float:
    """Largest magnitude in a float array (NaN if it holds a NaN); 0.0 for an empty array."""
    if a.size == 0:
        return 0.0
    return float(max(np.max(a), -np.min(a)))


def sum_squares(a: np.ndarray) -> float:
    """Sum of squares of a float array, sub-block by sub-block (inf when it overflows)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return sum((float(np.dot(a[i:j], a[i:j])) for i, j in blocks(a.shape[0])), 0.0)


def f32_to_f16_bits(x: np.ndarray, out: np.ndarray) -> None:
    """float32 -> float16 bit patterns (uint16), round to nearest with ties away from zero,
    saturating at +-65504; float16 subnormals are rounded exactly like normals.

    Trick: scaling |x| by 2^-112 puts the float16 exponent range at the bottom of float32's, so
    the float16 pattern is the float32 pattern shifted right by 13 bits (subnormals included),
    and adding half of the dropped range before the shift rounds it.
    """
    n = x.shape[0]
    temp = scratch("f16enc", min(n, BLOCK), np.float32)
    bits = temp.view(np.uint32)
    halves = x.view(np.uint16)  # (low, high) pairs; the high half holds the sign
    for start, stop in blocks(n):
        a, b, o = temp[: stop - start], bits[: stop - start], out[start:stop]
        np.abs(x[start:stop], out=a)
        np.minimum(a, np.float32(F16_MAX), out=a)
        np.multiply(a, _F16_SCALE_DOWN, out=a)
        np.add(b, np.uint32(0x1000), out=b)
        np.right_shift(b, np.uint32(13), out=b)
        np.bitwise_and(halves[2 * start + 1 : 2 * stop : 2], np.uint16(0x8000), out=o)
        np.bitwise_or(o, b, out=o, casting="unsafe")


def max_magnitude_bits(h: np.ndarray) -> int:
    """Largest `pattern & 0x7FFF` over a uint16 array of float16/bfloat16 patterns: the bits
    of the largest magnitude (>= 0x7C00 means a float16 inf/NaN, >= 0x7F80 a bfloat16 one)."""
    if h.size == 0:
        return 0
    temp = scratch("maxbits", min(h.shape[0], BLOCK), np.uint16)
    top = 0
    for start, stop in blocks(h.shape[0]):
        s = temp[: stop - start]
        np.bitwise_and(h[start:stop], np.uint16(0x7FFF), out=s)
        top = max(top, int(s.max()))
    return top


def f16_bits_to_f32(h: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    """out[:] = scale * float16(h) for a uint16 array of finite patterns (check them first:
    infinities and NaNs come out as finite garbage). `out` is a float32 array of h's length."""
    hs = h.view(np.int16)
    ints = out.view(np.int32)
    one_step = abs(scale) <= 2.0**14  # 2^112 * scale still a finite float32
    factor = np.float32(_F16_SCALE_UP * scale if one_step else _F16_SCALE_UP)
    for start, stop in blocks(h.shape[0]):
        v, f = ints[start:stop], out[start:stop]
        # Sign-extend into bits 31..28, magnitude to bits 27..13, then clear bits 30..28.
        np.left_shift(hs[start:stop], 16, out=v, dtype=np.int32)
        np.right_shift(v, 3, out=v)
        np.bitwise_and(v, np.int32(-0x70000001), out=v)
        np.multiply(f, factor, out=f)
        if not one_step:
            np.multiply(f, np.float32(scale), out=f)


def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest with ties away from zero,
    saturating at the largest finite bfloat16 (input must be finite)."""
    n = x.shape[0]
    bits_in = x.view(np.uint32)
    temp = scratch("bf16enc", min(n, BLOCK), np.uint32)
    for start, stop in blocks(n):
        s, o = temp[: stop - start], out[start:stop]
        np.add(bits_in[start:stop], np.uint32(0x8000), out=s)
        np.copyto(o, s.view(np.uint16)[1::2])
        # Only |x| within 0.4% of float32's max rounds up to infinity: clamp those (rare).
        magnitude = s.view(np.uint16)[: stop - start]
        np.bitwise_and(o, np.uint16(0x7FFF), out=magnitude)
        if magnitude.max() >= 0x7F80:
            o[magnitude == np.uint16(0x7F80)] -= np.uint16(1)


def bf16_bits_to_f32(h: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    """out[:] = scale * bfloat16(h); `out` is a float32 array of h's length."""
    bits = out.view(np.uint32)
    for start, stop in blocks(h.shape[0]):
        np.left_shift(h[start:stop], 16, out=bits[start:stop], dtype=np.uint32)
        if scale != 1.0:
            np.multiply(out[start:stop], np.float32(scale), out=out[start:stop])


def f32_to_bf16_stochastic(x: np.ndarray, out: np.ndarray, stream: np.random.SFC64) -> None:
    """float32 -> bfloat16 bit patterns (uint16) rounded stochastically: up in magnitude with
    probability equal to the dropped fraction, so the expected value is x exactly. An
    accumulator of small increments kept in 16 bits this way neither stalls (an increment
    below half a unit in the last place would vanish under round-to-nearest) nor drifts.
    The input must be finite and well below float32's maximum."""
    n = x.shape[0]
    bits_in = x.view(np.uint32)
    temp = scratch("bf16sr", min(n, BLOCK), np.uint32)
    for start, stop in blocks(n):
        s = temp[: stop - start]
        np.copyto(s, uniform_u16(stream, stop - start), casting="unsafe")
        s += bits_in[start:stop]
        np.copyto(out[start:stop], s.view(np.uint16)[1::2])


def splitmix64(z: int) -> int:
    """One step of the SplitMix64 mixer: a well-spread 64-bit value from any 64-bit value."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def chunk_seed(seed: int, index: int) -> int:
    """The 64-bit seed of chunk `index` of a vector encoded with `seed`."""
    return splitmix64((seed & _MASK64) ^ splitmix64(index & _MASK64))


def bit_stream(seed: int) -> np.random.SFC64:
    """The bit generator every codec draws from. SFC64's raw stream is fixed by numpy's
    stability policy (NEP 19), so a decoder on another numpy version regenerates the same
    draws from the same seed; only `random_raw` is used, never Generator methods."""
    return np.random.SFC64(seed & _MASK64)


def uniform_u16(stream: np.random.SFC64, n: int) -> np.ndarray:
    """n uniform uint16 draws (16 random bits each) from the raw stream."""
    return stream.random_raw(-(-n // 4)).view(np.uint16)[:n]
