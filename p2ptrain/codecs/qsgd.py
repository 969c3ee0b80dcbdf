"""QSGD: unbiased stochastic quantisation to s levels, scaled by the L2 norm of each bucket.

For each bucket v of `bucket` consecutive elements (the last may be shorter) the payload holds
the norm ||v|| (float32, inflated by 2^-10 so that |x|/norm < 1 despite rounding) and, per
element, the signed integer code floor(s * x / norm + u) with u uniform in [0, 1): its
expectation is s * x / norm, so decode(encode(x)) = code * norm / s is unbiased. u has 16 bits
(fresh draws from the seed's raw stream), which leaves a bias below 2^-16 of a level step.
Codes are stored in the narrowest two's-complement width holding [-s, s]: 2 bits (s = 1),
4 bits (s <= 7), 8 bits (s <= 127) or 16 bits (s <= 32767). So s = 4, 16, 256 take 4, 8, 16
bits; s = 7, 127 use their width fully. Narrow codes are packed in lanes, so that numpy packs
and unpacks them with contiguous shifts: with L = ceil(n * bits / 8) payload bytes, byte j
holds the codes of elements j, L + j, 2L + j, ... (lowest bits first; padding codes are 0).

This file owns the quantiser and its bit packing. It never allocates more than a sub-block of
float temporaries (plus one byte per element to unpack 2- and 4-bit codes), never reads the
clock or global random state, and validates every norm, code and padding bit of a payload
before writing the destination.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from p2ptrain.codecs.base import Codec, CodecError, ceil_div, check_decoded_scale, sections
from p2ptrain.codecs.kernels import (
    BLOCK,
    all_finite,
    bit_stream,
    blocks,
    bucket_blocks,
    scratch,
    uniform_u16,
)

_PARAMS = struct.Struct("<H2xI")  # levels, bucket
_INFLATE = np.float32(1.0 + 2.0**-10)
_MAX_NORM = np.float32(1.7e38)  # bucket norms above this are refused (decoding would overflow)
_TINY = 2.0**-60  # buckets with a smaller norm are rescaled first (s/norm would overflow)
_ROW_BUFFER_MIN = 1024  # smallest bucket for which decoding shrinks the ufunc buffer to a bucket


def _code_bits(levels: int) -> int:
    return 2 if levels == 1 else 4 if levels <= 7 else 8 if levels <= 127 else 16


def _unpack_narrow(packed: np.ndarray, bits: int) -> np.ndarray:
    """Sign-extended int8 codes of a packed 2- or 4-bit section, lane after lane (the padding
    codes at the end of the last lane included)."""
    lane = packed.shape[0]
    per = 8 // bits
    codes = scratch("qsgd_codes", lane * per, np.int8)
    shifted = scratch("qsgd_shift", min(lane, BLOCK), np.uint8)
    for start, stop in blocks(lane):
        tmp = shifted[: stop - start]
        for q in range(per):  # lane q sits in bits [q*bits, (q+1)*bits): move it to the top
            top = packed[start:stop].view(np.int8)
            if q < per - 1:  # a wrapping multiply: numpy's uint8 left_shift is not vectorised
                np.multiply(packed[start:stop], np.uint8(1 << (8 - bits * (q + 1))), out=tmp)
                top = tmp.view(np.int8)
            dst = codes[q * lane + start : q * lane + stop]
            np.right_shift(top, np.int8(8 - bits), out=dst)
    return codes


@dataclass(frozen=True, slots=True)
class QSGD(Codec):
    """Stochastic s-level quantisation with per-bucket L2 norms (Alistarh et al., 2017)."""

    levels: int = 127  # s: magnitude levels per sign, 1..32767 (code width 2/4/8/16 bits)
    bucket: int = 4096  # elements per norm: 8..65536, a multiple of 8

    name: ClassVar[str] = "qsgd"
    codec_id: ClassVar[int] = 6
    biased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.levels, int) or not 1 <= self.levels <= 32767:
            raise ValueError(f"qsgd levels must be an int in 1..32767, got {self.levels!r}")
        b = self.bucket
        if not isinstance(b, int) or not 8 <= b <= 65536 or b % 8:
            raise ValueError(f"qsgd bucket must be a multiple of 8 in 8..65536, got {b!r}")

    @property
    def bits(self) -> int:
        """Bits per element code."""
        return _code_bits(self.levels)

    def pack_params(self) -> bytes:
        return _PARAMS.pack(self.levels, self.bucket)

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        levels, bucket = _PARAMS.unpack(raw)
        return cls._checked_unpack(raw, levels=levels, bucket=bucket)

    def encoded_size(self, n: int) -> int:
        return 4 * ceil_div(n, self.bucket) + ceil_div(n * self.bits, 8)

    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        n, d, bits, s = x.shape[0], self.bucket, self.bits, self.levels
        norms, packed = sections(
            dst, (np.float32, ceil_div(n, d)), (np.uint8, ceil_div(n * bits, 8))
        )
        work = np.float32 if bits <= 8 else np.float64  # float32 keeps 16 random bits for s<=127
        size = min(n, d * max(1, BLOCK // d))
        y, u = scratch("qsgd_y", size, work), scratch("qsgd_u", size, work)
        narrow = scratch("qsgd_narrow", size, np.int8) if bits < 8 else None
        if bits < 8:
            packed[:] = 0
        stream = bit_stream(seed)
        for start, stop in bucket_blocks(n, d):
            m = stop - start
            rows = x[start:stop].reshape(ceil_div(m, d), -1)
            nrm = np.sqrt(np.einsum("ij,ij->i", rows, rows)) * _INFLATE
            if not all_finite(nrm) or nrm.max() > _MAX_NORM:
                raise ValueError("qsgd: a bucket's norm is too large for float32")
            norms[start // d : start // d + rows.shape[0]] = nrm
            tiny = (nrm < _TINY) & (nrm > 0)
            with np.errstate(divide="ignore", over="ignore"):
                inv = np.where(nrm >= _TINY, np.float32(s) / nrm, np.float32(0.0))
            ys = y[:m].reshape(rows.shape)
            np.multiply(rows, inv[:, None], out=ys)
            if tiny.any():  # rescale so s/norm stays finite
                up = np.float32(2.0**60)
                ys[tiny] = rows[tiny] * up * (np.float32(s) / (nrm[tiny] * up))[:, None]
            np.multiply(uniform_u16(stream, m), work(2.0**-16), out=u[:m])
            np.add(y[:m], u[:m], out=y[:m])
            np.floor(y[:m], out=y[:m])
            if bits == 8:
                np.copyto(packed[start:stop].view(np.int8), y[:m], casting="unsafe")
            elif bits == 16:
                np.copyto(packed[2 * start : 2 * stop].view(np.int16), y[:m], casting="unsafe")
            else:
                self._pack_narrow(y[:m], narrow, packed, start)

    def _pack_narrow(self, y: np.ndarray, narrow: np.ndarray, packed: np.ndarray, start: int):
        """OR the codes of elements [start, start+len(y)) into their lanes' bits."""
        bits, lane = self.bits, packed.shape[0]
        m = y.shape[0]
        codes = narrow[:m]
        np.copyto(codes, y, casting="unsafe")
        u = codes.view(np.uint8)
        np.bitwise_and(u, np.uint8((1 << bits) - 1), out=u)
        e = start
        while e < start + m:  # a segment may straddle the end of a lane
            q, j = divmod(e, lane)
            take = min(start + m - e, lane - j)
            piece = u[e - start : e - start + take]
            np.multiply(piece, np.uint8(1 << (q * bits)), out=piece)  # faster than <<
            np.bitwise_or(packed[j : j + take], piece, out=packed[j : j + take])
            e += take

    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        n, d, bits, s = out.shape[0], self.bucket, self.bits, self.levels
        norms, packed = sections(
            data, (np.float32, ceil_div(n, d)), (np.uint8, ceil_div(n * bits, 8))
        )
        if n == 0:
            return
        if not all_finite(norms) or norms.min() < 0:
            raise CodecError("qsgd: norm negative or non-finite")
        if bits == 8:
            codes = packed.view(np.int8)
        elif bits == 16:
            codes = packed.view(np.int16)
        else:  # unpacked once (n bytes) so that validation precedes every write
            codes = _unpack_narrow(packed, bits)
            if codes[n:].any():
                raise CodecError("qsgd: non-zero padding bits")
            codes = codes[:n]
        full_width = s == (1 << (bits - 1)) - 1  # then only the most negative code is invalid
        if codes.min() < -s or (not full_width and codes.max() > s):
            raise CodecError(f"qsgd: code outside [-{s}, {s}]")
        with np.errstate(over="ignore"):
            factors = (norms.astype(np.float64) * (weight / s)).astype(np.float32)
        check_decoded_scale(float(np.abs(factors).max()), 1.0, "qsgd", codes_max=s)
        temp = scratch("qsgd_dec", min(n, d * max(1, BLOCK // d)), np.float32)
        # With buckets shorter than the ufunc buffer (8192 elements), numpy copies the broadcast
        # factors into buffers spanning several buckets and the multiply runs at ~0.4x a plain
        # one; a buffer no longer than a bucket (numpy 1.x wants a multiple of 16) avoids that.
        # The buffer size is per thread (per context in numpy 2) and restored below.
        saved = None
        if _ROW_BUFFER_MIN <= d < np.getbufsize():
            saved = np.setbufsize(d - d % 16)
        try:
            for start, stop in bucket_blocks(n, d):
                f = factors[start // d : start // d + ceil_div(stop - start, d)]
                np.copyto(temp[: stop - start], codes[start:stop])  # faster than mixed multiply
                vals = temp[: stop - start].reshape(f.shape[0], -1)
                np.multiply(vals, f[:, None], out=vals)
                np.add(out[start:stop], temp[: stop - start], out=out[start:stop])
        finally:
            if saved is not None:
                np.setbufsize(saved)
