"""The scaled-sign codec: exact round trips against a reference, sizes, weights, partial
buckets, every refusal reason, the generic codec contract (header, wire, fuzzing) and the
energy it keeps."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from p2ptrain.codecs import (
    CODECS,
    CODECS_BY_ID,
    HEADER_SIZE,
    CodecError,
    ErrorFeedback,
    codec_from_wire,
    decode_message,
    encode_vector,
    make_codec,
    parse_message,
    total_encoded_size,
)
from p2ptrain.codecs.kernels import BLOCK
from p2ptrain.codecs.sign import ScaledSign

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60)
SIZES = [0, 1, 7, 8, 1023, 1024, 1025, 5000]
BUCKETS = [8, 24, 1024, 65536]
SENDER = bytes(range(16))

moderate = arrays(np.float32, st.integers(0, 3000), elements=st.floats(-1e4, 1e4, width=32))
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def gaussian(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def reference(x: np.ndarray, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, sign bytes) computed the obvious way."""
    n = x.size
    starts = np.arange(0, n, bucket)
    mag = np.abs(x.astype(np.float64))
    counts = np.diff(np.append(starts, n))
    scales = (np.add.reduceat(mag, starts) / counts).astype(np.float32) if n else mag[:0]
    return scales.astype(np.float32), np.packbits(x < 0, bitorder="little")


def split(codec: ScaledSign, payload, n: int) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer(bytes(payload), np.uint8)
    nb = -(-n // codec.bucket)
    return data[: 4 * nb].view(np.float32), data[4 * nb :]


def expected_decode(scales: np.ndarray, x: np.ndarray, bucket: int) -> np.ndarray:
    per_element = np.repeat(scales, bucket)[: x.size]
    return np.where(x < 0, -per_element, per_element).astype(np.float32)


# -- registry and parameters ----------------------------------------------------------------


def test_registered_under_its_name_and_id():
    assert CODECS["sign"] is ScaledSign and CODECS_BY_ID[7] is ScaledSign
    assert ScaledSign.biased and make_codec("sign") == ScaledSign(bucket=1024)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_params_round_trip_through_the_header_bytes(bucket):
    codec = make_codec("sign", bucket=bucket)
    raw = codec.pack_params()
    assert raw == struct.pack("<I4x", bucket)
    assert codec_from_wire(ScaledSign.codec_id, raw) == codec
    assert make_codec("sign", **codec.params()) == codec


@pytest.mark.parametrize("bucket", [0, 4, 12, 1020, 65544, 1 << 20, 8.0, "64", None])
def test_bad_parameters_are_refused_locally(bucket):
    with pytest.raises(ValueError):
        make_codec("sign", bucket=bucket)


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack("<I4x", 0),
        struct.pack("<I4x", 12),
        struct.pack("<I4x", 65544),
        struct.pack("<I4x", 2**32 - 1),
        struct.pack("<I4B", 1024, 0, 0, 0, 1),  # non-zero padding
        struct.pack("<I4B", 1024, 1, 0, 0, 0),
    ],
)
def test_bad_wire_parameters_raise_codec_error(raw):
    with pytest.raises(CodecError) as info:
        codec_from_wire(ScaledSign.codec_id, raw)
    assert info.value.reason.startswith("sign:")


# -- sizes and exact round trips ------------------------------------------------------------


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("n", SIZES)
def test_encoded_size_matches_the_payload(n, bucket):
    codec = ScaledSign(bucket=bucket)
    size = 4 * -(-n // bucket) + -(-n // 8)
    assert codec.encoded_size(n) == size
    payload = codec.encode(gaussian(n, n))
    assert len(payload) == size
    assert codec.decode(payload, n).shape == (n,)


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_is_scale_times_sign(n, bucket):
    codec = ScaledSign(bucket=bucket)
    x = gaussian(n + 1, n)
    x[::13] = 0.0  # zeros (and -0.0) decode to +scale
    x[5::17] = -0.0
    payload = codec.encode(x)
    scales, bits = split(codec, payload, n)
    ref_scales, ref_bits = reference(x, bucket)
    np.testing.assert_allclose(scales, ref_scales, rtol=2**-23, atol=0)
    np.testing.assert_array_equal(bits, ref_bits)
    np.testing.assert_array_equal(codec.decode(payload, n), expected_decode(scales, x, bucket))


def test_partial_last_bucket_has_its_own_mean():
    codec = ScaledSign(bucket=64)
    x = np.concatenate(
        [np.full(64, 2.0), np.full(64, -3.0), np.array([1.0, -2.0, 3.0, -4.0, 5.0])]
    ).astype(np.float32)
    scales, _ = split(codec, codec.encode(x), x.size)
    np.testing.assert_array_equal(scales, np.array([2.0, 3.0, 3.0], np.float32))
    y = codec.decode(codec.encode(x), x.size)
    np.testing.assert_array_equal(y[-5:], np.array([3.0, -3.0, 3.0, -3.0, 3.0], np.float32))
    np.testing.assert_array_equal(y[:128], x[:128])


@pytest.mark.parametrize("bucket", [24, 1024, 65536])
def test_chunks_longer_than_a_block_match_the_reference(bucket):
    """Several sub-blocks, a sub-block length that is not BLOCK, and a partial bucket."""
    n = 2 * BLOCK + 3 * bucket + 13
    x = gaussian(bucket, n)
    x[1000:3000] *= np.float32(1e30)  # float64 sums: no overflow
    x[-13:] = np.float32(3e38)
    codec = ScaledSign(bucket=bucket)
    payload = codec.encode(x)
    scales, bits = split(codec, payload, n)
    ref_scales, ref_bits = reference(x, bucket)
    np.testing.assert_allclose(scales, ref_scales, rtol=2**-23, atol=0)
    np.testing.assert_array_equal(bits, ref_bits)
    assert np.isfinite(scales).all()
    np.testing.assert_array_equal(codec.decode(payload, n), expected_decode(scales, x, bucket))


@SETTINGS
@given(
    x=arrays(np.float32, st.integers(0, 2000), elements=finite32), bucket=st.sampled_from(BUCKETS)
)
def test_any_finite_input_round_trips_to_finite_values(x, bucket):
    codec = ScaledSign(bucket=bucket)
    payload = codec.encode(x)
    scales, bits = split(codec, payload, x.size)
    y = codec.decode(payload, x.size)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(bits, np.packbits(x < 0, bitorder="little"))
    np.testing.assert_array_equal(y, expected_decode(scales, x, bucket))
    if x.size:  # each scale lies between the smallest and largest magnitude of its bucket
        mag = np.abs(x)
        starts = np.arange(0, x.size, bucket)
        assert np.all(scales <= np.maximum.reduceat(mag, starts))
        assert np.all(scales >= np.minimum.reduceat(mag, starts))


def test_the_seed_is_ignored():
    x = gaussian(3, 3000)
    codec = ScaledSign(bucket=64)
    payload = codec.encode(x, seed=1)
    assert codec.encode(x, seed=2**64 - 1) == payload
    np.testing.assert_array_equal(codec.decode(payload, x.size, 5), codec.decode(payload, x.size))


# -- weights and accumulation ---------------------------------------------------------------


@pytest.mark.parametrize("weight", [1.0, 0.5, -2.0, 0.0, 1e6])
def test_weight_is_applied_and_added_into_the_destination(weight):
    x = gaussian(7, 5000)
    codec = ScaledSign(bucket=1024)
    payload = codec.encode(x)
    base = np.linspace(-1, 1, x.size, dtype=np.float32)
    out = base.copy()
    codec.decode_into(payload, out, weight)
    expect = base + np.float32(weight) * codec.decode(payload, x.size)
    np.testing.assert_array_equal(out, expect)


@SETTINGS
@given(x=moderate, weight=st.floats(-4, 4), bucket=st.sampled_from(BUCKETS))
def test_decode_into_adds_weight_times_decoded(x, weight, bucket):
    codec = ScaledSign(bucket=bucket)
    payload = codec.encode(x)
    base = np.linspace(-1, 1, x.size, dtype=np.float32)
    out = base.copy()
    codec.decode_into(payload, out, weight)
    expect = base + np.float32(weight) * codec.decode(payload, x.size)
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)


# -- hostile payloads -----------------------------------------------------------------------


def refused(codec: ScaledSign, payload, n: int, match: str, weight: float = 1.0) -> None:
    base = np.linspace(-3, 3, n, dtype=np.float32)
    out = base.copy()
    with pytest.raises(CodecError, match=match) as info:
        codec.decode_into(payload, out, weight)
    assert info.value.reason.startswith("sign:")
    np.testing.assert_array_equal(out, base)  # bit for bit untouched


def with_scale(payload: bytes, index: int, value: float) -> bytearray:
    out = bytearray(payload)
    struct.pack_into("<f", out, 4 * index, value)
    return out


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, -1e-45])
def test_bad_scales_are_refused(value):
    n, codec = 1025, ScaledSign(bucket=256)
    payload = bytes(codec.encode(gaussian(1, n)))
    for index in (0, 2, 4):  # first, middle and the partial last bucket
        refused(codec, with_scale(payload, index, value), n, "scale")


def test_scales_that_would_overflow_the_destination_are_refused():
    n, codec = 1000, ScaledSign(bucket=256)
    payload = with_scale(bytes(codec.encode(gaussian(1, n))), 1, 3e38)
    out = np.zeros(n, np.float32)
    codec.decode_into(payload, out, 1.0)  # fine at weight 1 ...
    assert np.isfinite(out).all()
    refused(codec, payload, n, "overflow", weight=2.0)  # ... not at weight 2
    refused(codec, payload, n, "overflow", weight=-1e30)


@pytest.mark.parametrize("n", [1, 7, 1023, 1025, 5001])
def test_non_zero_padding_bits_are_refused(n):
    codec = ScaledSign(bucket=1024)
    payload = bytes(codec.encode(gaussian(n, n)))
    for bit in range(n % 8, 8):
        bad = bytearray(payload)
        bad[-1] |= 1 << bit
        refused(codec, bad, n, "padding")
    ok = bytearray(payload)
    ok[-1] ^= 1 << (n % 8 - 1)  # the last real element's bit is fine to flip
    codec.decode(ok, n)


@pytest.mark.parametrize("n", [1, 8, 1024, 1025])
def test_wrong_payload_lengths_are_refused(n):
    codec = ScaledSign(bucket=1024)
    payload = bytes(codec.encode(gaussian(n, n)))
    for bad in (payload[:-1], payload + b"\x00", b"", payload * 2):
        refused(codec, bad, n, "bytes")


def test_non_finite_input_is_local_misuse():
    codec = ScaledSign()
    for bad in (np.inf, -np.inf, np.nan):
        x = np.ones(70_000, np.float32)
        x[54_321] = bad
        with pytest.raises(ValueError, match="non-finite") as info:
            codec.encode(x)
        assert not isinstance(info.value, CodecError)
    with pytest.raises(TypeError):
        codec.encode(np.ones(10, np.float64))


# -- through the wire -----------------------------------------------------------------------


def encode(codec, x, chunk_elems=1000, weight=32.0):
    return [
        bytes(m)
        for m in encode_vector(
            codec,
            x,
            sender_id=SENDER,
            swarm_samples=10,
            weight=weight,
            seed=3,
            chunk_elems=chunk_elems,
        )
    ]


def reseal(msg: bytearray) -> bytes:
    if len(msg) >= 8:
        struct.pack_into("<Q", msg, len(msg) - 8, xxhash.xxh3_64_intdigest(bytes(msg[:-8])))
    return bytes(msg)


@pytest.mark.parametrize("bucket", [8, 64, 1024])
def test_vector_round_trip_through_messages(bucket):
    codec = ScaledSign(bucket=bucket)
    x = gaussian(0, 4321)
    msgs = encode(codec, x)
    assert len(msgs) == 5
    assert sum(len(m) for m in msgs) == total_encoded_size(codec, x.size, 1000)
    out = np.zeros_like(x)
    for m in msgs:
        msg = decode_message(m, out, 0.25)
        assert msg.codec == codec
        piece = out[msg.chunk_offset : msg.chunk_offset + msg.chunk_length]
        np.testing.assert_array_equal(piece, np.float32(0.25) * msg.decode())
        chunk = msg.decode().astype(np.float64)
        assert msg.sq_norm() == pytest.approx(chunk @ chunk, rel=1e-6)


N = 700
SOURCE = np.random.default_rng(5).standard_t(3, N).astype(np.float32)
SOURCE[::17] = 0.0
MESSAGES = [m for b in (8, 24, 256) for m in encode(ScaledSign(bucket=b), SOURCE, chunk_elems=301)]


def check_decoder(msg: bytes, scale: float) -> None:
    """A clean decode or CodecError with the destination untouched; nothing else."""
    base = np.linspace(-3, 3, N, dtype=np.float32)
    out = base.copy()
    try:
        decode_message(msg, out, scale)
    except CodecError as exc:
        assert exc.reason
        np.testing.assert_array_equal(out, base)
    else:
        assert np.isfinite(out).all()


@pytest.mark.filterwarnings("error")
@settings(derandomize=True, deadline=None, max_examples=300)
@given(
    index=st.integers(0, len(MESSAGES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    scale=st.sampled_from([1.0, -0.5, 1e6, 1e30]),
)
def test_mutated_payloads_decode_cleanly_or_are_refused(index, edits, scale):
    msg = bytearray(MESSAGES[index])
    body = len(msg) - HEADER_SIZE - 8
    for pos, value in edits:
        msg[HEADER_SIZE + pos % body] = value
    check_decoder(reseal(msg), scale)


@pytest.mark.filterwarnings("error")
@settings(derandomize=True, deadline=None, max_examples=100)
@given(index=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_random_payloads_behind_a_valid_header(index, data):
    msg = MESSAGES[index]
    size = len(msg) - HEADER_SIZE - 8
    body = data.draw(st.binary(min_size=size, max_size=size))
    check_decoder(reseal(bytearray(msg[:HEADER_SIZE] + body + bytes(8))), 1.0)


def test_every_original_message_decodes():
    for msg in MESSAGES:
        out = np.zeros(N, np.float32)
        decode_message(msg, out)
        assert np.isfinite(out).all()
        assert parse_message(msg).codec.name == "sign"


# -- quality --------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket", [64, 1024, 65536])
def test_sign_keeps_most_of_a_gaussian_vectors_energy(bucket):
    x = gaussian(42, 200_000).astype(np.float64)
    codec = ScaledSign(bucket=bucket)
    y = codec.decode(codec.encode(x.astype(np.float32)), x.size).astype(np.float64)
    energy = x @ x
    error = (x - y) @ (x - y)
    assert error <= energy * (1 - 0.5)
    assert error == pytest.approx(energy * (1 - 2 / np.pi), rel=0.03)  # mean|v|^2 / mean v^2


def test_error_feedback_conserves_mass_and_sends_everything_eventually():
    """The residual settles (a coordinate whose mean exceeds its bucket's mean magnitude waits
    until its residual lifts that mean: about bucket x max |mean| at most), so the time-average
    of what was sent converges to the mean input."""
    n, steps, bucket = 4000, 200, 8
    ef = ErrorFeedback(ScaledSign(bucket=bucket), n)
    rng = np.random.default_rng(1)
    mean = rng.standard_normal(n).astype(np.float32)
    sent = np.zeros(n, np.float64)
    for step in range(steps):
        x = mean + np.float32(0.1) * rng.standard_normal(n).astype(np.float32)
        before = ef.residual.astype(np.float64)
        out = np.zeros(n, np.float32)
        for msg in ef.encode_vector(
            x, sender_id=SENDER, swarm_samples=0, weight=1.0, seed=step, chunk_elems=1500
        ):
            decode_message(msg, out)
        decoded = out.astype(np.float64)
        # decoded + e_new == x + e_old, up to float32 rounding of x + e and of e_new
        scale = np.abs(x) + np.abs(before) + np.abs(decoded) + 1e-30
        assert np.all(np.abs(decoded + ef.residual - x - before) <= 4e-7 * scale)
        sent += out
    top = np.abs(mean).max()
    assert np.abs(ef.residual).max() < bucket * top
    assert np.abs(sent / steps - mean).max() < 0.1 * top
