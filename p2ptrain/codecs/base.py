"""The codec contract: one small base class, the typed error for malformed input, and the
checks every codec shares.

A codec turns a flat float32 chunk into a payload of exactly `encoded_size(n)` bytes and adds
`weight * decoded` into a destination. The base class does the argument checks once (dtypes,
lengths, finiteness of the input) and leaves the numerics to `_encode_into`/`_decode_into`.
Decoders must validate the whole payload before they write anything into the destination, and
must report every defect as a `CodecError` with a reason. Codec objects are immutable values;
they hold no buffers, so one instance may be shared between threads. Nothing here does I/O,
reads the clock or touches global random state: randomness comes from the `seed` argument.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from p2ptrain.codecs.kernels import all_finite

PARAMS_SIZE = 8  # bytes of codec parameters in every message header
MAX_CHUNK = 2**32 - 1  # elements per chunk: the wire's chunk length is a uint32
NON_FINITE_INPUT = "cannot encode non-finite values"


class CodecError(ValueError):
    """A message or payload from a peer is malformed and must be refused (a remote error).

    Local misuse (a float64 gradient, a read-only destination, non-finite input to an
    encoder) raises plain TypeError/ValueError instead, so a caller can tell "the peer
    misbehaved" from "I did". `reason` is a short human-readable sentence for the 4xx reply.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# How values travel in the sparse codecs: name -> (wire code, bytes per value).
VALUE_TYPES: dict[str, tuple[int, int]] = {"fp32": (0, 4), "fp16": (1, 2), "bf16": (2, 2)}
VALUE_TYPE_NAMES: dict[int, str] = {code: name for name, (code, _) in VALUE_TYPES.items()}


class Codec(ABC):
    """A compression scheme for a flat float32 chunk. Subclasses are frozen dataclasses whose
    fields are the codec's parameters; `pack_params` puts the ones a decoder needs into the
    8-byte header field, and `unpack_params` is its exact inverse (else CodecError)."""

    __slots__ = ()

    name: ClassVar[str]  # registry name, e.g. "topk"
    codec_id: ClassVar[int]  # wire id, 0..255, unique
    biased: ClassVar[bool]  # E[decode(encode(x))] != x: wrap it in error feedback
    checks_finite: ClassVar[bool] = False  # _encode_into raises ValueError on inf/NaN itself

    # -- parameters -------------------------------------------------------------------------

    def params(self) -> dict[str, Any]:
        """The parameters as plain data (what `make_codec(name, **params)` takes back)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if not f.name.startswith("_")
        }

    def pack_params(self) -> bytes:
        """The 8 header bytes that tell a decoder how to read this codec's payloads."""
        return bytes(PARAMS_SIZE)

    @classmethod
    def unpack_params(cls, raw: bytes) -> Codec:
        """The codec a header's parameter bytes describe; CodecError if they are invalid."""
        if bytes(raw) != bytes(PARAMS_SIZE):
            raise CodecError(f"{cls.name}: parameter bytes must be zero")
        return cls()

    @classmethod
    def _checked_unpack(cls, raw: bytes, **params: Any) -> Codec:
        """Build from decoded header params, refusing any bytes that would not re-pack equal
        (bad padding, non-canonical values), and turning parameter errors into CodecError."""
        try:
            codec = cls(**params)
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{cls.name}: bad parameters: {exc}") from None
        if codec.pack_params() != bytes(raw):
            raise CodecError(f"{cls.name}: non-canonical parameter bytes")
        return codec

    # -- sizes ------------------------------------------------------------------------------

    @abstractmethod
    def encoded_size(self, n: int) -> int:
        """Exact payload bytes for a chunk of n elements (a function of n and the params)."""

    # -- encoding ---------------------------------------------------------------------------

    def encode_into(self, x: np.ndarray, dst: Any, seed: int = 0) -> None:
        """Write the payload for chunk `x` into `dst` (a writable buffer of exactly
        `encoded_size(len(x))` bytes). `seed` feeds the codec's randomness, if any."""
        x = _check_vector(x, "x")
        buf = _as_writable_u8(dst)
        size = self.encoded_size(x.shape[0])
        if buf.shape[0] != size:
            raise ValueError(f"destination holds {buf.shape[0]} bytes, payload needs {size}")
        if not self.checks_finite and not all_finite(x):
            raise ValueError(NON_FINITE_INPUT)
        self._encode_into(x, buf, int(seed))

    def encode(self, x: np.ndarray, seed: int = 0) -> bytearray:
        """The payload for chunk `x` as a new buffer."""
        out = bytearray(self.encoded_size(_check_vector(x, "x").shape[0]))
        self.encode_into(x, out, seed)
        return out

    @abstractmethod
    def _encode_into(self, x: np.ndarray, dst: np.ndarray, seed: int) -> None:
        """Encode finite contiguous float32 `x` into the uint8 array `dst` of the exact size."""

    # -- decoding ---------------------------------------------------------------------------

    def decode_into(
        self, payload: Any, out: np.ndarray, weight: float = 1.0, seed: int = 0
    ) -> None:
        """out += weight * decode(payload), where len(out) is the chunk length. The payload is
        validated in full first: on CodecError, `out` is untouched."""
        out = _check_vector(out, "out", writable=True)
        data = self.payload_view(payload, out.shape[0])
        weight = float(weight)
        if not math.isfinite(weight) or abs(weight) > 1e30:
            raise ValueError(f"weight must be finite and at most 1e30 in magnitude: {weight}")
        self._decode_into(data, out, weight, int(seed))

    def decode(self, payload: Any, n: int, seed: int = 0) -> np.ndarray:
        """The decoded chunk of n elements as a new float32 array."""
        out = np.zeros(int(n), np.float32)
        self.decode_into(payload, out, 1.0, seed)
        return out

    def payload_view(self, payload: Any, n: int) -> np.ndarray:
        """The payload as a uint8 array, if its length is right for a chunk of n elements."""
        data = as_u8(payload)
        size = self.encoded_size(n)
        if data.shape[0] != size:
            raise CodecError(
                f"{self.name}: payload is {data.shape[0]} bytes, {n} elements need {size}"
            )
        return data

    def sq_norm(self, payload: Any, n: int, seed: int = 0) -> float:
        """Squared L2 norm of the decoded chunk (validates the payload like `decode`): lets a
        receiver clip a peer's gradient before adding it anywhere."""
        chunk = self.decode(payload, n, seed)
        return float(np.einsum("i,i->", chunk, chunk, dtype=np.float64))

    @abstractmethod
    def _decode_into(self, data: np.ndarray, out: np.ndarray, weight: float, seed: int) -> None:
        """Validate `data` (uint8, exact size) completely, then out += weight * decoded."""


# -- helpers shared by the codec files -----------------------------------------------------


def as_u8(buffer: Any) -> np.ndarray:
    """A uint8 array view of a bytes-like object (no copy)."""
    if isinstance(buffer, np.ndarray):
        if buffer.dtype != np.uint8 or buffer.ndim != 1:
            raise TypeError("payload array must be 1-D uint8")
        return buffer
    return np.frombuffer(buffer, dtype=np.uint8)


def _as_writable_u8(buffer: Any) -> np.ndarray:
    arr = as_u8(buffer)
    if not arr.flags.writeable:
        raise TypeError("destination buffer is read-only")
    return arr


def _check_vector(a: Any, what: str, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 1:
        raise TypeError(f"{what} must be a 1-D float32 numpy array")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    if a.shape[0] > MAX_CHUNK:
        raise ValueError(f"{what} has {a.shape[0]} elements; a chunk holds at most {MAX_CHUNK}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} must be writable")
    return a


def sections(data: np.ndarray, *spec: tuple[Any, int]) -> list[np.ndarray]:
    """Split a uint8 payload into consecutive typed views: sections(data, (np.float32, nb),
    (np.int8, n)). The caller has checked the total size."""
    views = []
    pos = 0
    for dtype, count in spec:
        dt = np.dtype(dtype)
        end = pos + dt.itemsize * count
        views.append(data[pos:end].view(dt))
        pos = end
    if pos != data.shape[0]:  # an internal size formula disagrees with the layout
        raise AssertionError(f"payload layout covers {pos} of {data.shape[0]} bytes")
    return views


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_decoded_scale(
    max_magnitude: float, weight: float, what: str, codes_max: float = 1.0
) -> None:
    """Refuse a payload whose largest decoded value, codes_max * (max_magnitude * weight) in
    float32 as the decoders compute it, is not finite (it would write infinities)."""
    with np.errstate(over="ignore", invalid="ignore"):
        top = np.float32(codes_max) * (np.float32(max_magnitude) * np.float32(abs(weight)))
    if not np.isfinite(top):
        raise CodecError(f"{what}: decoded values overflow ({max_magnitude:.3g} x {weight:.3g})")
