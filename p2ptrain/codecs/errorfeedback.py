"""Error feedback: the memory that makes biased codecs (topk, int8) converge.

Each encode compresses y = x + e and keeps the new residual e = y - decode(encode(y)), so what
a codec drops is sent later instead of lost: summed over steps, decoded messages plus the final
residual equal the summed inputs (up to float32 rounding). The residual is one float32 vector
of the model's length, updated chunk by chunk in place (no second full-size buffer); it is
part of a node's resume state, so it can be passed in and read out.

This file owns the residual and nothing else: it never does I/O, never reads the clock, and
draws randomness only from the seed it is given.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from p2ptrain.codecs.base import Codec
from p2ptrain.codecs.kernels import all_finite, chunk_seed
from p2ptrain.codecs.wire import (
    DEFAULT_CHUNK,
    HEADER_SIZE,
    Origin,
    chunk_bounds,
    encode_chunk,
)


class ErrorFeedback:
    """A codec with a residual memory for vectors of length n. Not thread-safe: one encoder
    per residual."""

    def __init__(self, codec: Codec, n: int, residual: np.ndarray | None = None):
        self.codec = codec
        if residual is None:
            residual = np.zeros(int(n), np.float32)
        if (
            not isinstance(residual, np.ndarray)
            or residual.dtype != np.float32
            or residual.shape != (n,)
            or not residual.flags.c_contiguous
            or not residual.flags.writeable
        ):
            raise ValueError(f"residual must be a writable contiguous float32 array of ({n},)")
        self.residual = residual  # e: what earlier messages still owe, float32 (n,)

    def reset(self) -> None:
        """Forget the residual (e.g. after the replica was replaced by a checkpoint)."""
        self.residual[:] = 0.0

    def encode_vector(
        self,
        x: np.ndarray,
        *,
        sender_id: bytes,
        swarm_samples: int,
        weight: float,
        seed: int,
        chunk_elems: int = DEFAULT_CHUNK,
    ) -> Iterator[bytearray]:
        """The messages for x + residual, one per chunk, updating each chunk's residual as its
        message is made. Consume the iterator fully: a chunk whose message is never made keeps
        its old residual and its part of x is dropped. A ValueError (non-finite input) leaves
        the residual of chunks not yet made unchanged."""
        n = self.residual.shape[0]
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (n,):
            raise TypeError(f"x must be a float32 array of shape ({n},)")
        bounds = chunk_bounds(n, chunk_elems)
        header = Origin(sender_id, swarm_samples, weight)
        seed = int(seed) % 2**64
        codec = self.codec

        def messages() -> Iterator[bytearray]:
            for index, (offset, length) in enumerate(bounds):
                part = x[offset : offset + length]
                if not all_finite(part):
                    raise ValueError(f"chunk {index} of the input has non-finite values")
                e = self.residual[offset : offset + length]
                e += part  # e now holds y = x + e_old
                cseed = chunk_seed(seed, index)
                msg = encode_chunk(codec, e, header, n, offset, index, len(bounds), cseed)
                payload = memoryview(msg)[HEADER_SIZE : HEADER_SIZE + codec.encoded_size(length)]
                codec.decode_into(payload, e, -1.0, cseed)  # e = y - decoded
                yield msg

        return messages()
