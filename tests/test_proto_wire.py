"""The control plane's wire format: round trips, the registry, and a strict decoder that
answers every malformed input with one RemoteProtocolError."""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.proto import wire
from p2ptrain.proto.errors import RemoteProtocolError
from p2ptrain.proto.messages import BODY_TYPES, TYPE_IDS, Body, Envelope, Ping, register
from tests.proto_samples import A, B, header, sample_envelopes


@register(250)
@dataclass(frozen=True, slots=True)
class Blobby(Body):
    """A test body with binary fields (as a gradient chunk message would have)."""

    name: str
    first: bytes
    second: bytes
    weights: tuple[float, ...]


def test_every_registered_control_body_round_trips():
    envs = sample_envelopes()
    assert {type(e.body) for e in envs} == {c for i, c in BODY_TYPES.items() if i < 32}
    for env in envs:
        data = wire.encode(env)
        assert wire.decode(data) == env
        assert wire.decode(bytearray(data)) == env
        assert wire.decode(memoryview(data)) == env


def test_binary_fields_travel_in_the_tail():
    env = Envelope(header(), Blobby("g", b"\x00\xff" * 100, b"", (0.5, 1.0)))
    data = wire.encode(env)
    assert data.endswith(b"\x00\xff" * 100)
    assert wire.peek_tail_size(data) == 200 and wire.peek_type(data) is Blobby
    assert wire.decode(data) == env
    with pytest.raises(RemoteProtocolError):
        wire.peek_tail_size(data[1:])


def test_registry_refuses_duplicates_and_unsupported_fields():
    with pytest.raises(TypeError):
        register(1)(Blobby)  # id taken
    with pytest.raises(TypeError):
        @register(253)
        @dataclass(frozen=True, slots=True)
        class Bad(Body):
            x: set[int]
    assert 253 not in BODY_TYPES
    with pytest.raises(TypeError):
        @register(0)
        @dataclass(frozen=True, slots=True)
        class Zero(Body):
            pass
    assert TYPE_IDS[Ping] == 1


def _frame(type_id: int, doc, tail: bytes = b"", version: int = 1, flags: int = 0) -> bytes:
    text = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return struct.pack("<4sBBHII", b"P2PM", version, type_id, flags, len(text), len(tail)) \
        + text + tail


def _doc(env: Envelope):
    data = wire.encode(env)
    n = struct.unpack_from("<I", data, 8)[0]
    return json.loads(data[16 : 16 + n])


def _reject(data, fragment: str = "") -> str:
    with pytest.raises(RemoteProtocolError) as info:
        wire.decode(data)
    assert fragment in info.value.reason
    return info.value.reason


def test_truncated_and_padded_frames_are_refused():
    data = wire.encode(sample_envelopes()[4])  # a SyncRequest
    for cut in range(len(data)):
        _reject(data[:cut])
    _reject(data + b"\x00")


def test_frame_header_defects():
    env = Envelope(header(), Ping(1, B))
    doc = _doc(env)
    assert wire.decode(_frame(1, doc)) == env
    _reject(b"NOPE" + wire.encode(env)[4:], "magic")
    _reject(_frame(1, doc, version=2), "frame version")
    _reject(_frame(1, doc, flags=1), "flags")
    _reject(_frame(199, doc), "unknown message type")
    huge = struct.pack("<4sBBHII", b"P2PM", 1, 1, 0, 2**32 - 1, 2**32 - 1)
    _reject(huge, "exceed")
    _reject(struct.pack("<4sBBHII", b"P2PM", 1, 1, 0, 1000, 0) + b"[]", "declares")


def test_json_defects():
    env = Envelope(header(), Ping(1, B))
    doc = _doc(env)
    _reject(_frame(1, b"\xff\xfe"))  # not UTF-8
    _reject(_frame(1, b"[[1,2"))  # not JSON
    _reject(_frame(1, {"header": doc[0]}))
    _reject(_frame(1, [doc[0]]))
    _reject(_frame(1, [doc[0], doc[1], []]))
    text = json.dumps(doc)
    assert ", 100, 7, 3," in text
    _reject(_frame(1, text.replace(", 100, 7,", ", NaN, 7,").encode()), "NaN")
    _reject(_frame(1, text.replace(", 100, 7,", ", -Infinity, 7,").encode()), "Infinity")
    _reject(_frame(1, text.replace(", 100, 7,", ", 1e999, 7,").encode()))
    _reject(_frame(1, b"[" * 100000 + b"]" * 100000))
    _reject(_frame(1, [doc[0], [1, "9" * 5000]]))


def test_wrong_protocol_version_is_named():
    doc = _doc(Envelope(header(), Ping(1, B)))
    doc[0][0] = 1  # the previous protocol
    assert "protocol version 1" in _reject(_frame(1, doc))


WRONG = ["x", 1.5, -1, None, [], {}, True, 2**70, "z" * 5000, float("1e308"), 0]


def _leaves(value, path=()):
    if isinstance(value, list):
        yield path, value
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    elif isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path, value


def _replace(doc, path, new):
    doc = json.loads(json.dumps(doc))
    if not path:
        return new
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return doc


def test_every_field_with_a_wrong_type_or_value_is_refused_or_harmless():
    """Swap every node of every sample message's JSON for wrong values: the decoder either
    refuses with RemoteProtocolError or returns a message that passes its own checks."""
    refused = 0
    for env in sample_envelopes():
        type_id = TYPE_IDS[type(env.body)]
        doc = _doc(env)
        for path, _ in list(_leaves(doc)):
            for new in WRONG:
                data = _frame(type_id, _replace(doc, path, new))
                try:
                    decoded = wire.decode(data)
                except RemoteProtocolError:
                    refused += 1
                else:
                    decoded.header.check()
                    decoded.body.check()
    assert refused > 1000


def test_semantic_checks():
    doc = _doc(Envelope(header(), Ping(1, B)))
    bad_id = _replace(doc, (0, 1), "A" * 32)
    assert "sender" in _reject(_frame(1, bad_id))
    assert "target" in _reject(_frame(1, _replace(doc, (1, 1), "abc")))
    assert "seq" in _reject(_frame(1, _replace(doc, (1, 0), -5)))
    assert "incarnation" in _reject(_frame(1, _replace(doc, (0, 2), 2**60)))
    sync = _doc(sample_envelopes()[4])
    dup = _replace(sync, (1, 0), sync[1][0] + [sync[1][0][0]])
    assert "twice" in _reject(_frame(5, dup))
    alive_without_info = _replace(sync, (1, 0, 0, 4), None)
    assert "info" in _reject(_frame(5, alive_without_info))
    other_info = _replace(sync, (1, 0, 0, 1), B)
    _reject(_frame(5, other_info))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_another_exception(data):
    with contextlib.suppress(RemoteProtocolError):
        wire.decode(b"P2PM\x01" + data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_messages_are_refused_or_valid(data):
    env = data.draw(st.sampled_from(sample_envelopes()))
    raw = bytearray(wire.encode(env))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        decoded = wire.decode(bytes(raw))
    except RemoteProtocolError:
        return
    decoded.header.check()
    decoded.body.check()


def test_encoding_is_compact():
    env = Envelope(header(A), Ping(1, B))
    assert len(wire.encode(env)) < 200


def test_text_with_control_characters_is_refused():
    """A member's device class or address is printed by `status` and logged: one holding ESC
    sequences set the operator's terminal colours and window title."""
    from tests.proto_samples import info

    for field in ("device_class", "addr"):
        good = info()
        bad = type(good)(**{**{f: getattr(good, f) for f in good.__dataclass_fields__},
                            field: "pi4\x1b]0;pwned\x07"})
        with pytest.raises(ValueError, match="control characters"):
            bad.check()
    doc = _doc(Envelope(header(), Ping(1, B)))
    assert "control" in _reject(_frame(1, _replace(doc, (0, 3), "10.0.0.1:7100\x1b[41m")))
