"""The wire format of a tensor: a flat float32 vector travels as a sequence of chunk
messages, each complete in itself (header, codec payload, xxh3 checksum).

Layout of one message (little-endian, 96-byte header, then the payload, then 8 bytes):

    off size field
      0   4  magic b"P2PC"
      4   1  version (1)
      5   1  codec id (registry)
      6   2  flags, must be 0
      8   8  codec parameters (codec-specific, zero-padded)
     16   8  vector length (elements, uint64)
     24   8  chunk offset (elements, uint64)
     32   4  chunk length (elements, uint32)
     36   4  chunk index (uint32)
     40   4  chunk count (uint32)
     44   4  reserved, must be 0
     48   8  seed of this chunk (uint64; randomk regenerates its positions from it)
     56  16  sender id (raw node id bytes)
     72   8  sender's swarm sample count (uint64)
     80   8  sample weight (float64, finite, >= 0)
     88   8  payload length (bytes, uint64)
     96   P  payload (codec.encoded_size(chunk length) bytes)
   96+P   8  xxh3_64 of bytes [0, 96+P)

Every chunk except the last has the same length L, so offset = index * L and
count = ceil(vector length / L); the last ends at the vector's end. A parser can check all of
this from one message. This file owns the layout and the chunking; it never does I/O (the
transport adds its MAC around a message), never reads the clock, and a message it refuses
raises CodecError before any destination is written.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from p2ptrain.codecs.base import MAX_CHUNK, Codec, CodecError, as_u8, ceil_div
from p2ptrain.codecs.kernels import chunk_seed
from p2ptrain.codecs.registry import codec_from_wire

MAGIC = b"P2PC"
VERSION = 1
_HEADER = struct.Struct("<4sBBH8sQQIIIIQ16sQdQ")
HEADER_SIZE = _HEADER.size  # 96
TRAILER_SIZE = 8
SENDER_ID_SIZE = 16
DEFAULT_CHUNK = 1 << 20  # elements per chunk: 4 MiB of float32
_U64 = 2**64


@dataclass(frozen=True, slots=True)
class Message:
    """One parsed chunk message: header fields validated, payload not yet decoded."""

    codec: Codec  # how the payload is encoded (with its wire parameters)
    vector_length: int  # elements in the whole vector
    chunk_offset: int  # first element of this chunk in the vector
    chunk_length: int  # elements in this chunk
    chunk_index: int  # 0-based position in the sequence of chunks
    chunk_count: int  # chunks in the whole vector
    seed: int  # the chunk's seed (randomk positions)
    sender_id: bytes  # 16 raw bytes of the sender's node id
    swarm_samples: int  # the sender's swarm sample count when it encoded
    weight: float  # samples the vector averages over
    payload: np.ndarray  # uint8 view into the message

    def decode_into(self, out: np.ndarray, scale: float = 1.0) -> None:
        """out[offset:offset+length] += scale * chunk, where `out` is the whole destination
        vector. CodecError (and `out` untouched) if the payload is malformed."""
        if not isinstance(out, np.ndarray) or out.ndim != 1:
            raise TypeError("out must be a 1-D float32 numpy array")
        if out.shape[0] != self.vector_length:
            raise CodecError(
                f"message is for a vector of {self.vector_length} elements, "
                f"destination has {out.shape[0]}"
            )
        view = out[self.chunk_offset : self.chunk_offset + self.chunk_length]
        self.codec.decode_into(self.payload, view, scale, self.seed)

    def decode(self) -> np.ndarray:
        """This chunk decoded as a new float32 array (validates the payload)."""
        return self.codec.decode(self.payload, self.chunk_length, self.seed)

    def sq_norm(self) -> float:
        """Squared L2 norm of this chunk (validates the payload): sum it over a vector's
        chunks to clip a peer's gradient before applying it."""
        return self.codec.sq_norm(self.payload, self.chunk_length, self.seed)


def _chunk_count(n: int, chunk_elems: int) -> tuple[int, int]:
    """(number of chunks, length of the last) for an n-element vector."""
    if not isinstance(chunk_elems, int) or not 1 <= chunk_elems <= MAX_CHUNK:
        raise ValueError(f"chunk_elems must be an int in 1..{MAX_CHUNK}, got {chunk_elems}")
    count = max(1, ceil_div(n, chunk_elems))
    if count > MAX_CHUNK:
        raise ValueError(f"{n} elements in chunks of {chunk_elems} need too many chunks")
    return count, n - (count - 1) * chunk_elems


def chunk_bounds(n: int, chunk_elems: int = DEFAULT_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of an n-element vector; one empty chunk if n == 0."""
    count, _ = _chunk_count(n, chunk_elems)
    return [(i * chunk_elems, min(chunk_elems, n - i * chunk_elems)) for i in range(count)]


def message_size(codec: Codec, chunk_length: int) -> int:
    """Exact bytes of one message carrying a chunk of `chunk_length` elements."""
    return HEADER_SIZE + codec.encoded_size(chunk_length) + TRAILER_SIZE


def total_encoded_size(codec: Codec, n: int, chunk_elems: int = DEFAULT_CHUNK) -> int:
    """Exact bytes of all messages for an n-element vector, without encoding anything."""
    count, last = _chunk_count(n, chunk_elems)
    return (count - 1) * message_size(codec, chunk_elems) + message_size(codec, last)


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a vector and what it weighs: the per-vector header fields, checked once."""

    sender_id: bytes
    swarm_samples: int
    weight: float

    def __post_init__(self) -> None:
        if not isinstance(self.sender_id, bytes) or len(self.sender_id) != SENDER_ID_SIZE:
            raise ValueError(f"sender_id must be {SENDER_ID_SIZE} bytes")
        if not isinstance(self.swarm_samples, int) or not 0 <= self.swarm_samples < _U64:
            raise ValueError(f"swarm_samples must be a uint64, got {self.swarm_samples!r}")
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {self.weight!r}")


def encode_vector(
    codec: Codec,
    x: np.ndarray,
    *,
    sender_id: bytes,
    swarm_samples: int,
    weight: float,
    seed: int,
    chunk_elems: int = DEFAULT_CHUNK,
) -> Iterator[bytearray]:
    """The messages carrying vector x, one per chunk, produced lazily (one chunk's message
    in memory at a time). Arguments are checked before the first message is made.

    `seed` drives the codec's randomness (qsgd dither, randomk positions, topk's sample);
    pass a fresh one for every vector (e.g. from the step and node id), or randomk keeps the
    same positions and qsgd the same rounding every time."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        raise TypeError("x must be a 1-D float32 numpy array")
    if not x.flags.c_contiguous:
        raise ValueError("x must be contiguous")
    bounds = chunk_bounds(x.shape[0], chunk_elems)
    header = Origin(sender_id, swarm_samples, weight)
    seed = int(seed) % _U64

    def messages() -> Iterator[bytearray]:
        for index, (offset, length) in enumerate(bounds):
            yield encode_chunk(
                codec,
                x[offset : offset + length],
                header,
                x.shape[0],
                offset,
                index,
                len(bounds),
                chunk_seed(seed, index),
            )

    return messages()


def encode_chunk(
    codec: Codec,
    chunk: np.ndarray,
    header: Origin,
    vector_length: int,
    offset: int,
    index: int,
    count: int,
    seed: int,
) -> bytearray:
    """One message for one chunk (see `encode_vector`)."""
    size = codec.encoded_size(chunk.shape[0])
    msg = bytearray(HEADER_SIZE + size + TRAILER_SIZE)
    _HEADER.pack_into(
        msg,
        0,
        MAGIC,
        VERSION,
        codec.codec_id,
        0,
        codec.pack_params(),
        vector_length,
        offset,
        chunk.shape[0],
        index,
        count,
        0,
        seed,
        header.sender_id,
        header.swarm_samples,
        float(header.weight),
        size,
    )
    view = memoryview(msg)
    codec.encode_into(chunk, view[HEADER_SIZE : HEADER_SIZE + size], seed)
    checksum = xxhash.xxh3_64_intdigest(view[: HEADER_SIZE + size])
    struct.pack_into("<Q", msg, HEADER_SIZE + size, checksum)
    return msg


def parse_message(msg: Any) -> Message:
    """Check a message's framing and header (magic, version, checksum, codec, lengths, chunk
    geometry, weight) and return it; CodecError with a reason for the first defect found.
    The payload's contents are checked by `Message.decode_into`/`decode`."""
    data = as_u8(msg)
    total = data.shape[0]
    if total < HEADER_SIZE + TRAILER_SIZE:
        raise CodecError(f"message too short: {total} bytes")
    raw = bytes(data[:HEADER_SIZE])
    magic, version = raw[:4], raw[4]
    if magic != MAGIC:
        raise CodecError("bad magic")
    if version != VERSION:
        raise CodecError(f"unknown version {version}")
    (checksum,) = struct.unpack("<Q", bytes(data[total - TRAILER_SIZE :]))
    if xxhash.xxh3_64_intdigest(data[: total - TRAILER_SIZE]) != checksum:
        raise CodecError("checksum mismatch")
    (
        _,
        _,
        codec_id,
        flags,
        params,
        n,
        offset,
        length,
        index,
        count,
        reserved,
        seed,
        sender,
        swarm_samples,
        weight,
        payload_len,
    ) = _HEADER.unpack_from(raw)
    if flags or reserved:
        raise CodecError("reserved header bits set")
    codec = codec_from_wire(codec_id, params)
    if not math.isfinite(weight) or weight < 0:
        raise CodecError(f"sample weight {weight} is not finite and >= 0")
    _check_geometry(n, offset, length, index, count)
    expected = codec.encoded_size(length)
    if payload_len != expected or total != HEADER_SIZE + expected + TRAILER_SIZE:
        raise CodecError(
            f"payload length {payload_len} (message {total} bytes) disagrees with "
            f"{codec.name} size {expected} for {length} elements"
        )
    payload = data[HEADER_SIZE : HEADER_SIZE + expected]
    return Message(
        codec, n, offset, length, index, count, seed, sender, swarm_samples, weight, payload
    )


def _check_geometry(n: int, offset: int, length: int, index: int, count: int) -> None:
    """Refuse chunk fields that cannot come from `chunk_bounds` for some chunk size."""
    if count < 1 or index >= count:
        raise CodecError(f"chunk index {index} not below count {count}")
    if index < count - 1:  # a full chunk: its length is the nominal chunk size
        if length < 1 or offset != index * length or ceil_div(n, length) != count:
            raise CodecError(
                f"chunk {index}/{count} at {offset}+{length} does not tile {n} elements"
            )
    elif count == 1:
        if offset != 0 or length != n:
            raise CodecError(f"single chunk at {offset}+{length} for {n} elements")
    else:  # the last of several: offset = (count-1)*L with 1 <= length <= L
        nominal, rest = divmod(offset, count - 1)
        if rest or not 1 <= length <= nominal <= MAX_CHUNK or offset + length != n:
            raise CodecError(
                f"last chunk {index}/{count} at {offset}+{length} does not end {n} elements"
            )


def decode_message(msg: Any, out: np.ndarray, scale: float = 1.0) -> Message:
    """parse_message + Message.decode_into: out[chunk] += scale * decoded; returns the header.
    On CodecError nothing has been written."""
    message = parse_message(msg)
    message.decode_into(out, scale)
    return message
