"""How `topk` sends its positions: Elias-Fano coding of a strictly increasing list.

k sorted positions in [0, n) are split into low bits (the last L = floor(log2(n/k)) bits of
each, packed back to back) and high parts (position >> L), which travel as a bitmap in
which the i-th set bit sits at high_i + i -- a unary code of the gaps between high parts.
That is at most 2 + log2(n/k) bits per position (1.07 bytes at 1% density against the 2
bytes of 16-bit block offsets), and the size depends on n and k alone:

    ceil(k * L / 8) + ceil((k + ((n - 1) >> L)) / 8) bytes

so a message's length is still known before it is parsed. Low bits come first, then the
bitmap; bits fill each byte from its least significant end, and the padding bits at the end
of each section must be zero (one canonical encoding per list).

This file owns that coding only. The decoder trusts nothing: bit counts, padding, range and
strict increase are checked, and it allocates O(k + n >> L) -- that is O(k) -- memory.
Pure numpy, no I/O, no clock, no randomness.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs.base import CodecError, ceil_div


def low_bits(n: int, k: int) -> int:
    """L: bits of each position sent as is (0 when k = 0 or k > n/2)."""
    if k <= 0 or n <= k:
        return 0
    return (n // k).bit_length() - 1


def _bitmap_bits(n: int, k: int, low: int) -> int:
    return k + ((n - 1) >> low) if k else 0


def coded_size(n: int, k: int) -> int:
    """Bytes of the coded positions of k elements out of n."""
    low = low_bits(n, k)
    return ceil_div(k * low, 8) + ceil_div(_bitmap_bits(n, k, low), 8)


def _bit_rows(values: np.ndarray, width: int) -> np.ndarray:
    """(k, width) uint8 array: the low `width` bits of each non-negative int64, least
    significant first."""
    nbytes = ceil_div(width, 8)
    raw = np.ascontiguousarray(values, "<i8").view(np.uint8).reshape(-1, 8)[:, :nbytes]
    return np.unpackbits(raw, axis=1, bitorder="little")[:, :width]


def _from_bit_rows(bits: np.ndarray) -> np.ndarray:
    """The int64 values whose low bits are the rows of `bits` (inverse of _bit_rows)."""
    k, width = bits.shape
    raw = np.zeros((k, 8), np.uint8)
    raw[:, : ceil_div(width, 8)] = np.packbits(bits, axis=1, bitorder="little")
    return raw.view("<i8").reshape(k).astype(np.int64, copy=False)


def _group_shifts(width: int) -> np.ndarray:
    return np.arange(8, dtype=np.uint64) * np.uint64(width)


def pack_low(values: np.ndarray, width: int) -> np.ndarray:
    """The low `width` bits of each value as one bit stream, least significant first:
    ceil(k * width / 8) bytes. Up to 8 bits, 8 values at a time make one uint64 (8 x width
    bits), written as `width` bytes: a few numpy calls, no per-bit work."""
    k = values.shape[0]
    if width > 8:  # only below 1/512 density, where k is small
        return np.packbits(_bit_rows(values, width).reshape(-1), bitorder="little")
    groups = ceil_div(k, 8)
    padded = np.zeros(groups * 8, np.uint64)
    np.bitwise_and(values, (1 << width) - 1, out=padded[:k], casting="unsafe")
    words = (padded.reshape(groups, 8) << _group_shifts(width)).sum(axis=1, dtype=np.uint64)
    raw = words.astype("<u8", copy=False).view(np.uint8).reshape(groups, 8)[:, :width]
    return raw.reshape(-1)[: ceil_div(k * width, 8)]


def unpack_low(data: np.ndarray, k: int, width: int) -> np.ndarray:
    """The k int64 values of a pack_low stream of exactly ceil(k * width / 8) bytes;
    CodecError if the padding bits of the last byte are not zero."""
    used = k * width
    if used % 8 and int(data[-1]) >> (used % 8):
        raise CodecError("topk: nonzero padding bits after the low position bits")
    if width > 8:
        bits = np.unpackbits(data, count=used, bitorder="little").reshape(k, width)
        return _from_bit_rows(bits)
    groups = ceil_div(k, 8)
    stream = np.zeros(groups * width, np.uint8)
    stream[: data.shape[0]] = data
    raw = np.zeros((groups, 8), np.uint8)
    raw[:, :width] = stream.reshape(groups, width)  # 8 values per row, in 8 x width bits
    words = raw.view("<u8").reshape(groups)
    mask = np.uint64((1 << width) - 1)
    return ((words[:, None] >> _group_shifts(width)) & mask).reshape(-1)[:k].astype(np.int64)


def encode_positions(positions: np.ndarray, n: int, dst: np.ndarray) -> None:
    """Write the strictly increasing int positions (all < n) into the uint8 array `dst` of
    exactly coded_size(n, len(positions)) bytes. The caller vouches for the input."""
    k = positions.shape[0]
    low = low_bits(n, k)
    low_bytes = ceil_div(k * low, 8)
    p = positions.astype(np.int64, copy=False)
    if low:
        dst[:low_bytes] = pack_low(p, low)
    size = _bitmap_bits(n, k, low)
    if size:
        bitmap = np.zeros(size, np.uint8)
        bitmap[(p >> low) + np.arange(k, dtype=np.int64)] = 1
        dst[low_bytes:] = np.packbits(bitmap, bitorder="little")


def decode_positions(data: np.ndarray, n: int, k: int) -> np.ndarray:
    """The validated, strictly increasing int64 positions in [0, n) coded in the uint8 array
    `data` (exactly coded_size(n, k) bytes); CodecError for anything else."""
    if k == 0:
        return np.zeros(0, np.int64)
    low = low_bits(n, k)
    low_bytes = ceil_div(k * low, 8)
    count = _bitmap_bits(n, k, low)
    bitmap = np.unpackbits(data[low_bytes:], bitorder="little")
    if bitmap[count:].any():
        raise CodecError("topk: nonzero padding bits after the position bitmap")
    ones = np.flatnonzero(bitmap[:count].view(bool))  # 7x faster than on uint8
    if ones.shape[0] != k:
        raise CodecError(f"topk: position bitmap holds {ones.shape[0]} entries, expected k={k}")
    pos = (ones - np.arange(k, dtype=np.int64)) << low
    if low:
        pos |= unpack_low(data[:low_bytes], k, low)
    if pos[-1] >= n:
        raise CodecError(f"topk: position {int(pos[-1])} out of range for {n} elements")
    if k > 1 and not (pos[1:] > pos[:-1]).all():
        raise CodecError("topk: positions not strictly increasing")
    return pos
