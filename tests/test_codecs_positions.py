"""The Elias-Fano coding of topk's positions: exact round trip, the size formula that the
message length relies on, the bits-per-position it promises, and refusal of lists a decoder
must not accept."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.codecs import CodecError
from p2ptrain.codecs.positions import (
    coded_size,
    decode_positions,
    encode_positions,
    low_bits,
    pack_low,
    unpack_low,
)
from p2ptrain.codecs.registry import make_codec


def coded(positions: np.ndarray, n: int) -> np.ndarray:
    dst = np.full(coded_size(n, positions.shape[0]), 0xAA, np.uint8)  # no stale zeros help
    encode_positions(positions, n, dst)
    return dst


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), max_size=n))))
def test_any_sorted_set_round_trips(case):
    n, chosen = case
    positions = np.array(sorted(chosen), np.int64)
    back = decode_positions(coded(positions, n), n, positions.shape[0])
    np.testing.assert_array_equal(back, positions)


@pytest.mark.parametrize("n,k", [(1, 0), (1, 1), (2, 1), (7, 7), (1000, 1), (1000, 999),
                                 (1 << 20, 10486), (921_664, 9217), (3, 2)])
def test_edges_and_sizes(n, k):
    rng = np.random.default_rng(n + k)
    positions = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    data = coded(positions, n)
    low = low_bits(n, k)
    bitmap_bits = k + ((n - 1) >> low) if k else 0
    assert data.shape[0] == math.ceil(k * low / 8) + math.ceil(bitmap_bits / 8)
    np.testing.assert_array_equal(decode_positions(data, n, k), positions)
    if k:  # at most 2 + log2(n / k) bits per position, plus the two sections' padding
        assert 8 * data.shape[0] <= k * (2 + math.log2(n / k)) + 16


def test_topk_one_percent_is_over_100x_smaller_than_fp32():
    codec = make_codec("topk", fraction=0.01)  # fp16 values
    for n in (1 << 20, 921_664, 100_000):
        assert 4 * n / codec.encoded_size(n) > 125


def test_refusals():
    n, positions = 1000, np.array([3, 70, 71, 500, 999], np.int64)
    good = coded(positions, n)
    low = low_bits(n, 5)  # 7: 35 low bits in 5 bytes, then 5 + 7 bitmap bits in 2 bytes
    assert (low, good.shape[0]) == (7, 7)
    bad = good.copy()
    bad[4] |= 0x80  # a padding bit of the low bits
    with pytest.raises(CodecError, match="padding"):
        decode_positions(bad, n, 5)
    bad = good.copy()
    bad[6] |= 0x80  # a padding bit of the bitmap
    with pytest.raises(CodecError, match="padding"):
        decode_positions(bad, n, 5)
    four = coded(positions[:4], n)  # k = 4: 28 low bits in 4 bytes, 4 + 7 bitmap bits
    bitmap = np.unpackbits(four[4:], bitorder="little")
    bitmap[np.flatnonzero(bitmap[:11] == 0)[0]] = 1
    four[4:] = np.packbits(bitmap, bitorder="little")
    with pytest.raises(CodecError, match="holds 5 entries, expected k=4"):
        decode_positions(four, n, 4)
    equal = coded(np.array([3, 70, 70, 500, 999], np.int64), n)
    with pytest.raises(CodecError, match="increasing"):
        decode_positions(equal, n, 5)
    beyond = coded(np.array([3, 70, 71, 500, 1020], np.int64), 1024)  # same layout as n=1000
    assert beyond.shape[0] == coded_size(1000, 5)
    with pytest.raises(CodecError, match="out of range"):
        decode_positions(beyond, n, 5)


@pytest.mark.parametrize("width", range(1, 17))
def test_low_bit_stream_is_one_lsb_first_bit_stream(width):
    """The word-at-a-time packer (widths up to 8) writes the same stream as bit by bit."""
    values = np.random.default_rng(width).integers(0, 1 << 40, 1001)
    bits = [(int(v) >> b) & 1 for v in values for b in range(width)]
    expected = np.packbits(np.array(bits, np.uint8), bitorder="little")
    packed = pack_low(values, width)
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(unpack_low(packed, 1001, width), values & ((1 << width) - 1))
