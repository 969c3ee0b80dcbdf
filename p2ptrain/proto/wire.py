"""The one binary encoding of a control-plane message, and its strict decoder.

Layout (little-endian):

    off size field
      0   4  magic b"P2PM"
      4   1  frame version (1)
      5   1  body type id (messages.BODY_TYPES)
      6   2  flags, must be 0
      8   4  JSON length J (bytes)
     12   4  binary tail length B (bytes)
     16   J  UTF-8 JSON: [header fields..., ], [body fields...] as one array of two arrays
   16+J   B  binary tail: the `bytes` fields of the body, concatenated (e.g. codec chunks)

Lengths are checked against the actual size before anything is parsed, so a frame that
declares 4 GB costs nothing. `decode` raises `RemoteProtocolError` for every defect --
truncation, wrong magic or version, unknown type, bad JSON, wrong field types, values a
record's `check()` refuses -- and returns nothing partial. Authentication (MAC) is the
transport's job around these bytes. No I/O, no clock, no state.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from p2ptrain.proto import schema
from p2ptrain.proto.errors import RemoteProtocolError
from p2ptrain.proto.messages import BODY_TYPES, TYPE_IDS, Envelope, Header

MAGIC = b"P2PM"
FRAME_VERSION = 1
_FRAME = struct.Struct("<4sBBHII")
FRAME_SIZE = _FRAME.size  # 16
MAX_JSON = 8 << 20  # bytes of JSON in one message (a 512-member list is ~150 kB)
MAX_BLOB = 64 << 20  # bytes of binary tail (a few codec chunks)

_HEADER_ENC, _HEADER_DEC = schema.compile_class(Header)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


def encode(envelope: Envelope) -> bytes:
    """The wire bytes of a message (the body's class must be registered)."""
    body = envelope.body
    type_id = TYPE_IDS.get(type(body))
    if type_id is None:
        raise TypeError(f"{type(body).__name__} is not a registered message body")
    blobs: list[bytes] = []
    body_enc, _ = schema.compile_class(type(body))
    doc = [_HEADER_ENC(envelope.header, blobs), body_enc(body, blobs)]
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    tail = b"".join(blobs)
    if len(text) > MAX_JSON or len(tail) > MAX_BLOB:
        raise ValueError("message too large for the wire")
    return _FRAME.pack(MAGIC, FRAME_VERSION, type_id, 0, len(text), len(tail)) + text + tail


def size(envelope: Envelope) -> int:
    """Bytes `encode(envelope)` would produce, without joining the binary tail."""
    body = envelope.body
    if type(body) not in TYPE_IDS:
        raise TypeError(f"{type(body).__name__} is not a registered message body")
    blobs: list[bytes] = []
    body_enc, _ = schema.compile_class(type(body))
    doc = [_HEADER_ENC(envelope.header, blobs), body_enc(body, blobs)]
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    return FRAME_SIZE + len(text.encode()) + sum(len(b) for b in blobs)


def decode(data: bytes | bytearray | memoryview) -> Envelope:
    """Parse and validate one message; RemoteProtocolError with a reason on any defect."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise RemoteProtocolError("message is not a byte string") from None
    if len(view) < FRAME_SIZE:
        raise RemoteProtocolError(f"message too short: {len(view)} bytes")
    magic, version, type_id, flags, n_json, n_blob = _FRAME.unpack_from(view)
    if magic != MAGIC:
        raise RemoteProtocolError("bad magic")
    if version != FRAME_VERSION:
        raise RemoteProtocolError(f"unsupported frame version {version}")
    if flags:
        raise RemoteProtocolError("reserved flags set")
    if n_json > MAX_JSON or n_blob > MAX_BLOB:
        raise RemoteProtocolError(f"declared lengths {n_json}+{n_blob} exceed the limits")
    if len(view) != FRAME_SIZE + n_json + n_blob:
        raise RemoteProtocolError(
            f"message is {len(view)} bytes, frame declares {FRAME_SIZE + n_json + n_blob}")
    cls = BODY_TYPES.get(type_id)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {type_id}")
    try:
        doc = json.loads(str(view[FRAME_SIZE : FRAME_SIZE + n_json], "utf-8"),
                         parse_constant=_reject_constant)
        if type(doc) is not list or len(doc) != 2:
            raise ValueError("message must be [header, body]")
        blob = schema.BlobReader(view[FRAME_SIZE + n_json :])
        header = _HEADER_DEC(doc[0], blob)
        _, body_dec = schema.compile_class(cls)
        body = body_dec(doc[1], blob)
        if not blob.done():
            raise ValueError("unused bytes after the binary fields")
        header.check()
        body.check()
    except RemoteProtocolError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as exc:
        raise RemoteProtocolError(f"{cls.__name__}: {exc}") from None
    return Envelope(header, body)


def split(data: bytes | bytearray | memoryview, max_frames: int = 1024) -> list[memoryview]:
    """Cut a concatenation of frames (an HTTP response carrying replies) into frames, each
    still to be `decode`d; RemoteProtocolError if the lengths do not add up exactly."""
    view = memoryview(data).cast("B")
    frames: list[memoryview] = []
    offset = 0
    while offset < len(view):
        if len(frames) >= max_frames:
            raise RemoteProtocolError(f"more than {max_frames} frames in one body")
        if len(view) - offset < FRAME_SIZE:
            raise RemoteProtocolError("truncated frame header")
        magic, _, _, _, n_json, n_blob = _FRAME.unpack_from(view, offset)
        if magic != MAGIC or n_json > MAX_JSON or n_blob > MAX_BLOB:
            raise RemoteProtocolError("bad frame header")
        end = offset + FRAME_SIZE + n_json + n_blob
        if end > len(view):
            raise RemoteProtocolError("truncated frame")
        frames.append(view[offset:end])
        offset = end
    return frames


def peek_type(data: bytes | bytearray | memoryview) -> type | None:
    """The body class a frame declares, read from its fixed header only (None if unknown)."""
    if len(data) < FRAME_SIZE or bytes(data[:4]) != MAGIC:
        return None
    return BODY_TYPES.get(data[5])


def peek_tail_size(data: bytes | bytearray | memoryview) -> int:
    """Bytes of a frame's binary tail (its `bytes` fields: codec chunks), read from its fixed
    header only; RemoteProtocolError if there is no frame header."""
    if len(data) < FRAME_SIZE or bytes(data[:4]) != MAGIC:
        raise RemoteProtocolError("not a frame")
    return _FRAME.unpack_from(data)[5]
