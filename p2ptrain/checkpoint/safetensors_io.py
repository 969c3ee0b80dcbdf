"""Writing and reading safetensors files straight from and into existing buffers.

The format: 8 bytes little-endian header length, a JSON header (name -> dtype, shape,
data_offsets; optional "__metadata__" of strings), then the raw little-endian tensor bytes,
back to back. The `safetensors` library's writer copies every tensor, which a 4 GB model
cannot afford; here each tensor is written from its view of the flat buffer, and read back
with `readinto` into its view, so no second copy of the model ever exists. While writing,
the bytes are hashed in fixed-size chunks (xxh3_64) for the manifest.

A header read from disk is hostile until checked: its size, every dtype, shape and offset.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I8": np.int8, "U16": np.uint16, "U8": np.uint8}
DTYPE_NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}
# Dtypes numpy lacks, read as their raw bits and never written: a bfloat16 is the top half of
# a float32's bits, so a reader widens the uint16 words itself.
RAW_DTYPES = {"BF16": np.uint16}
MAX_HEADER_BYTES = 100 * 2**20
WRITE_PIECE = 1 << 20


class SafetensorsError(Exception):
    """The file is not a well-formed safetensors file of the expected content."""


@dataclass(frozen=True)
class FileDigest:
    size: int  # bytes in the file
    chunk_size: int  # bytes per hashed chunk (the last may be shorter)
    chunks: list[str]  # xxh3_64 hex digest of each chunk


class ChunkHasher:
    """xxh3_64 of consecutive fixed-size chunks of a byte stream."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.size = 0
        self.digests: list[str] = []
        self._h = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_size - self._fill)
            self._h.update(data[:take])
            self._fill += take
            self.size += take
            data = data[take:]
            if self._fill == self.chunk_size:
                self.digests.append(self._h.hexdigest())
                self._h = xxhash.xxh3_64()
                self._fill = 0

    def finish(self) -> FileDigest:
        if self._fill or not self.digests:
            self.digests.append(self._h.hexdigest())
            self._fill = 0
        return FileDigest(self.size, self.chunk_size, self.digests)


@dataclass(frozen=True)
class Deferred:
    """A tensor whose bytes are made only when the writer reaches it (a narrowed copy of a
    big tensor: one exists at a time). `dtype` is the safetensors name (BF16 included)."""

    dtype: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]  # -> a contiguous array of exactly those bytes

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype a tensor of safetensors dtype `name` is read into."""
    return np.dtype(DTYPES[name] if name in DTYPES else RAW_DTYPES[name])


def _bytes_of(array: np.ndarray) -> memoryview:
    if not array.flags.c_contiguous:
        raise ValueError("tensors are written from contiguous views")
    return memoryview(array.reshape(-1)).cast("B")


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str],
    chunk_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> FileDigest:
    """Write `tensors` (name, array) to `path`, fsync it, and return its digest.

    Contiguous arrays are written from their memory; any other (a transposed view) is copied
    when its turn comes, so at most one tensor is ever copied at a time.
    `progress(bytes_written, total_bytes)` is called after each tensor."""
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, arr in tensors:
        dtype = (arr.dtype if isinstance(arr, Deferred)
                 else DTYPE_NAMES.get(arr.dtype.newbyteorder("<").str))
        if dtype is None:
            raise ValueError(f"tensor {name}: unsupported dtype {arr.dtype}")
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    total = len(head) + offset
    hasher = ChunkHasher(chunk_size)
    with open(path, "wb") as f:
        f.write(head)
        hasher.update(memoryview(head))
        written = len(head)
        for _name, arr in tensors:
            data = _bytes_of(arr.make() if isinstance(arr, Deferred)
                             else np.ascontiguousarray(arr))
            if len(data) != arr.nbytes:
                raise ValueError(f"tensor {_name}: {len(data)} bytes made, {arr.nbytes} declared")
            for start in range(0, len(data), WRITE_PIECE):
                piece = data[start : start + WRITE_PIECE]
                f.write(piece)
                hasher.update(piece)
            written += len(data)
            data = piece = None  # (a made tensor goes before the next is made: one at a time)
            if progress:
                progress(written, total)
        f.flush()
        os.fsync(f.fileno())
    return hasher.finish()


def read_header(f) -> tuple[dict, int]:
    """(header, data_start) of an open safetensors file, every entry validated."""
    f.seek(0, os.SEEK_END)
    file_size = f.tell()
    f.seek(0)
    raw = f.read(8)
    if len(raw) != 8:
        raise SafetensorsError("file is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise SafetensorsError(f"header length {n} is impossible for a {file_size}-byte file")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as exc:  # JSON's, UTF-8's, a number of 4,300+ digits
        raise SafetensorsError(f"header is not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    data_size = file_size - 8 - n
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise SafetensorsError("__metadata__ must map strings to strings")
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or (dtype not in DTYPES and dtype not in RAW_DTYPES):
            raise SafetensorsError(f"tensor {name!r}: bad entry or dtype")
        shape, offs = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2
                and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1] <= data_size):
            raise SafetensorsError(f"tensor {name!r}: data offsets {offs!r} out of range")
        # Python ints: exact for any shape a header may claim (numpy's int64 product wraps
        # or overflows, e.g. [2**62, 4] -> 0 bytes)
        nbytes = math.prod(shape) * storage_dtype(entry["dtype"]).itemsize
        if offs[1] - offs[0] != nbytes:
            raise SafetensorsError(f"tensor {name!r}: offsets do not match shape {shape}")
        spans.append((offs[0], offs[1]))
    spans.sort()
    end = 0
    for a, b in spans:
        if a != end:
            raise SafetensorsError("tensor data overlaps or leaves a hole")
        end = b
    if end != data_size:
        raise SafetensorsError(f"tensor data covers {end} of {data_size} bytes")
    return header, 8 + n


def read_into(f, header: dict, data_start: int, targets: dict[str, np.ndarray]) -> None:
    """Fill each target array from the tensor of the same name; names, dtypes and shapes must
    match exactly. Every check runs before the first byte lands in a target."""
    missing = sorted(set(targets) - set(header))
    if missing:
        raise SafetensorsError(f"missing tensors: {', '.join(missing[:5])}")
    for name, dest in targets.items():
        entry = header[name]
        if storage_dtype(entry["dtype"]) != dest.dtype or tuple(entry["shape"]) != dest.shape:
            raise SafetensorsError(
                f"tensor {name!r} is {entry['dtype']} {entry['shape']}, "
                f"expected {DTYPE_NAMES.get(dest.dtype.str, dest.dtype)} {list(dest.shape)}"
            )
    for name, dest in targets.items():
        f.seek(data_start + header[name]["data_offsets"][0])
        view = _bytes_of(dest)
        got = f.readinto(view)
        if got != len(view):
            raise SafetensorsError(f"tensor {name!r} is truncated")
