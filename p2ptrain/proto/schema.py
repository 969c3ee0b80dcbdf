"""Field-by-field conversion between frozen dataclasses and compact JSON-able values.

A record travels as a JSON array of its fields in declaration order (no field names: compact,
and a wrong length is an error). Supported field types: int, float, bool, str, bytes, `T | None`,
`tuple[T, ...]`, `dict[str, T]` and nested dataclasses. `bytes` fields do not go into the JSON:
their contents are appended to the message's binary tail and the JSON holds their length, so a
tensor chunk (codec wire format) rides unescaped. The decoder checks every value's type and
size and raises ValueError naming the field; `wire.py` turns that into a remote error. Schemas
are compiled once per class and cached. Pure functions; the cache is the only state.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

MAX_INT = 2**63  # integers beyond this are refused (JSON peers may not even represent them)
MAX_STRING = 4096  # characters in one string
MAX_ITEMS = 65536  # entries in one tuple or dict

Encoder = Callable[[Any, list], Any]  # (value, blobs) -> JSON-able
Decoder = Callable[[Any, "BlobReader"], Any]  # (JSON value, binary tail) -> value


class BlobReader:
    """Hands out consecutive slices of a message's binary tail to `bytes` fields."""

    __slots__ = ("data", "pos")

    def __init__(self, data: memoryview | bytes):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("binary field runs past the end of the message")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def done(self) -> bool:
        return self.pos == len(self.data)


_SCHEMAS: dict[type, tuple[Encoder, Decoder]] = {}


def compile_class(cls: type) -> tuple[Encoder, Decoder]:
    """(encoder, decoder) for a dataclass; TypeError if a field type is unsupported."""
    cached = _SCHEMAS.get(cls)
    if cached is not None:
        return cached
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    convs = [_compile(hints[name], f"{cls.__name__}.{name}") for name in names]
    encs = [c[0] for c in convs]
    decs = [c[1] for c in convs]
    fields = list(zip(names, encs, strict=True))
    count = len(names)
    label = cls.__name__

    def encode(value: Any, blobs: list) -> list:
        return [enc(getattr(value, name), blobs) for name, enc in fields]

    def decode(raw: Any, blob: BlobReader) -> Any:
        if type(raw) is not list or len(raw) != count:
            raise ValueError(f"{label} must be a list of {count} fields")
        return cls(*[dec(item, blob) for dec, item in zip(decs, raw, strict=True)])

    _SCHEMAS[cls] = (encode, decode)
    return encode, decode


def _same(value: Any, blobs: list) -> Any:
    return value


def _compile(tp: Any, where: str) -> tuple[Encoder, Decoder]:
    if tp is int:

        def dec_int(raw: Any, blob: BlobReader) -> int:
            if type(raw) is not int or not -MAX_INT <= raw <= MAX_INT:
                raise ValueError(f"{where} must be an integer")
            return raw

        return _same, dec_int
    if tp is float:

        def dec_float(raw: Any, blob: BlobReader) -> float:
            if type(raw) not in (int, float) or not math.isfinite(raw):
                raise ValueError(f"{where} must be a finite number")
            return float(raw)

        return (lambda v, b: float(v)), dec_float
    if tp is bool:

        def dec_bool(raw: Any, blob: BlobReader) -> bool:
            if type(raw) is not bool:
                raise ValueError(f"{where} must be true or false")
            return raw

        return _same, dec_bool
    if tp is str:

        def dec_str(raw: Any, blob: BlobReader) -> str:
            if type(raw) is not str or len(raw) > MAX_STRING:
                raise ValueError(f"{where} must be a string of at most {MAX_STRING} characters")
            try:
                raw.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where} is not valid Unicode") from None
            return raw

        return _same, dec_str
    if tp is bytes:

        def enc_bytes(value: Any, blobs: list) -> int:
            blobs.append(value)
            return len(value)

        def dec_bytes(raw: Any, blob: BlobReader) -> bytes:
            if type(raw) is not int or raw < 0:
                raise ValueError(f"{where} must give a byte length")
            return blob.take(raw)

        return enc_bytes, dec_bytes
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        inner_enc, inner_dec = _compile(next(a for a in args if a is not type(None)), where)
        return (lambda v, b: None if v is None else inner_enc(v, b)), (
            lambda raw, blob: None if raw is None else inner_dec(raw, blob)
        )
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item_enc, item_dec = _compile(args[0], where + "[]")

        def dec_tuple(raw: Any, blob: BlobReader) -> tuple:
            if type(raw) is not list or len(raw) > MAX_ITEMS:
                raise ValueError(f"{where} must be a list of at most {MAX_ITEMS} items")
            return tuple(item_dec(item, blob) for item in raw)

        return (lambda v, b: [item_enc(x, b) for x in v]), dec_tuple
    if origin is dict and len(args) == 2 and args[0] is str:
        val_enc, val_dec = _compile(args[1], where + "{}")

        def dec_dict(raw: Any, blob: BlobReader) -> dict:
            if type(raw) is not dict or len(raw) > MAX_ITEMS:
                raise ValueError(f"{where} must be an object of at most {MAX_ITEMS} entries")
            out = {}
            for key, item in raw.items():
                if len(key) > MAX_STRING:
                    raise ValueError(f"{where} has an overlong key")
                out[key] = val_dec(item, blob)
            return out

        return (lambda v, b: {k: val_enc(x, b) for k, x in v.items()}), dec_dict
    if dataclasses.is_dataclass(tp):
        return compile_class(tp)
    raise TypeError(f"{where}: the wire cannot carry {tp!r}")
