"""The one table of codecs: name -> class and wire id -> class, checked when imported.

Adding a codec means adding its class to `_ALL` below; the import-time check refuses
duplicate names or ids, ids outside a byte, and classes missing the contract's attributes, so a
mistake fails every test at once instead of corrupting messages. This file builds codecs from
names (configuration) and from header bytes (the wire); it holds no other state and never
does I/O.
"""

from __future__ import annotations

from typing import Any

from p2ptrain.codecs.base import PARAMS_SIZE, Codec, CodecError
from p2ptrain.codecs.dense import BFloat16, Float16, Int8, NoCompression
from p2ptrain.codecs.qsgd import QSGD
from p2ptrain.codecs.sign import ScaledSign
from p2ptrain.codecs.sparse import RandomK, TopK

_ALL: tuple[type[Codec], ...] = (
    NoCompression,
    Float16,
    BFloat16,
    Int8,
    TopK,
    RandomK,
    QSGD,
    ScaledSign,
)


def _build(
    classes: tuple[type[Codec], ...],
) -> tuple[dict[str, type[Codec]], dict[int, type[Codec]]]:
    by_name: dict[str, type[Codec]] = {}
    by_id: dict[int, type[Codec]] = {}
    for cls in classes:
        name, cid = getattr(cls, "name", None), getattr(cls, "codec_id", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"codec {cls.__name__} needs a `name` that is an identifier")
        if not isinstance(cid, int) or not 0 <= cid <= 255:
            raise TypeError(f"codec {cls.__name__} needs a `codec_id` in 0..255")
        if name in by_name or cid in by_id:
            raise TypeError(f"codec {cls.__name__}: name {name!r} or id {cid} already taken")
        if len(cls().pack_params()) != PARAMS_SIZE:
            raise TypeError(f"codec {cls.__name__}: pack_params must give {PARAMS_SIZE} bytes")
        by_name[name] = cls
        by_id[cid] = cls
    return by_name, by_id


CODECS, CODECS_BY_ID = _build(_ALL)
"""name -> codec class, wire id -> codec class."""


def make_codec(name: str, **params: Any) -> Codec:
    """A codec from its registry name and parameters: make_codec("topk", fraction=0.01)."""
    try:
        cls = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    return cls(**params)


def codec_from_wire(codec_id: int, params: bytes) -> Codec:
    """The codec a message header names; CodecError for unknown ids or bad parameters."""
    cls = CODECS_BY_ID.get(codec_id)
    if cls is None:
        raise CodecError(f"unknown codec id {codec_id}")
    if len(params) != PARAMS_SIZE:
        raise CodecError(f"codec parameters are {len(params)} bytes, expected {PARAMS_SIZE}")
    return cls.unpack_params(params)
