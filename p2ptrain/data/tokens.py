"""A prepared corpus on disk: token-id shards read a window at a time, and their meta.

    DIR/meta.json        {"format", "vocab_size", "dtype", "tokenizer_sha256", "tokens",
                          "holdout_fraction", "train": [shard, ...], "heldout": [...],
                          "sources": [...]}; a shard is {"file", "tokens"}
    DIR/tokenizer.json   the Hugging Face `tokenizers` document the ids came from
    DIR/train-00000.bin  raw little-endian token ids (uint16 when the vocabulary fits, else
                         uint32), back to back; DIR/heldout-00000.bin the same

`data prepare` writes it (prepare.py); `join --data DIR` reads it here, so a corpus larger
than memory works: only the pages a window touches are read. Everything is hostile until
checked: the meta's shape and types, shard names (plain file names in DIR), shard sizes
against their token counts, the tokenizer's hash, and -- when a window is read -- no id at
or above the vocabulary (checked per window, as a shard is never read whole).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "p2ptrain-tokens/1"
META_FILE, TOKENIZER_FILE = "meta.json", "tokenizer.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SHARD_RE = re.compile(r"(train|heldout)-[0-9]{5}\.bin")
MAX_META_BYTES = 16 * 2**20
MAX_VOCAB = 2**31


class TokenDataError(Exception):
    """A prepared corpus cannot be used; the message says why, in one line."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Shard:
    """One shard file of `size` ids, read a window at a time (pread). A memmap of a file
    truncated or replaced under it -- a shard copied over during a run, a corpus on a USB
    disk pulled out -- killed the process with SIGBUS; a short read is an error that says so."""

    def __init__(self, path: Path, dtype: np.dtype, size: int):
        self.path, self.dtype, self.size = path, dtype, size

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, _ = key.indices(self.size)
        want = max(0, hi - lo) * self.dtype.itemsize
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                data = os.pread(fd, want, lo * self.dtype.itemsize)
            finally:
                os.close(fd)
        except OSError as exc:
            raise TokenDataError(f"shard {self.path}: {exc.strerror or exc}") from None
        if len(data) != want:
            raise TokenDataError(f"shard {self.path} is shorter than meta.json says (changed "
                                 f"during the run?)")
        return np.frombuffer(data, self.dtype)


class TokenShards:
    """The concatenation of a split's shards, read lazily: `size`, and slices `[a:b]` (which
    may cross shard boundaries) as arrays, with every id checked against the vocabulary."""

    def __init__(self, maps: list[Shard], vocab_size: int):
        self.maps, self.vocab_size = maps, vocab_size
        self.starts = np.cumsum([0] + [m.size for m in maps])
        self.size = int(self.starts[-1])
        self.dtype = maps[0].dtype if maps else np.dtype("<u2")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("token shards take plain slices")
        a, b, _ = key.indices(self.size)
        start, parts = a, []
        first = int(np.searchsorted(self.starts, a, side="right")) - 1
        i = max(first, 0)
        while a < b and i < len(self.maps):
            lo = a - int(self.starts[i])
            take = min(b - a, self.maps[i].size - lo)
            parts.append(self.maps[i][lo : lo + take])
            a += take
            i += 1
        if not parts:
            return np.empty(0, self.dtype)
        out = np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])
        if out.size and int(out.max()) >= self.vocab_size:
            at = start + int(np.argmax(out >= self.vocab_size))
            raise TokenDataError(f"token id {int(out.max())} (near token {at:,} of the split) "
                                 f"is not below the vocabulary size {self.vocab_size}: the "
                                 f"shards are damaged; prepare the corpus again")
        return out


@dataclass(frozen=True)
class Prepared:
    """A prepared corpus, opened."""

    root: Path
    vocab_size: int
    tokenizer_json: str  # the tokenizer document (for sample, export and the hash)
    tokenizer_id: str  # sha256 of tokenizer.json, first 16 hex digits
    train: TokenShards
    heldout: TokenShards


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise TokenDataError(f"meta.json: {what} is not a count")
    return value


def _shards(root: Path, meta: dict, split: str, dtype: np.dtype, vocab: int) -> TokenShards:
    listed = meta.get(split)
    if not isinstance(listed, list) or not listed or len(listed) > 100_000:
        raise TokenDataError(f"meta.json: `{split}` must list its shards")
    maps, seen = [], set()
    for entry in listed:
        if not isinstance(entry, dict) or set(entry) != {"file", "tokens"}:
            raise TokenDataError(f"meta.json: a {split} shard entry is malformed")
        name, tokens = entry["file"], _count(entry["tokens"], "a shard's tokens")
        if not isinstance(name, str) or not SHARD_RE.fullmatch(name) \
                or not name.startswith(split):
            raise TokenDataError(f"meta.json: {str(name)[:60]!r} is not a {split} shard name")
        if name in seen:  # it doubled the split's text
            raise TokenDataError(f"meta.json: shard {name} is listed twice")
        seen.add(name)
        path = root / name
        try:
            size = path.stat().st_size
        except OSError:
            raise TokenDataError(f"{root}: shard {name} is missing") from None
        if size != tokens * dtype.itemsize:
            raise TokenDataError(f"{root}: shard {name} has {size} bytes, meta.json says "
                                 f"{tokens} tokens of {dtype.itemsize} bytes (truncated?)")
        if tokens:
            maps.append(Shard(path, dtype, tokens))
    if not maps:
        raise TokenDataError(f"{root}: the {split} split is empty")
    return TokenShards(maps, vocab)


def vocab_of(tokenizer: Any) -> int:
    """The number of ids a `tokenizers.Tokenizer` can produce: its highest id + 1 (a
    vocabulary with gaps has ids past its count of entries), added tokens included."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def plain(tokenizer: Any) -> Any:
    """`tokenizer` without the truncation and padding a Hugging Face tokenizer.json may carry
    (set for a model's inputs, they would silently cut or pad every line of a corpus)."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _tokenizer_vocab(tokenizer_json: str, root: Path) -> int:
    from tokenizers import Tokenizer

    try:
        return vocab_of(Tokenizer.from_str(tokenizer_json))
    except Exception as exc:  # the library raises its own exception types
        raise TokenDataError(f"{root}: tokenizer.json is not a tokenizers document: "
                             f"{str(exc)[:120]}") from None


def open_prepared(root: Path) -> Prepared:
    """Open the prepared corpus in directory `root` (see the module docstring)."""
    try:
        with open(root / META_FILE, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
        if len(raw) > MAX_META_BYTES:
            raise TokenDataError(f"{root}: meta.json is larger than {MAX_META_BYTES} bytes")
        meta = json.loads(raw)
        tokenizer_bytes = (root / TOKENIZER_FILE).read_bytes()
    except FileNotFoundError as exc:
        raise TokenDataError(f"{root}: {Path(exc.filename).name} is missing") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise TokenDataError(f"{root}: meta.json is unreadable ({str(exc)[:80]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TokenDataError(f"{root}: not a {FORMAT} corpus (made by `p2ptrain data prepare`)")
    vocab = _count(meta.get("vocab_size"), "vocab_size")
    if not 2 <= vocab <= MAX_VOCAB:
        raise TokenDataError(f"meta.json: vocab_size {vocab} is out of range")
    dtype_name = meta.get("dtype")
    if dtype_name not in DTYPES or (dtype_name == "uint16" and vocab > 2**16):
        raise TokenDataError(f"meta.json: dtype {str(dtype_name)[:20]!r} cannot hold the "
                             f"vocabulary")
    digest = hashlib.sha256(tokenizer_bytes).hexdigest()
    if meta.get("tokenizer_sha256") != digest:
        raise TokenDataError(f"{root}: tokenizer.json is not the one the shards were made with "
                             f"(its hash differs from meta.json's)")
    text = tokenizer_bytes.decode("utf-8", "replace")
    ids = _tokenizer_vocab(text, root)
    if vocab != ids:  # it sizes the model: 65,536 made an 18M-parameter one
        raise TokenDataError(f"meta.json: vocab_size {vocab} is not the tokenizer's {ids}")
    dtype = DTYPES[dtype_name]
    return Prepared(root, vocab, text, digest[:16],
                    _shards(root, meta, "train", dtype, vocab),
                    _shards(root, meta, "heldout", dtype, vocab))
