"""Fuzzing the decoder: random and mutated messages give either a clean decode or CodecError,
never another exception, never a numpy warning, and never a write into the destination when
refused. Mutations are tried both with the checksum left stale (the checksum catches them) and
recomputed (so every field check and payload check is exercised)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.codecs import (
    HEADER_SIZE,
    CodecError,
    decode_message,
    encode_vector,
    make_codec,
    parse_message,
)

pytestmark = pytest.mark.filterwarnings("error")  # a numpy RuntimeWarning is a failure too

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
N = 700
SOURCE = np.random.default_rng(5).standard_t(3, N).astype(np.float32)
SOURCE[::17] = 0.0


def _messages() -> list[bytes]:
    codecs = [
        make_codec("none"),
        make_codec("fp16"),
        make_codec("bf16"),
        make_codec("int8", block=16),
        make_codec("topk", fraction=0.05),
        make_codec("topk", fraction=0.2, values="bf16"),
        make_codec("topk", fraction=0.1, values="fp32"),
        make_codec("randomk", fraction=0.1),
        make_codec("randomk", fraction=0.2, scale=True),
        make_codec("qsgd", levels=1, bucket=16),
        make_codec("qsgd", levels=5, bucket=24),
        make_codec("qsgd", levels=100, bucket=32),
        make_codec("qsgd", levels=1000, bucket=8),
    ]
    out = []
    for codec in codecs:
        out += [
            bytes(m)
            for m in encode_vector(
                codec,
                SOURCE,
                sender_id=bytes(range(16)),
                swarm_samples=9,
                weight=4.0,
                seed=11,
                chunk_elems=300,
            )
        ]
    return out


MESSAGES = _messages()


def reseal(msg: bytearray) -> bytes:
    if len(msg) >= 8:
        struct.pack_into("<Q", msg, len(msg) - 8, xxhash.xxh3_64_intdigest(bytes(msg[:-8])))
    return bytes(msg)


def check_decoder(msg: bytes, scale: float = 1.0) -> None:
    """Decode into a destination; on refusal it must be bit-for-bit unchanged."""
    base = np.linspace(-3, 3, N, dtype=np.float32)
    out = base.copy()
    try:
        norm = parse_message(msg).sq_norm()
        assert np.isfinite(norm) and norm >= 0
    except CodecError as exc:
        assert exc.reason
    try:
        decode_message(msg, out, scale)
    except CodecError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        np.testing.assert_array_equal(out, base)
    else:
        assert np.isfinite(out).all()


def test_every_original_message_decodes():
    """Valid messages must decode (a decoder that refused everything would pass the fuzz
    tests below), and what they decode to has the norm the message declares."""
    for msg in MESSAGES:
        parsed = parse_message(msg)  # a CodecError here fails the test
        out = np.zeros(N, dtype=np.float32)
        decode_message(msg, out, 1.0)
        assert np.isfinite(out).all()
        decoded = float(np.sum(out.astype(np.float64) ** 2))
        assert np.isclose(decoded, parsed.sq_norm(), rtol=1e-3, atol=1e-6)
        check_decoder(msg)


mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("xor"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(
        st.just("word"),
        st.integers(0, HEADER_SIZE),
        st.sampled_from(["<H", "<I", "<Q"]),
        st.integers(0, 2**64 - 1),
    ),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.integers(1, 9)),
)


def mutate(msg: bytes, steps) -> bytearray:
    out = bytearray(msg)
    for step in steps:
        kind = step[0]
        if kind in ("set", "xor") and out:
            pos = step[1] % len(out)
            out[pos] = step[2] if kind == "set" else out[pos] ^ step[2]
        elif kind == "word":
            fmt = step[2]
            size = struct.calcsize(fmt)
            if len(out) >= step[1] + size:
                struct.pack_into(fmt, out, step[1], step[3] % (1 << (8 * size)))
        elif kind == "truncate":
            del out[step[1] % (len(out) + 1) :]
        elif kind == "extend":
            out += step[1]
        elif kind == "cut" and out:
            pos = step[1] % len(out)
            del out[pos : pos + step[2]]
    return out


@SETTINGS
@given(
    index=st.integers(0, len(MESSAGES) - 1),
    steps=st.lists(mutation, min_size=1, max_size=4),
    scale=st.sampled_from([1.0, -0.5, 1e6]),
)
def test_mutated_messages_with_a_stale_checksum(index, steps, scale):
    check_decoder(bytes(mutate(MESSAGES[index], steps)), scale)


@SETTINGS
@given(
    index=st.integers(0, len(MESSAGES) - 1),
    steps=st.lists(mutation, min_size=1, max_size=4),
    scale=st.sampled_from([1.0, -0.5, 1e6]),
)
def test_mutated_messages_with_a_valid_checksum(index, steps, scale):
    check_decoder(reseal(mutate(MESSAGES[index], steps)), scale)


@SETTINGS
@given(index=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_random_payloads_behind_a_valid_header(index, data):
    msg = MESSAGES[index]
    body = data.draw(
        st.binary(min_size=len(msg) - HEADER_SIZE - 8, max_size=len(msg) - HEADER_SIZE - 8)
    )
    check_decoder(reseal(bytearray(msg[:HEADER_SIZE] + body + bytes(8))))


@SETTINGS
@given(blob=st.binary(max_size=400), prefix=st.booleans(), sealed=st.booleans())
def test_random_bytes(blob, prefix, sealed):
    msg = bytearray((b"P2PC\x01" if prefix else b"") + blob)
    check_decoder(reseal(msg) if sealed else bytes(msg))
