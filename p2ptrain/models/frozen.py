"""A frozen base model: the weights of a full model in 16 bits, memory-mapped read-only.

The LoRA mode trains adapters on top of weights that never change. Those weights stay in the
dtype they are stored in (fp16 or bf16; fp32 is accepted too) inside one safetensors file,
mapped read-only: nodes on one machine share the pages, and nothing of the base is copied
into process memory beyond one block of a matrix at a time, widened to the compute dtype into
a reused scratch buffer (`widen`). The small vectors (norms, decays, token-shift mixes) are
widened once per compute dtype.

The header is checked like any file from disk: every tensor of the model present with its
shape, nothing else, a dtype that widens; and every value finite. The bytes themselves are
checked by the caller against the base's manifest (p2ptrain.lora.basefile).
"""

from __future__ import annotations

import os

import numpy as np

from p2ptrain.checkpoint.safetensors_io import SafetensorsError, read_header, storage_dtype
from p2ptrain.params import ParamSpace

FROZEN_DTYPES = ("F16", "BF16", "F32")


def widen(raw: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """out = raw (a tensor stored as safetensors `dtype`, any strides) in out's float dtype.
    A bfloat16 is the top half of a float32's bits."""
    if dtype == "BF16":
        if out.dtype == np.float32:
            np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            out[...] = np.left_shift(raw, 16, dtype=np.uint32).view(np.float32)
    else:
        np.copyto(out, raw, casting="same_kind")
    return out


_EXPONENT = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00),
             "F32": (np.uint32, 0x7F800000)}
FINITE_BLOCK = 1 << 22  # values checked at once


def _finite(raw: np.ndarray, dtype: str) -> bool:
    """Whether a stored tensor holds no NaN or infinity (all exponent bits set), checked on
    its bits in blocks: no widened copy."""
    bits, mask = _EXPONENT[dtype]
    flat = raw.reshape(-1).view(bits)
    for lo in range(0, flat.size, FINITE_BLOCK):
        if ((flat[lo : lo + FINITE_BLOCK] & mask) == mask).any():
            return False
    return True


class FrozenBase:
    """Read-only 16-bit views of every tensor of `space`, mapped from a safetensors file."""

    def __init__(self, path: str | os.PathLike, space: ParamSpace):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                header, start = read_header(f)
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: {exc.strerror or exc}") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", {})
        names = {s.name for s in space}
        extra = sorted(set(header) - names)
        missing = sorted(names - set(header))
        if missing or extra:
            raise SafetensorsError(
                f"{self.path} is not a base of this model: "
                + (f"missing {', '.join(missing[:4])}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"unexpected {', '.join(extra[:4])}" if extra else ""))
        self.dtypes: dict[str, str] = {}
        for slot in space:
            entry = header[slot.name]
            if entry["dtype"] not in FROZEN_DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {slot.name} is {entry['dtype']}; "
                                       f"a base holds {', '.join(FROZEN_DTYPES)}")
            if tuple(entry["shape"]) != slot.shape:
                raise SafetensorsError(f"{self.path}: tensor {slot.name} has shape "
                                       f"{entry['shape']}, the model needs {list(slot.shape)}")
            self.dtypes[slot.name] = entry["dtype"]
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, np.ndarray] = {}
        for slot in space:
            entry = header[slot.name]
            lo, hi = (start + o for o in entry["data_offsets"])
            raw = self._map[lo:hi].view(storage_dtype(entry["dtype"]))
            self.tensors[slot.name] = raw.reshape(slot.shape)
            if not _finite(raw, entry["dtype"]):
                raise SafetensorsError(f"{self.path}: tensor {slot.name} holds NaN or "
                                       f"infinite values")
        self.nbytes = sum(t.nbytes for t in self.tensors.values())

    def dtype_name(self) -> str:
        """The matrices' stored dtype (the vectors may differ), e.g. "BF16"."""
        big = max(self.tensors, key=lambda n: self.tensors[n].size)
        return self.dtypes[big]

    def widened(self, name: str, dtype=np.float32) -> np.ndarray:
        """A new array: tensor `name` in `dtype` (for the small tensors and for merging)."""
        t = self.tensors[name]
        return widen(t, self.dtypes[name], np.empty(t.shape, dtype))

    def rows(self, name: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = tensor `name`[ids] widened: ids are rows of the embedding table, or a slice
        of a matrix's rows (a block of d loss / d x = dy @ W.T)."""
        return widen(self.tensors[name][ids], self.dtypes[name], out)

    def block(self, name: str, cols: slice, out: np.ndarray) -> np.ndarray:
        """out = tensor `name`[:, cols] widened; out is scratch of that shape."""
        return widen(self.tensors[name][:, cols], self.dtypes[name], out)
