"""Scaled sign: one bit per element plus one float32 scale per bucket (signSGD with a scale).

For each bucket v of `bucket` consecutive elements (the last may be shorter) the payload holds
the scale s = mean(|v|), the L1-optimal scale for a sign code (it minimises ||v - s sign(v)||^2
over s), computed in float64 and rounded to float32; each element is decoded as +s or -s. Zero
is encoded as positive (decodes to +s), and so is -0.0: the bit is "x < 0", not the sign bit.
On a Gaussian vector the decode keeps 2/pi (~64%) of the energy.

Layout for a chunk of n elements, with B = bucket:

    4 * ceil(n / B) bytes  float32 scales, bucket by bucket
    ceil(n / 8) bytes      sign bits, element i in bit i % 8 of byte i // 8 (np.packbits with
                           bitorder="little"); a set bit means negative; padding bits are 0

The 8 parameter bytes hold the bucket as a uint32 and four zero bytes. The codec is
deterministic: the `seed` argument is ignored by both encoder and decoder. It is biased
(E[decode(encode(x))] != x), so wrap it in error feedback.

This file owns the sign quantiser and its bit packing. It works in sub-blocks of whole buckets
(about `kernels.BLOCK` elements) with temporaries of that size only, never reads the clock or
any random state, and validates every scale and padding bit of a payload before writing the
destination.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from p2ptrain.codecs.base import Codec, CodecError, ceil_div, check_decoded_scale, sections
from p2ptrain.codecs.kernels import BLOCK, all_finite, bucket_blocks, scratch

_PARAMS = struct.Struct("<I4x")  # bucket


def _sign_table() -> np.ndarray:
    """(256, 8) float32: row b holds +-1.0 for the 8 sign bits of byte b, lowest bit first."""
    bits = (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(8, dtype=np.uint16)) & 1
    table = np.where(bits == 1, np.float32(-1.0), np.float32(1.0)).astype(np.float32)
    table.flags.writeable = False
    return table


_SIGNS = _sign_table()


def _step(n: int, bucket: int) -> int:
    """Elements in the longest segment of a chunk of n."""
    return min(n, bucket * max(1, BLOCK // bucket))


@dataclass(frozen=True, slots=True)
class ScaledSign(Codec):
    """Deterministic sign compression with a mean-magnitude scale per bucket: ~1 bit/element."""

    bucket: int = 1024  # elements per scale: 8..65536, a multiple of 8

    name: ClassVar[str] = "sign"
    codec_id: ClassVar[int] = 7
    biased: ClassVar[bool] = True  # deterministic and biased: use error feedback

    def __post_init__(self) -> None:
        b = self.bucket
        if not isinstance(b, int) or not 8 <= b <= 65536 or b % 8:
            raise ValueError(f"sign bucket must be a multiple of 8 in 8..65536, got {b!r}")

    def pack_params(self) -> bytes:
        return _PARAMS.pack(self.bucket)

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        (bucket,) = _PARAMS.unpack(raw)
        return cls._checked_unpack(raw, bucket=bucket)

    def encoded_size(self, n: int) -> int:
        return 4 * ceil_div(n, self.bucket) + ceil_div(n, 8)

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        n, d = x.shape[0], self.bucket
        scales, packed = sections(dst, (np.float32, ceil_div(n, d)), (np.uint8, ceil_div(n, 8)))
        step = _step(n, d)
        magnitude = scratch("sign_abs", step, np.float32)
        negative = scratch("sign_neg", step, np.bool_)
        for start, stop in bucket_blocks(n, d):  # each start a multiple of 8
            m = stop - start
            a = magnitude[:m]
            np.abs(x[start:stop], out=a)
            rows = a.reshape(ceil_div(m, d), -1)
            # float64 sums: exact enough for any bucket, and no overflow near float32's max
            sums = np.add.reduce(rows, axis=1, dtype=np.float64)
            np.divide(sums, rows.shape[1], out=sums)
            first = start // d
            scales[first : first + rows.shape[0]] = sums  # mean <= max |x|: a finite float32
            np.less(x[start:stop], np.float32(0.0), out=negative[:m])
            # start is a multiple of 8, so the segment's bits begin on a byte; packbits zeroes
            # the padding bits of the last byte
            packed[start // 8 : ceil_div(stop, 8)] = np.packbits(negative[:m], bitorder="little")

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        n, d = out.shape[0], self.bucket
        scales, packed = sections(data, (np.float32, ceil_div(n, d)), (np.uint8, ceil_div(n, 8)))
        if n == 0:
            return
        if not all_finite(scales) or scales.min() < 0:
            raise CodecError("sign: scale negative or non-finite")
        if n % 8 and int(packed[-1]) >> (n % 8):
            raise CodecError("sign: non-zero padding bits")
        check_decoded_scale(float(scales.max()), weight, "sign")
        factors = scales * np.float32(weight)  # cannot overflow: checked just above
        step = _step(n, d)
        temp = scratch("sign_dec", ceil_div(step, 8) * 8, np.float32)
        for start, stop in bucket_blocks(n, d):  # each start a multiple of 8
            m = stop - start
            signs = temp[: ceil_div(m, 8) * 8].reshape(-1, 8)
            # one +-1.0 row per sign byte ("clip" skips the bounds check: a byte indexes 256)
            np.take(_SIGNS, packed[start // 8 : ceil_div(stop, 8)], axis=0, out=signs, mode="clip")
            f = factors[start // d : ceil_div(stop, d)]
            vals = temp[:m].reshape(f.shape[0], -1)
            np.multiply(vals, f[:, None], out=vals)
            np.add(out[start:stop], temp[:m], out=out[start:stop])
