"""Round-trip properties of each codec: error bounds, exact top-k, unbiasedness, sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from p2ptrain.codecs import CODECS, CODECS_BY_ID, CodecError, codec_from_wire, make_codec
from p2ptrain.codecs import sparse as sparse_module
from p2ptrain.codecs.sparse import RandomK, TopK

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60)

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
vectors = arrays(np.float32, st.integers(0, 3000), elements=finite32)
moderate = arrays(np.float32, st.integers(0, 3000), elements=st.floats(-1e4, 1e4, width=32))

ALL_CODECS = [
    make_codec("none"),
    make_codec("fp16"),
    make_codec("bf16"),
    make_codec("int8"),
    make_codec("int8", block=8),
    make_codec("topk", fraction=0.01),
    make_codec("topk", fraction=0.3, values="bf16"),
    make_codec("topk", fraction=1.0, values="fp32", exact=True),
    make_codec("randomk", fraction=0.05),
    make_codec("randomk", fraction=0.5, values="fp16", scale=True),
    make_codec("qsgd"),
    make_codec("qsgd", levels=1, bucket=64),
    make_codec("qsgd", levels=4, bucket=8),
    make_codec("qsgd", levels=16),
    make_codec("qsgd", levels=300, bucket=128),
]


def gradient_like(seed: int, n: int) -> np.ndarray:
    """Heavy-tailed values with zeros, duplicates and float16 subnormals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, n).astype(np.float32) * np.float32(1e-3)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = np.float32(2e-3)
    return x


# -- registry and parameters --------------------------------------------------------------


def test_registry_is_consistent():
    assert set(CODECS) == {"none", "fp16", "bf16", "int8", "topk", "randomk", "qsgd", "sign"}
    assert {cls.codec_id for cls in CODECS.values()} == set(CODECS_BY_ID)
    for name, cls in CODECS.items():
        assert cls.name == name and CODECS_BY_ID[cls.codec_id] is cls


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_params_round_trip_through_the_header_bytes(codec):
    again = codec_from_wire(codec.codec_id, codec.pack_params())
    wire_params = {k: v for k, v in codec.params().items() if k != "exact"}
    assert {k: v for k, v in again.params().items() if k != "exact"} == wire_params
    assert make_codec(codec.name, **codec.params()) == codec


@pytest.mark.parametrize(
    "name, params",
    [
        ("topk", {"fraction": 0}),
        ("topk", {"values": "int4"}),
        ("int8", {"block": 4}),
        ("qsgd", {"levels": 0}),
        ("qsgd", {"bucket": 12}),
        ("randomk", {"fraction": 1.5}),
    ],
)
def test_bad_parameters_are_refused_locally(name, params):
    with pytest.raises(ValueError):
        make_codec(name, **params)
    with pytest.raises(ValueError):
        make_codec("nonesuch")


def test_bad_wire_parameters_raise_codec_error():
    with pytest.raises(CodecError):
        codec_from_wire(250, bytes(8))
    with pytest.raises(CodecError):
        codec_from_wire(1, b"\x01" + bytes(7))  # fp16 takes no parameters
    with pytest.raises(CodecError):
        codec_from_wire(6, (0).to_bytes(2, "little") + bytes(2) + (4096).to_bytes(4, "little"))
    with pytest.raises(CodecError):  # non-zero padding
        codec_from_wire(4, (10**7).to_bytes(4, "little") + b"\x01\x00\x00\x01")


# -- sizes ----------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(0, 70_000), seed=st.integers(0, 2**64 - 1))
def test_encoded_sizes_are_exact(n, seed):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    for codec in ALL_CODECS:
        payload = codec.encode(x, seed)
        assert len(payload) == codec.encoded_size(n)
        assert codec.decode(payload, n, seed).shape == (n,)


def test_a_kept_topk_value_costs_well_under_8_bytes():
    n = 1 << 20
    for values, most in (("fp16", 4.01), ("bf16", 4.01), ("fp32", 6.01)):
        codec = TopK(fraction=0.01, values=values)
        assert codec.encoded_size(n) / codec.k(n) < most


# -- dense codecs -------------------------------------------------------------------------


@SETTINGS
@given(x=vectors)
def test_none_is_lossless(x):
    codec = make_codec("none")
    np.testing.assert_array_equal(codec.decode(codec.encode(x), x.size), x)


@SETTINGS
@given(x=vectors)
def test_fp16_rounds_to_nearest_and_saturates(x):
    codec = make_codec("fp16")
    y = codec.decode(codec.encode(x), x.size).astype(np.float64)
    xd = x.astype(np.float64)
    inside = np.abs(xd) <= 65504
    nearest = xd[inside].astype(np.float16).astype(np.float64)  # numpy: ties to even
    # Same distance as numpy's round-to-nearest (equal but for ties, which go away from 0).
    np.testing.assert_array_equal(np.abs(y[inside] - xd[inside]), np.abs(nearest - xd[inside]))
    normal = inside & (np.abs(xd) >= 2.0**-14)
    assert np.all(np.abs(y - xd)[normal] <= 2.0**-11 * np.abs(xd[normal]))
    assert np.all(np.abs(y - xd)[inside & ~normal] <= 2.0**-25)
    np.testing.assert_array_equal(y[~inside], np.sign(xd[~inside]) * 65504)


@SETTINGS
@given(x=vectors)
def test_bf16_relative_error(x):
    codec = make_codec("bf16")
    y = codec.decode(codec.encode(x), x.size).astype(np.float64)
    xd = x.astype(np.float64)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - xd) <= np.maximum(2.0**-8 * np.abs(xd), 2.0**-134))


@SETTINGS
@given(x=vectors, block=st.sampled_from([8, 64, 256]))
def test_int8_error_within_half_a_step_of_each_block(x, block):
    codec = make_codec("int8", block=block)
    y = codec.decode(codec.encode(x), x.size).astype(np.float64)
    xd = x.astype(np.float64)
    pad = (-x.size) % block
    absmax = np.abs(np.concatenate([xd, np.zeros(pad)])).reshape(-1, block).max(axis=1)
    bound = np.repeat(absmax / 254 * (1 + 1e-6), block)[: x.size] + 1e-43
    assert np.all(np.abs(y - xd) <= bound)


@SETTINGS
@given(x=moderate, weight=st.floats(-4, 4), seed=st.integers(0, 2**64 - 1))
def test_decode_into_adds_weight_times_decoded(x, weight, seed):
    for codec in ALL_CODECS:
        payload = codec.encode(x, seed)
        base = np.linspace(-1, 1, x.size, dtype=np.float32)
        out = base.copy()
        codec.decode_into(payload, out, weight, seed)
        expect = base + np.float32(weight) * codec.decode(payload, x.size, seed)
        np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)


# -- top-k ----------------------------------------------------------------------------------


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


@SETTINGS
@given(x=vectors, fraction=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]))
def test_exact_topk_keeps_exactly_the_k_largest(x, fraction):
    codec = TopK(fraction=fraction, values="fp32", exact=True)
    k = codec.k(x.size)
    pos = codec.select(x)
    np.testing.assert_array_equal(pos, reference_topk(x, k))
    y = codec.decode(codec.encode(x), x.size)
    assert np.count_nonzero(y) <= k
    np.testing.assert_array_equal(y[pos], x[pos])


@SETTINGS
@given(
    seed=st.integers(0, 2**32),
    n=st.integers(20_000, 300_000),
    fraction=st.sampled_from([0.001, 0.01, 0.05]),
)
def test_sampled_topk_keeps_the_largest(seed, n, fraction):
    x = gradient_like(seed, n)
    codec = TopK(fraction=fraction)
    k = codec.k(n)
    pos = codec.select(x, seed)
    assert pos.size == k and np.all(np.diff(pos) > 0)
    overlap = np.intersect1d(pos, reference_topk(x, k)).size
    assert overlap >= 0.95 * k
    # Our sampled selection is in fact exact: the sample only sets the candidate threshold.
    assert overlap == k


def test_sampled_topk_falls_back_when_the_threshold_is_too_high(monkeypatch):
    monkeypatch.setattr(sparse_module, "_CANDIDATES", 0.25)  # aims at k/4 candidates
    x = gradient_like(3, 200_000)
    codec = TopK(fraction=0.01)
    np.testing.assert_array_equal(codec.select(x, 5), reference_topk(x, codec.k(x.size)))


# -- unbiased codecs ------------------------------------------------------------------------


def mean_of_decodes(codec, x: np.ndarray, draws: int) -> np.ndarray:
    total = np.zeros(x.size, np.float64)
    for seed in range(draws):
        total += codec.decode(codec.encode(x, seed), x.size, seed)
    return total / draws


@pytest.mark.parametrize("levels", [1, 4, 16, 127, 300])
def test_qsgd_is_unbiased(levels):
    x = gradient_like(levels, 1000) * np.float32(50)
    codec = make_codec("qsgd", levels=levels, bucket=256)
    draws = 400
    mean = mean_of_decodes(codec, x, draws)
    norms = np.sqrt(np.add.reduceat(x.astype(np.float64) ** 2, np.arange(0, x.size, 256)))
    step = np.repeat(norms, 256)[: x.size] / levels  # one quantisation level
    assert np.all(np.abs(mean - x) <= 5 * 0.5 * step / np.sqrt(draws) + 1e-9)
    # Aggregate: the mean error is noise (z-score of the sum), not bias.
    z = (mean - x).sum() / np.sqrt(((0.5 * step) ** 2).sum() / draws)
    assert abs(z) < 5


def test_qsgd_single_decode_is_within_one_level():
    x = gradient_like(9, 5000)
    for levels in (1, 7, 127):
        codec = make_codec("qsgd", levels=levels, bucket=512)
        y = codec.decode(codec.encode(x, 1), x.size, 1)
        norms = np.sqrt(np.add.reduceat(x.astype(np.float64) ** 2, np.arange(0, x.size, 512)))
        step = np.repeat(norms * (1 + 2.0**-10), 512)[: x.size] / levels
        assert np.all(np.abs(y - x) <= step * (1 + 1e-5))


def test_randomk_scaled_is_unbiased_and_plain_keeps_values():
    x = gradient_like(4, 1000) + np.float32(0.01)
    codec = RandomK(fraction=0.1, scale=True)
    draws = 2000
    mean = mean_of_decodes(codec, x, draws)
    length = 10  # n/k: every stratum has 10 positions
    std = np.abs(x) * np.sqrt((length - 1) / draws)
    assert np.all(np.abs(mean - x) <= 5 * std + 1e-9)
    plain = RandomK(fraction=0.1)
    y = plain.decode(plain.encode(x, 7), x.size, 7)
    pos, _ = plain.select(x.size, 7)
    assert pos.size == 100 and np.all(np.diff(pos) > 0)
    np.testing.assert_array_equal(y[pos], x[pos])
    assert np.count_nonzero(np.delete(y, pos)) == 0


def test_randomk_positions_cover_every_stratum_uniformly():
    codec = RandomK(fraction=0.25)
    hits = np.zeros(40, np.int64)
    for seed in range(4000):
        pos, lengths = codec.select(40, seed)
        assert np.all(lengths == 4) and np.all(pos // 4 == np.arange(10))
        hits[pos] += 1
    assert np.all(np.abs(hits - 1000) < 5 * np.sqrt(1000 * 0.75))
