"""Dense codecs: every element travels. `none` (float32), `fp16`, `bf16` and `int8` (block-wise
absmax scaling).

Each works chunk by chunk in sub-blocks of `kernels.BLOCK` elements with temporaries of that
size only, validates a payload completely (non-finite values, out-of-range codes, scales that
would overflow the destination) before touching the destination, and never allocates a buffer
of the chunk's size. No I/O, no clock, no randomness: these codecs are deterministic.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from p2ptrain.codecs.base import (
    Codec,
    CodecError,
    ceil_div,
    check_decoded_scale,
    sections,
)
from p2ptrain.codecs.kernels import (
    BLOCK,
    F16_MAX,
    all_finite,
    bf16_bits_to_f32,
    blocks,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    max_abs,
    max_magnitude_bits,
    scratch,
)


def _add_scaled(out: np.ndarray, values: np.ndarray, weight: float) -> None:
    """out += weight * values for float32 arrays, with a sub-block temporary only."""
    if weight == 1.0:
        np.add(out, values, out=out)
        return
    temp = scratch("dense", min(out.shape[0], BLOCK), np.float32)
    w = np.float32(weight)
    for start, stop in blocks(out.shape[0]):
        s = temp[: stop - start]
        np.multiply(values[start:stop], w, out=s)
        np.add(out[start:stop], s, out=out[start:stop])


@dataclass(frozen=True, slots=True)
class NoCompression(Codec):
    """float32 as is: 4 bytes per element. For tests, baselines and fast LANs."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0
    biased: ClassVar[bool] = False

    def encoded_size(self, n: int) -> int:
        return 4 * n

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        np.copyto(dst.view(np.float32), x)

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        (values,) = sections(data, (np.float32, out.shape[0]))
        if not all_finite(values):
            raise CodecError("none: non-finite value")
        if abs(weight) > 1.0:
            check_decoded_scale(max_abs(values), weight, "none")
        _add_scaled(out, values, weight)


@dataclass(frozen=True, slots=True)
class Float16(Codec):
    """IEEE half precision: 2 bytes per element, relative error <= 2^-11 for |x| >= 6.1e-5
    (absolute <= 2^-25 below), saturating at +-65504. Round to nearest, ties away from zero."""

    name: ClassVar[str] = "fp16"
    codec_id: ClassVar[int] = 1
    biased: ClassVar[bool] = False  # rounding to nearest: bias only from saturation

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        f32_to_f16_bits(x, dst.view(np.uint16))

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        (bits,) = sections(data, (np.uint16, out.shape[0]))
        if max_magnitude_bits(bits) >= 0x7C00:
            raise CodecError("fp16: non-finite value")
        check_decoded_scale(F16_MAX, weight, "fp16")
        temp = scratch("dense", min(out.shape[0], BLOCK), np.float32)
        for start, stop in blocks(out.shape[0]):
            s = temp[: stop - start]
            f16_bits_to_f32(bits[start:stop], s, weight)
            np.add(out[start:stop], s, out=out[start:stop])


@dataclass(frozen=True, slots=True)
class BFloat16(Codec):
    """bfloat16 (the top half of float32): 2 bytes per element, float32's range, relative
    error <= 2^-8 (8 significant bits). Round to nearest, ties away from zero."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 2
    biased: ClassVar[bool] = False

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        f32_to_bf16_bits(x, dst.view(np.uint16))

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        (bits,) = sections(data, (np.uint16, out.shape[0]))
        top = max_magnitude_bits(bits)
        if top >= 0x7F80:
            raise CodecError("bf16: non-finite value")
        check_decoded_scale(float(np.uint32(top << 16).view(np.float32)), weight, "bf16")
        temp = scratch("dense", min(out.shape[0], BLOCK), np.float32)
        for start, stop in blocks(out.shape[0]):
            s = temp[: stop - start]
            bf16_bits_to_f32(bits[start:stop], s, weight)
            np.add(out[start:stop], s, out=out[start:stop])


_INT8_PARAMS = struct.Struct("<I4x")
_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
_TINY = 2.0**-100  # blocks with absmax below this are rescaled first (127/absmax would overflow)


@dataclass(frozen=True, slots=True)
class Int8(Codec):
    """Block-wise absmax int8: per block of `block` elements a float32 scale s = absmax/127
    and one int8 code per element, rounded to nearest; |x - decoded| <= s/2 per element."""

    block: int = 256  # elements per scale; 8..65536 (scale overhead 4/block bytes per element)

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3
    biased: ClassVar[bool] = True  # deterministic rounding: use error feedback

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or not 8 <= self.block <= 65536:
            raise ValueError(f"int8 block must be an int in 8..65536, got {self.block!r}")

    def pack_params(self) -> bytes:
        return _INT8_PARAMS.pack(self.block)

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        (block,) = _INT8_PARAMS.unpack(raw)
        return cls._checked_unpack(raw, block=block)

    def encoded_size(self, n: int) -> int:
        return 4 * ceil_div(n, self.block) + n

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        n, b = x.shape[0], self.block
        scales, codes = sections(dst, (np.float32, ceil_div(n, b)), (np.int8, n))
        step = b * max(1, BLOCK // b)
        temp = scratch("dense", min(n, step), np.float32)
        for start, stop in blocks(n - n % b, step):  # whole blocks
            rows_scales = scales[start // b : stop // b]
            self._encode_rows(x[start:stop], rows_scales, codes[start:stop], temp)
        if n % b:  # the final partial block
            start = n - n % b
            self._encode_rows(x[start:], scales[start // b :], codes[start:], temp)

    def _encode_rows(self, x: np.ndarray, scales: np.ndarray, codes: np.ndarray, temp) -> None:
        rows = x.reshape(scales.shape[0], -1)  # (blocks, block)
        y = temp[: x.shape[0]].reshape(rows.shape)
        np.abs(x, out=y.reshape(-1))
        # reduceat is ~1.6x faster than max(axis=1) over short rows
        absmax = np.maximum.reduceat(y.reshape(-1), np.arange(0, x.shape[0], rows.shape[1]))
        tiny = (absmax < _TINY) & (absmax > 0)
        with np.errstate(divide="ignore", over="ignore"):
            inv = np.where(absmax >= _TINY, np.float32(127.0) / absmax, np.float32(0.0))
        np.multiply(rows, inv[:, None], out=y)
        if tiny.any():  # subnormal-sized blocks: scale up first so 127/absmax stays finite
            up = np.float32(2.0**100)
            big = absmax[tiny] * up
            y[tiny] = rows[tiny] * up * (np.float32(127.0) / big)[:, None]
        np.add(y, _ROUND_MAGIC, out=y)
        np.copyto(codes, y.reshape(-1).view(np.int32), casting="unsafe")  # low byte = code
        np.divide(absmax, np.float32(127.0), out=scales)
        with np.errstate(over="ignore"):
            over = ~np.isfinite(np.float32(127.0) * scales)
        if over.any():  # |x| within 2^-23 of float32's max: keep 127 * scale finite
            scales[over] = np.nextafter(scales[over], np.float32(0.0))

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        n, b = out.shape[0], self.block
        scales, codes = sections(data, (np.float32, ceil_div(n, b)), (np.int8, n))
        if scales.size:
            if not all_finite(scales) or scales.min() < 0:
                raise CodecError("int8: scale negative or non-finite")
            if codes.min() < -127:
                raise CodecError("int8: code -128 is not produced by this codec")
            check_decoded_scale(float(scales.max()), weight, "int8", codes_max=127)
        step = b * max(1, BLOCK // b)
        temp = scratch("dense", min(n, step), np.float32)
        factors = scales * np.float32(weight)
        for start, stop in (*blocks(n - n % b, step), (n - n % b, n)):
            if stop == start:
                continue
            f = factors[start // b : ceil_div(stop, b)]
            np.copyto(temp[: stop - start], codes[start:stop])  # faster than a mixed multiply
            y = temp[: stop - start].reshape(f.shape[0], -1)
            np.multiply(y, f[:, None], out=y)
            np.add(out[start:stop], temp[: stop - start], out=out[start:stop])
