"""Parameter space: a model's named arrays laid out in one contiguous buffer.

Everything that moves or transforms a whole model -- codecs, averaging, hashing,
checkpoints -- works on the flat vector; the model works on named views of it. No copies
are ever needed to go from one to the other. This file owns the layout and its fingerprint
and never allocates more than the buffers it is asked for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

# Each tensor starts on a multiple of this many elements (64 bytes for float32), so views are
# aligned for SIMD kernels and chunk boundaries of codecs never split a cache line oddly.
ALIGN_ELEMENTS = 16


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one named tensor lives in the flat buffer."""

    name: str  # unique name, e.g. "blocks.0.att.key"
    shape: tuple[int, ...]  # shape of the view
    offset: int  # first element in the flat buffer
    size: int  # number of elements (product of shape)


class ParamSpace:
    """An ordered set of named tensor shapes mapped onto one flat buffer."""

    def __init__(self, shapes: Iterable[tuple[str, tuple[int, ...]]]):
        slots: list[TensorSlot] = []
        offset = 0
        seen: set[str] = set()
        for name, shape in shapes:
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            shape = tuple(int(d) for d in shape)
            if any(d <= 0 for d in shape):
                raise ValueError(f"tensor {name!r} has a non-positive dimension: {shape}")
            seen.add(name)
            size = int(np.prod(shape, dtype=np.int64)) if shape else 1
            offset = -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
            slots.append(TensorSlot(name, shape, offset, size))
            offset += size
        self.slots: tuple[TensorSlot, ...] = tuple(slots)
        self.size: int = -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS  # padded total length
        self._by_name = {s.name: s for s in self.slots}

    def __iter__(self) -> Iterator[TensorSlot]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def slot(self, name: str) -> TensorSlot:
        return self._by_name[name]

    @property
    def n_params(self) -> int:
        """Number of real parameters (padding between tensors excluded)."""
        return sum(s.size for s in self.slots)

    def zeros(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """A new zeroed flat buffer for this layout (padding stays zero forever)."""
        return np.zeros(self.size, dtype=dtype)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named views into `flat`; writing to a view writes the buffer."""
        self.check_buffer(flat)
        return {s.name: flat[s.offset : s.offset + s.size].reshape(s.shape) for s in self.slots}

    def view(self, flat: np.ndarray, name: str) -> np.ndarray:
        s = self._by_name[name]
        return flat[s.offset : s.offset + s.size].reshape(s.shape)

    def check_buffer(self, flat: np.ndarray) -> None:
        if flat.ndim != 1 or flat.shape[0] != self.size:
            raise ValueError(f"buffer has shape {flat.shape}, layout needs ({self.size},)")
        if not flat.flags.c_contiguous:
            raise ValueError("buffer must be contiguous")

    def describe(self) -> list[dict]:
        """The layout as plain data (names, shapes, offsets), for manifests and fingerprints."""
        return [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots]

    def fingerprint(self) -> str:
        """A short stable hash of the layout: two nodes with equal fingerprints can exchange
        flat vectors element for element."""
        blob = json.dumps(self.describe(), separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
