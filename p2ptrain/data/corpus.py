"""Loading a corpus of byte tokens and splitting it into training and held-out parts.

Accepted sources: the built-in Tiny Shakespeare (no path), a text file, a directory of text
files (read in sorted order, joined by a newline), a `.npy` array of byte tokens -- all
byte-level: the vocabulary is the 256 byte values -- or a corpus made by `p2ptrain data
prepare` (a directory with meta.json: token-id shards read a window at a time, its vocabulary
and tokenizer from there; tokens.py). Every failure is a DataError with a one-line message
naming the path and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from p2ptrain.data.tokens import (
    META_FILE,
    SHARD_RE,
    TOKENIZER_FILE,
    TokenDataError,
    TokenShards,
    is_prepared,
    open_prepared,
)

VOCAB_SIZE = 256
BUILTIN_NAME = "tinyshakespeare"
TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst", ".csv", ".json", ".py", ".tex", ""}


class DataError(Exception):
    """The data source cannot be used; the message says why, in one line."""


def _load_prepared(root: Path, min_tokens: int) -> Corpus:
    try:
        prepared = open_prepared(root)
    except TokenDataError as exc:
        raise DataError(str(exc)) from None
    for split, tokens in (("training", prepared.train), ("held-out", prepared.heldout)):
        if tokens.size < min_tokens:
            raise DataError(f"{root}: the {split} split has {tokens.size} tokens; it needs at "
                            f"least {min_tokens} (one window of the model's context)")
    return Corpus(str(root), prepared.train, prepared.heldout, prepared.vocab_size,
                  prepared.tokenizer_json, prepared.tokenizer_id)


@dataclass(frozen=True)
class Corpus:
    """Token ids (uint8 for bytes) split into train and held-out parts."""

    name: str  # where it came from: "tinyshakespeare" or a path
    train: np.ndarray | TokenShards  # (N_train,) tokens
    heldout: np.ndarray | TokenShards  # (N_heldout,) tokens: the last part of the source
    vocab_size: int = VOCAB_SIZE
    tokenizer_json: str | None = None  # the tokenizers document (None: bytes)
    tokenizer_id: str = "bytes"  # what nodes compare: sha256 of tokenizer.json, 16 hex


def text_files(root: Path) -> list[Path]:
    """The text files below directory `root`, sorted: by suffix (TEXT_SUFFIXES), and none
    under or named by a dot (a git checkout's .git/objects were read as text). A directory
    holding a prepared corpus's tokenizer or shards but no readable meta.json is refused: it
    was read as text -- training on the tokenizer's JSON -- and said nothing."""
    if (root / TOKENIZER_FILE).exists() or any(SHARD_RE.fullmatch(p.name)
                                               for p in root.iterdir()):
        raise DataError(f"{root} looks like a prepared corpus (tokenizer.json, shards) but its "
                        f"{META_FILE} is missing or not a regular file: prepare it again "
                        f"(p2ptrain data prepare)")
    return sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _builtin_bytes() -> bytes:
    return resources.files("p2ptrain.data").joinpath("tinyshakespeare.txt").read_bytes()


def _read_tokens(path: Path) -> np.ndarray:
    if not path.exists():
        raise DataError(f"data path {path} does not exist")
    try:
        if path.is_dir():
            files = text_files(path)
            if not files:
                raise DataError(f"data directory {path} holds no text files")
            blob = b"\n".join(p.read_bytes() for p in files)
            return np.frombuffer(blob, dtype=np.uint8)
        if not path.is_file():  # a FIFO would hang the read, /dev/zero fill memory
            raise DataError(f"data path {path} is not a regular file or a directory")
        if path.suffix == ".npy":
            return _read_npy(path)
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    except PermissionError as exc:
        msg = f"data path {exc.filename or path} is not readable (permission denied)"
        raise DataError(msg) from None
    except IsADirectoryError as exc:
        raise DataError(f"data path {exc.filename or path} cannot be read as a file") from None
    except OSError as exc:
        raise DataError(f"data path {path} cannot be read: {exc.strerror or exc}") from None


def _read_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, EOFError) as exc:  # (EOFError: an empty file)
        raise DataError(f"{path} is not a valid .npy token array: {exc or 'empty'}") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive under an .npy name
        arr.close()
        raise DataError(f"{path} is an .npz archive, not a .npy token array")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(f"{path}: expected a 1-D integer token array, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= VOCAB_SIZE):
        raise DataError(f"{path}: token ids must lie in 0..{VOCAB_SIZE - 1} (byte vocabulary)")
    return np.ascontiguousarray(arr, dtype=np.uint8)


def load_corpus(path: str | None, holdout_fraction: float, min_tokens: int) -> Corpus:
    """Load `path` (None or "" for the built-in corpus) and split off the held-out tail.

    `min_tokens` is the smallest usable split (one training window plus its target)."""
    if not 0.0 < holdout_fraction < 1.0:
        raise DataError(f"holdout fraction must lie in (0, 1), got {holdout_fraction}")
    if path and is_prepared(Path(path).expanduser()):
        return _load_prepared(Path(path).expanduser(), min_tokens)
    if path:
        p = Path(path).expanduser()
        tokens, name = _read_tokens(p), str(p)
    else:
        tokens, name = np.frombuffer(_builtin_bytes(), dtype=np.uint8), BUILTIN_NAME
    if tokens.size == 0:
        raise DataError(f"data source {name} is empty")
    cut = int(round(tokens.size * (1.0 - holdout_fraction)))
    train, heldout = tokens[:cut], tokens[cut:]
    if train.size < min_tokens or heldout.size < min_tokens:
        raise DataError(
            f"data source {name} is too small: {tokens.size} tokens; each split needs at least "
            f"{min_tokens} (one window of the model's context)"
        )
    return Corpus(name=name, train=train, heldout=heldout)
