"""Gradient and parameter codecs and the chunked wire format for flat float32 vectors.

Pure code: no I/O, no clock, no global random state. Typical use:

    codec = make_codec("topk", fraction=0.01)
    msgs = encode_vector(codec, grad, sender_id=node_id, swarm_samples=n, weight=b, seed=s)
    for msg in msgs:
        send(msg)
    ...
    decode_message(msg, accumulator, scale=w)   # CodecError: refuse; accumulator untouched
"""

from p2ptrain.codecs.base import Codec, CodecError
from p2ptrain.codecs.errorfeedback import ErrorFeedback
from p2ptrain.codecs.registry import CODECS, CODECS_BY_ID, codec_from_wire, make_codec
from p2ptrain.codecs.wire import (
    DEFAULT_CHUNK,
    HEADER_SIZE,
    TRAILER_SIZE,
    Message,
    chunk_bounds,
    decode_message,
    encode_vector,
    message_size,
    parse_message,
    total_encoded_size,
)

__all__ = [
    "CODECS",
    "CODECS_BY_ID",
    "DEFAULT_CHUNK",
    "HEADER_SIZE",
    "TRAILER_SIZE",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Message",
    "chunk_bounds",
    "codec_from_wire",
    "decode_message",
    "encode_vector",
    "make_codec",
    "message_size",
    "parse_message",
    "total_encoded_size",
]
