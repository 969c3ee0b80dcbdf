"""Chunk messages: round trips, header fields, exact sizes, and one test per refusal reason."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.codecs import (
    HEADER_SIZE,
    TRAILER_SIZE,
    CodecError,
    chunk_bounds,
    decode_message,
    encode_vector,
    make_codec,
    message_size,
    parse_message,
    total_encoded_size,
)

SENDER = bytes.fromhex("00112233445566778899aabbccddeeff")
CODECS = [
    make_codec("none"),
    make_codec("fp16"),
    make_codec("bf16"),
    make_codec("int8"),
    make_codec("topk", fraction=0.05),
    make_codec("randomk", fraction=0.1),
    make_codec("qsgd", levels=7, bucket=64),
]


def encode(codec, x, chunk_elems=1000, seed=3, weight=32.0, swarm=10**12):
    return list(
        encode_vector(
            codec,
            x,
            sender_id=SENDER,
            swarm_samples=swarm,
            weight=weight,
            seed=seed,
            chunk_elems=chunk_elems,
        )
    )


def reseal(msg: bytearray) -> bytearray:
    """Recompute the checksum after a deliberate change, so the field checks are reached."""
    struct.pack_into("<Q", msg, len(msg) - 8, xxhash.xxh3_64_intdigest(bytes(msg[:-8])))
    return msg


def with_field(msg: bytes, offset: int, fmt: str, *values) -> bytearray:
    out = bytearray(msg)
    struct.pack_into(fmt, out, offset, *values)
    return reseal(out)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_vector_round_trip_matches_chunk_by_chunk_decoding(codec):
    x = np.random.default_rng(0).standard_normal(4321).astype(np.float32)
    msgs = encode(codec, x)
    assert len(msgs) == 5
    out = np.zeros_like(x)
    for i, m in enumerate(msgs):
        msg = decode_message(bytes(m), out)
        assert (msg.chunk_index, msg.chunk_count, msg.vector_length) == (i, 5, 4321)
        assert msg.sender_id == SENDER and msg.swarm_samples == 10**12 and msg.weight == 32.0
        assert msg.codec == codec.__class__.unpack_params(codec.pack_params())
        np.testing.assert_array_equal(
            out[msg.chunk_offset : msg.chunk_offset + msg.chunk_length], msg.decode()
        )
    assert sum(len(m) for m in msgs) == total_encoded_size(codec, x.size, 1000)


@pytest.mark.parametrize("codec", CODECS + [make_codec("randomk", scale=True)], ids=repr)
def test_sq_norm_matches_the_decoded_chunk(codec):
    x = np.random.default_rng(4).standard_normal(2500).astype(np.float32)
    for m in encode(codec, x):
        msg = parse_message(m)
        chunk = msg.decode().astype(np.float64)
        assert msg.sq_norm() == pytest.approx(chunk @ chunk, rel=1e-6)


def test_decode_accumulates_with_a_scale():
    x = np.arange(10, dtype=np.float32)
    out = np.ones(10, np.float32)
    for m in encode(make_codec("none"), x, chunk_elems=4):
        decode_message(m, out, scale=0.5)
    np.testing.assert_array_equal(out, 1 + 0.5 * x)


@settings(derandomize=True, deadline=None, max_examples=80)
@given(n=st.integers(0, 5000), chunk=st.integers(1, 6000))
def test_total_encoded_size_is_exact(n, chunk):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    bounds = chunk_bounds(n, chunk)
    assert sum(length for _, length in bounds) == n
    for codec in CODECS:
        msgs = encode(codec, x, chunk_elems=chunk)
        assert [len(m) for m in msgs] == [message_size(codec, ln) for _, ln in bounds]
        assert sum(len(m) for m in msgs) == total_encoded_size(codec, n, chunk)


def test_empty_vector_is_one_empty_chunk():
    msgs = encode(make_codec("topk"), np.zeros(0, np.float32))
    assert len(msgs) == 1 and len(msgs[0]) == HEADER_SIZE + TRAILER_SIZE
    assert parse_message(msgs[0]).chunk_length == 0


def test_seeds_differ_per_chunk_and_randomk_uses_the_header_seed():
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    msgs = encode(make_codec("randomk", fraction=0.01), x)
    seeds = {parse_message(m).seed for m in msgs}
    assert len(seeds) == 3
    out = np.zeros_like(x)
    for m in msgs:
        decode_message(m, out)
    kept = np.flatnonzero(out)
    np.testing.assert_array_equal(out[kept], x[kept])
    assert kept.size == 30


def test_local_misuse_is_not_a_codec_error():
    x = np.zeros(10, np.float32)
    with pytest.raises(TypeError):
        encode(make_codec("none"), x.astype(np.float64))
    with pytest.raises(ValueError):
        list(
            encode_vector(
                make_codec("none"), x, sender_id=b"short", swarm_samples=0, weight=1, seed=0
            )
        )
    with pytest.raises(ValueError):
        encode(make_codec("none"), x, weight=float("nan"))
    for codec in CODECS + [make_codec("topk", exact=True)]:
        for bad in (np.inf, -np.inf, np.nan):
            y = np.ones(70_000, np.float32)
            y[54_321] = bad
            with pytest.raises(ValueError, match="non-finite") as info:
                encode(codec, y, chunk_elems=70_000)
            assert not isinstance(info.value, CodecError)


# -- each refusal reason --------------------------------------------------------------------

X = np.random.default_rng(2).standard_normal(2500).astype(np.float32)
TOPK = make_codec("topk", fraction=0.02, values="fp32")
GOOD = bytes(encode(TOPK, X)[1])  # chunk 1 of 3: offset 1000, length 1000
K = TOPK.k(1000)
VALUES_AT = HEADER_SIZE  # K fp32 values, then the Elias-Fano positions
LOW_AT = VALUES_AT + 4 * K  # K x 5 low bits (1000 / 20 = 50 per position): 13 bytes
BITMAP_AT = LOW_AT + 13  # K + (999 >> 5) = 51 bitmap bits: 7 bytes


def refused(msg, match: str) -> None:
    out = np.zeros_like(X)
    with pytest.raises(CodecError, match=match) as info:
        decode_message(msg, out)
    assert info.value.reason
    assert not out.any()


def decode_good() -> np.ndarray:
    out = np.zeros_like(X)
    decode_message(GOOD, out)
    return out[1000:2000]


def test_good_message_decodes():
    assert np.count_nonzero(decode_good()) == K


def test_refusals_of_framing():
    refused(GOOD[:50], "too short")
    refused(b"NOPE" + GOOD[4:], "magic")
    refused(with_field(GOOD, 4, "<B", 2), "version 2")
    bad = bytearray(GOOD)
    bad[HEADER_SIZE + 3] ^= 1
    refused(bytes(bad), "checksum")
    refused(reseal(bytearray(GOOD) + b"\0"), "disagrees")
    refused(reseal(bytearray(GOOD[:-9]) + GOOD[-8:]), "disagrees")


def test_refusals_of_header_fields():
    refused(with_field(GOOD, 5, "<B", 99), "unknown codec id 99")
    refused(with_field(GOOD, 8, "<I", 0), "topk")  # fraction 0
    refused(with_field(GOOD, 6, "<H", 1), "reserved")
    refused(with_field(GOOD, 44, "<I", 1), "reserved")
    refused(with_field(GOOD, 16, "<Q", 2501), "destination")  # vector length
    refused(with_field(GOOD, 24, "<Q", 999), "tile")  # chunk offset
    refused(with_field(GOOD, 32, "<I", 999), "tile")  # chunk length
    refused(with_field(GOOD, 36, "<I", 3), "index")  # chunk index >= count
    refused(with_field(GOOD, 40, "<I", 4), "tile")  # chunk count
    refused(with_field(GOOD, 80, "<d", float("nan")), "weight")
    refused(with_field(GOOD, 80, "<d", -1.0), "weight")
    refused(with_field(GOOD, 88, "<Q", 7), "payload length")


def with_positions(msg: bytes, highs, lows) -> bytearray:
    """GOOD with its coded positions replaced by these high parts and low bits (5 each)."""
    low = np.array([(v >> b) & 1 for v in lows for b in range(5)], np.uint8)
    bitmap = np.zeros(51, np.uint8)
    bitmap[np.asarray(highs) + np.arange(len(highs))] = 1
    out = bytearray(msg)
    out[LOW_AT:BITMAP_AT] = np.packbits(low, bitorder="little").tobytes()
    out[BITMAP_AT:BITMAP_AT + 7] = np.packbits(bitmap, bitorder="little").tobytes()
    return reseal(out)


def test_refusals_of_topk_payloads():
    pos = np.flatnonzero(decode_good())
    highs, lows = list(pos >> 5), list(pos & 31)
    assert bytes(with_positions(GOOD, highs, lows)) == GOOD  # the layout is as described
    refused(with_positions(GOOD, highs[:-1] + [31], lows[:-1] + [8]), "out of range")  # 1000
    refused(with_positions(GOOD, highs[:2] + highs[1:-1], lows[:2] + lows[1:-1]), "increasing")
    refused(with_positions(GOOD, highs[1:] + highs[-1:], lows[1:] + [0]), "increasing")
    missing = bytearray(GOOD)
    missing[BITMAP_AT] &= missing[BITMAP_AT] - 1  # clear the lowest set bit: k - 1 entries
    refused(reseal(missing), "holds 19 entries")
    refused(with_field(GOOD, BITMAP_AT + 6, "<B", GOOD[BITMAP_AT + 6] | 0x80), "padding")
    refused(with_field(GOOD, LOW_AT + 12, "<B", GOOD[LOW_AT + 12] | 0x80), "padding")
    refused(with_field(GOOD, VALUES_AT, "<f", float("inf")), "non-finite")
    refused(with_field(GOOD, VALUES_AT + 4, "<f", float("nan")), "non-finite")
    out = np.zeros_like(X)
    decode_message(with_field(GOOD, VALUES_AT, "<f", 3e38), out)  # fine at scale 1 ...
    out[:] = 0
    with pytest.raises(CodecError, match="overflow"):  # ... but not scaled by 2
        decode_message(with_field(GOOD, VALUES_AT, "<f", 3e38), out, scale=2.0)
    assert not out.any()


def dense_message(codec, x):
    return bytes(encode(codec, x, chunk_elems=x.size)[0])


def test_refusals_of_dense_payloads():
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    for name, at, fmt, value, match in [
        ("none", 8, "<f", float("inf"), "non-finite"),
        ("fp16", 8, "<H", 0x7C00, "non-finite"),
        ("fp16", 8, "<H", 0xFE01, "non-finite"),
        ("bf16", 8, "<H", 0x7FC0, "non-finite"),
        ("int8", 4, "<f", -1.0, "scale"),  # the second block's scale
        ("int8", 0, "<f", float("nan"), "scale"),
    ]:
        msg = dense_message(make_codec(name), x)
        out = np.zeros_like(x)
        with pytest.raises(CodecError, match=match):
            decode_message(with_field(msg, HEADER_SIZE + at, fmt, value), out)
        assert not out.any()
    msg = dense_message(make_codec("int8"), x)
    with pytest.raises(CodecError, match="-128"):
        decode_message(with_field(msg, HEADER_SIZE + 8 + 100, "<b", -128), np.zeros_like(x))


def test_refusals_of_qsgd_payloads():
    x = np.linspace(-1, 1, 301, dtype=np.float32)
    for levels, bucket, offset, fmt, value, match in [
        (127, 64, 0, "<f", -1.0, "norm"),
        (127, 64, 20, "<b", -128, "outside"),
        (100, 64, 20, "<b", 101, "outside"),
        (4, 64, 0, "<f", float("inf"), "norm"),
        (4, 64, 20, "<B", 0x77, "outside"),  # 7 > s = 4
        (7, 64, 20, "<B", 0x88, "outside"),  # -8 < -s
        (1, 64, 20, "<B", 0x02, "outside"),  # 2-bit code -2
        (300, 64, 20, "<h", -301, "outside"),
    ]:
        codec = make_codec("qsgd", levels=levels, bucket=bucket)
        msg = dense_message(codec, x)
        at = HEADER_SIZE + (0 if offset == 0 else 4 * 5 + offset)
        out = np.zeros_like(x)
        with pytest.raises(CodecError, match=match):
            decode_message(with_field(msg, at, fmt, value), out)
        assert not out.any()
    codec = make_codec("qsgd", levels=7, bucket=64)  # 301 codes in 151 bytes: 1 padding code
    msg = dense_message(codec, x)
    last = HEADER_SIZE + 4 * 5 + 150
    with pytest.raises(CodecError, match="padding"):
        decode_message(with_field(msg, last, "<B", msg[last] | 0x10), np.zeros_like(x))


def test_known_answer_layout():
    """The byte layout documented in wire.py, field by field, for one tiny fp16 message."""
    x = np.array([1.0, -2.0, 0.5], np.float32)
    (msg,) = list(
        encode_vector(
            make_codec("fp16"),
            x,
            sender_id=bytes(range(16)),
            swarm_samples=7,
            weight=2.5,
            seed=5,
            chunk_elems=1000,
        )
    )
    msg = bytes(msg)
    assert len(msg) == 96 + 6 + 8
    assert msg[0:4] == b"P2PC" and msg[4] == 1 and msg[5] == 1  # magic, version, fp16 id
    assert msg[6:8] == bytes(2) and msg[8:16] == bytes(8)  # flags, codec parameters
    assert struct.unpack_from("<QQIIII", msg, 16) == (3, 0, 3, 0, 1, 0)
    seed = struct.unpack_from("<Q", msg, 48)[0]
    assert seed == parse_message(msg).seed and seed != 5  # the chunk's derived seed
    assert msg[56:72] == bytes(range(16))
    assert struct.unpack_from("<QdQ", msg, 72) == (7, 2.5, 6)
    assert msg[96:102] == bytes.fromhex("003c00c00038")  # 1.0, -2.0, 0.5 in float16
    assert struct.unpack_from("<Q", msg, 102)[0] == xxhash.xxh3_64_intdigest(msg[:102])


def test_threads_share_codecs_without_sharing_scratch():
    """Codecs keep per-thread scratch buffers: concurrent decodes match serial ones."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.random.default_rng(8).standard_normal(300_000).astype(np.float32)
    jobs = [(codec, encode(codec, x, chunk_elems=100_000)) for codec in CODECS]

    def decode_all(job):
        _, msgs = job
        out = np.zeros_like(x)
        for m in msgs:
            decode_message(m, out)
        return out

    serial = [decode_all(job) for job in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            for got, want in zip(pool.map(decode_all, jobs), serial, strict=True):
                np.testing.assert_array_equal(got, want)
