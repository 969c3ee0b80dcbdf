"""Base directories: the frozen weights a LoRA swarm trains adapters on, named by content.

A base is a directory holding `base.safetensors` (every tensor of an `rwkv` model in our
names and layout, in fp16 or bf16 -- fp32 on request -- and the tokenizer document in its
metadata when the model has one) and `base.json`, its manifest: format, model shape, dtype,
tokenizer id and the file's size and xxh3_64 of every chunk. The base's id is the SHA-256 of
the canonical manifest (16 hex): it is part of the swarm's configuration, so two nodes agree
on a base exactly when they hold the same bytes, and a base can be fetched from any peer and
checked chunk by chunk against an id known in advance (no signature needed).

`make_base` writes one from a p2ptrain checkpoint, a Hugging Face RWKV-4 directory or a fresh
initialisation, one tensor narrowed at a time; `open_base` checks one (manifest, file size,
every chunk when asked) and maps it read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.checkpoint.manifest import MODEL_FILE, canonical_bytes
from p2ptrain.checkpoint.safetensors_io import (
    ChunkHasher,
    Deferred,
    SafetensorsError,
    write_safetensors,
)
from p2ptrain.checkpoint.store import TOKENIZER_META_KEY, chunk_size_for
from p2ptrain.codecs.kernels import f32_to_bf16_bits
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir, read_regular
from p2ptrain.models.frozen import FrozenBase
from p2ptrain.models.rwkv import RWKV, RWKVConfig

FORMAT = "p2ptrain-base/1"
BASE_FILE, MANIFEST = "base.safetensors", "base.json"
DTYPES = {"fp16": "F16", "bf16": "BF16", "fp32": "F32"}
SHAPE_KEYS = ("vocab_size", "n_layer", "n_embd", "ffn_mult")
MAX_MANIFEST_BYTES = 8 * 2**20
READ_PIECE = 8 * 2**20


class BaseError(Exception):
    """A base directory is missing, malformed, or its bytes do not match its manifest."""


@dataclass(frozen=True)
class Base:
    id: str  # sha256 of the canonical manifest, 16 hex
    path: Path  # the directory
    doc: dict  # the parsed manifest

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.doc["shape"])

    @property
    def dtype(self) -> str:
        return self.doc["dtype"]

    @property
    def tokenizer_id(self) -> str:
        return self.doc["tokenizer"]

    @property
    def size(self) -> int:
        return self.doc["file"]["size"]

    def config(self, ctx_len: int, wkv_chunk: int) -> RWKVConfig:
        """The model this base is a base of, with our training window and WKV chunk."""
        return RWKVConfig(ctx_len=ctx_len, wkv_chunk=wkv_chunk, **self.shape)

    def frozen(self, model: RWKV) -> FrozenBase:
        try:
            return FrozenBase(self.path / BASE_FILE, model.space)
        except SafetensorsError as exc:
            raise BaseError(f"base {self.id}: {exc}") from None

    def tokenizer_json(self) -> str | None:
        """The tokenizers document the base carries (None: bytes)."""
        from p2ptrain.checkpoint.safetensors_io import read_header

        with open(self.path / BASE_FILE, "rb") as f:
            header, _ = read_header(f)
        return header.get("__metadata__", {}).get(TOKENIZER_META_KEY)


def base_id(doc: dict) -> str:
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()[:16]


def parse_manifest(data: bytes) -> dict:
    """The manifest document, every field checked (BaseError names the first bad one)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BaseError(f"manifest of {len(data)} bytes is too large")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BaseError(f"manifest is not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "shape", "dtype", "tokenizer",
                                                  "file"}:
        raise BaseError("manifest must hold exactly format, shape, dtype, tokenizer, file")
    if doc["format"] != FORMAT:
        raise BaseError(f"format {doc['format']!r} is not {FORMAT}")
    shape = doc["shape"]
    if (not isinstance(shape, dict) or set(shape) != set(SHAPE_KEYS)
            or not all(type(v) is int and 1 <= v <= 1 << 20 for v in shape.values())):
        raise BaseError(f"shape must give {', '.join(SHAPE_KEYS)} as positive integers")
    if doc["dtype"] not in DTYPES.values():
        raise BaseError(f"dtype {doc['dtype']!r} is not one of {', '.join(DTYPES.values())}")
    tok = doc["tokenizer"]
    if not isinstance(tok, str) or not (tok == "bytes" or (
            len(tok) == 16 and all(c in "0123456789abcdef" for c in tok))):
        raise BaseError("tokenizer must be 'bytes' or 16 hex digits")
    f = doc["file"]
    if not isinstance(f, dict) or set(f) != {"size", "chunk_size", "xxh3_64"}:
        raise BaseError("file must hold exactly size, chunk_size, xxh3_64")
    size, chunk, hashes = f["size"], f["chunk_size"], f["xxh3_64"]
    if not (type(size) is int and 0 < size <= 1 << 40
            and type(chunk) is int and 4096 <= chunk <= 16 * 2**20):
        raise BaseError("file size or chunk size out of range")
    if (not isinstance(hashes, list) or len(hashes) != -(-size // chunk)
            or not all(isinstance(h, str) and len(h) == 16
                       and all(c in "0123456789abcdef" for c in h) for h in hashes)):
        raise BaseError("file needs one 16-hex xxh3_64 per chunk")
    return doc


def read_base(path: str | os.PathLike) -> Base:
    """The base in directory `path` (manifest checked, file size checked; bytes not read)."""
    path = Path(path)
    try:  # (never blocks on a FIFO, never reads /dev/zero)
        data = read_regular(path / MANIFEST, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise BaseError(f"{path} is not a base directory: {exc.strerror or exc}") from None
    except ValueError as exc:  # not a regular file, or too large
        raise BaseError(f"{path / MANIFEST}: {exc}") from None
    try:
        doc = parse_manifest(data)
    except BaseError as exc:
        raise BaseError(f"{path / MANIFEST}: {exc}") from None
    try:
        size = (path / BASE_FILE).stat().st_size
    except OSError as exc:
        raise BaseError(f"{path / BASE_FILE}: {exc.strerror or exc}") from None
    if size != doc["file"]["size"]:
        raise BaseError(f"{path / BASE_FILE} is {size} bytes, its manifest says "
                        f"{doc['file']['size']}")
    return Base(base_id(doc), path, doc)


def verify_base(base: Base, progress: Callable[[int, int], None] | None = None) -> None:
    """Every chunk of the base file against its manifest (BaseError names the first bad)."""
    f_doc = base.doc["file"]
    hasher = ChunkHasher(f_doc["chunk_size"])
    with open(base.path / BASE_FILE, "rb") as f:
        while piece := f.read(READ_PIECE):
            hasher.update(memoryview(piece))
            if progress:
                progress(hasher.size, f_doc["size"])
    got = hasher.finish()
    if got.size != f_doc["size"]:
        raise BaseError(f"base {base.id}: file is {got.size} bytes, not {f_doc['size']}")
    for i, (a, b) in enumerate(zip(got.chunks, f_doc["xxh3_64"], strict=True)):
        if a != b:
            raise BaseError(f"base {base.id}: chunk {i} of {BASE_FILE} is damaged "
                            f"(bytes {i * f_doc['chunk_size']}...)")


def narrowed(src: np.ndarray, dtype: str) -> Deferred:
    """src (float32, any strides) narrowed to `dtype` when the writer reaches it; bf16 by the
    codecs' kernel (round to nearest, in blocks)."""
    def make() -> np.ndarray:
        if dtype == "F32":
            return np.ascontiguousarray(src, np.float32)
        if dtype == "F16":
            with np.errstate(over="raise"):
                try:
                    return np.ascontiguousarray(src, np.float16)
                except FloatingPointError:
                    raise BaseError("a weight exceeds fp16's range; write the base as "
                                    "bf16") from None
        out = np.empty(src.shape, np.uint16)
        f32_to_bf16_bits(np.ascontiguousarray(src, np.float32).reshape(-1), out.reshape(-1))
        return out
    return Deferred(dtype, tuple(src.shape), make)


def write_base(model: RWKV, tensors: dict[str, np.ndarray], out_root: str | os.PathLike,
               dtype: str = "bf16", tokenizer_json: str | None = None,
               tokenizer_id: str = "bytes") -> Base:
    """Write a base of `model` from its float32 tensors (name -> array, e.g. views of a flat
    buffer or of a mapped checkpoint) into out_root/<id>; the existing one is kept when that
    base is already there (a damaged one is replaced). Atomic: a temporary directory,
    fsynced, renamed."""
    if dtype not in DTYPES:
        raise BaseError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    name = DTYPES[dtype]
    for slot in model.space:
        if not np.isfinite(tensors[slot.name]).all():
            raise BaseError(f"tensor {slot.name} holds NaN or infinite values")
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f".tmp-base-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        items = [(s.name, narrowed(tensors[s.name], name)) for s in model.space]
        meta = {"format": "pt"}
        if tokenizer_json is not None:
            meta[TOKENIZER_META_KEY] = tokenizer_json
        nbytes = sum(d.nbytes for _, d in items)
        digest = write_safetensors(tmp / BASE_FILE, items, meta, chunk_size_for(nbytes))
        c = model.config
        doc = {"format": FORMAT, "shape": {k: getattr(c, k) for k in SHAPE_KEYS},
               "dtype": name, "tokenizer": tokenizer_id,
               "file": {"size": digest.size, "chunk_size": digest.chunk_size,
                        "xxh3_64": digest.chunks}}
        atomic_write_bytes(tmp / MANIFEST, json.dumps(doc, indent=1).encode())
        fsync_dir(tmp)
        final = out_root / base_id(doc)
        if intact(final):
            shutil.rmtree(tmp)
        else:  # none there, or one damaged since: this one takes its place
            aside = out_root / f".tmp-damaged-{os.getpid()}"
            if final.exists():
                os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(out_root)
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_base(final)


def intact(path: Path) -> bool:
    """Whether directory `path` holds a base whose every chunk checks."""
    try:
        verify_base(read_base(path))
    except (BaseError, OSError):
        return False
    return True


def is_base_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def base_from_checkpoint(ckpt: Path, out_root: Path, dtype: str = "bf16") -> Base:
    """A base of a p2ptrain checkpoint's weights (a full `rwkv` model, read mapped)."""
    from p2ptrain import checkpoint
    from p2ptrain.models import model_from_arch

    try:
        manifest = checkpoint.read_manifest(ckpt, (MODEL_FILE,))
        model = model_from_arch(manifest.arch)
    except (checkpoint.CheckpointError, ValueError) as exc:
        raise BaseError(f"{ckpt}: {exc}") from None
    if not isinstance(model, RWKV) or "lora" in manifest.arch:
        raise BaseError(f"{ckpt}: a base is made of a full rwkv model's checkpoint")
    try:
        weights = FrozenBase(ckpt / MODEL_FILE, model.space)
    except SafetensorsError as exc:
        raise BaseError(f"{ckpt}: {exc}") from None
    tok_json = weights.metadata.get(TOKENIZER_META_KEY)
    tok_id = "bytes" if tok_json is None else hashlib.sha256(
        tok_json.encode()).hexdigest()[:16]
    return write_base(model, weights.tensors, out_root, dtype, tok_json, tok_id)


def base_from_hf(hf_dir: Path, out_root: Path, dtype: str = "bf16") -> Base:
    """A base of a Hugging Face RWKV-4 directory (read into one float32 buffer first: this
    needs 4 bytes per parameter once; a small node fetches the base from the swarm)."""
    from p2ptrain.models import hf

    try:
        config, flat = hf.load_hf(hf_dir)
    except hf.HFFormatError as exc:
        raise BaseError(f"{hf_dir}: {exc}") from None
    model = RWKV(config)
    tok_path = Path(hf_dir) / hf.TOKENIZER_FILE
    tok_json = tok_id = None
    if tok_path.is_file():
        raw = tok_path.read_bytes()
        tok_json, tok_id = raw.decode("utf-8", "replace"), hashlib.sha256(raw).hexdigest()[:16]
        if hf.is_byte_tokenizer(raw, config.vocab_size):
            tok_json = tok_id = None  # a byte model (ours, exported): trains on bytes
    return write_base(model, model.space.views(flat), out_root, dtype, tok_json,
                      tok_id or "bytes")


def base_from_init(config: RWKVConfig, seed: int, out_root: Path, dtype: str = "bf16") -> Base:
    """A base of freshly initialised weights (benchmarks and tests: no download)."""
    model = RWKV(config)
    flat = model.space.zeros()
    model.init_params(flat, np.random.default_rng(seed))
    return write_base(model, model.space.views(flat), out_root, dtype)


def make_base(source: str | os.PathLike, out_root: str | os.PathLike,
              dtype: str = "bf16") -> Base:
    """The base `source` names: a base directory as it is, else one written into out_root
    from a p2ptrain checkpoint directory or a Hugging Face RWKV-4 directory."""
    src = Path(source).expanduser()
    if is_base_dir(src):
        return read_base(src)
    if (src / "checkpoints").is_dir():  # a state directory: its newest valid checkpoint
        from p2ptrain import checkpoint

        for candidate in checkpoint.list_checkpoints(src / "checkpoints"):
            try:
                checkpoint.read_manifest(candidate)
            except checkpoint.CheckpointError:
                continue
            return base_from_checkpoint(candidate, Path(out_root), dtype)
    if (src / "manifest.json").is_file() and (src / MODEL_FILE).is_file():
        return base_from_checkpoint(src, Path(out_root), dtype)
    if (src / "config.json").is_file():
        return base_from_hf(src, Path(out_root), dtype)
    raise BaseError(f"{src} is neither a base directory, a p2ptrain checkpoint (or a state "
                    f"directory holding one) nor a Hugging Face RWKV-4 directory")
