"""`p2ptrain data prepare`: text files in, token-id shards out (the format: tokens.py).

Inputs are text files or directories of them (read in sorted order, as the byte corpus is),
tokenized with a Hugging Face `tokenizers` document (`tokenizer.json`) in blocks of whole
lines, and streamed to shards of at most `shard_tokens` ids, so a corpus larger than memory
works. The last `holdout_fraction` of the tokens is the held-out split (the same rule as the
byte corpus: the tail). Everything is written into a temporary directory next to `out` and
renamed into place at the end: `out` holds a complete prepared corpus or nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from p2ptrain.data.corpus import DataError, text_files
from p2ptrain.data.tokens import (
    DTYPES,
    FORMAT,
    META_FILE,
    TOKENIZER_FILE,
    TokenDataError,
    dtype_for,
    plain,
    sha256_file,
    vocab_of,
)
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir, remove_orphans

BLOCK_BYTES = 8 * 2**20  # text tokenized at once (cut at a line end)
SHARD_TOKENS = 2**27  # ids per shard (256 MiB of uint16)
PROGRESS_EVERY = 5.0  # s between progress lines when stderr is no terminal


@dataclass(frozen=True)
class Summary:
    out: Path
    vocab_size: int
    train_tokens: int
    heldout_tokens: int
    input_bytes: int
    shards: int


def input_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in inputs:
        if not path.exists():
            raise TokenDataError(f"input {path} does not exist")
        if path.is_dir():
            try:
                found = text_files(path)
            except DataError as exc:
                raise TokenDataError(str(exc)) from None
            if not found:
                raise TokenDataError(f"input directory {path} holds no text files")
            files += found
        else:
            files.append(path)
    return files


def _blocks(path: Path, invalid: list[int] | None = None) -> Iterator[str]:
    """The file's text in blocks of whole lines, or, past BLOCK_BYTES without a line end
    (minified text, CR-only line ends), cut after a space or else between characters: a
    file of one line was held whole (6.2 GB for 32 MB; /dev/zero ran out of memory).
    Invalid UTF-8 becomes U+FFFD; `invalid[0]` counts the blocks that held some."""
    with open(path, "rb") as f:
        rest = b""
        while block := f.read(BLOCK_BYTES):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) >= BLOCK_BYTES:
                cut = max(block.rfind(b" "), block.rfind(b"\r"), block.rfind(b"\t")) + 1
                if cut == 0:  # no space either: between two characters
                    cut = _last_char_start(block) or len(block)
            if cut == 0:
                rest = block
                continue
            rest = block[cut:]
            yield _decode(block[:cut], invalid)
        if rest:
            yield _decode(rest, invalid)


def _last_char_start(data: bytes) -> int:
    """Where the last (maybe incomplete) UTF-8 character of `data` starts: back over at most
    three continuation bytes (0b10xxxxxx)."""
    i = len(data) - 1
    while i > 0 and len(data) - i < 4 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _decode(data: bytes, invalid: list[int] | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if invalid is not None:
            invalid[0] += 1
        return data.decode("utf-8", "replace")


class _ShardWriter:
    """Token ids to numbered part files of at most `limit` ids each."""

    def __init__(self, root: Path, dtype: np.dtype, limit: int, vocab: int):
        self.root, self.dtype, self.limit, self.vocab = root, dtype, limit, vocab
        self.parts: list[tuple[Path, int]] = []
        self._file = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) >= self.vocab:  # never wrapped into another token
            raise TokenDataError(f"the tokenizer produced id {int(ids.max())}, outside its "
                                 f"vocabulary of {self.vocab}")
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None or self._count == self.limit:
                self._next()
            take = min(ids.size, self.limit - self._count)
            self._file.write(ids[:take].tobytes())
            self._count += take
            self.parts[-1] = (self.parts[-1][0], self._count)
            ids = ids[take:]

    def _next(self) -> None:
        self.close()
        path = self.root / f"part-{len(self.parts):05d}.bin"
        self._file, self._count = open(path, "wb"), 0  # noqa: SIM115 (closed by close())
        self.parts.append((path, 0))

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _split(tmp: Path, parts: list[tuple[Path, int]], cut: int, dtype: np.dtype
           ) -> dict[str, list[dict]]:
    """Rename the parts to train-/heldout- shards, splitting the one that straddles `cut`."""
    out: dict[str, list[dict]] = {"train": [], "heldout": []}

    def add(split: str, src: Path | np.ndarray, tokens: int) -> None:
        name = f"{split}-{len(out[split]):05d}.bin"
        if isinstance(src, Path):
            os.rename(src, tmp / name)
        else:
            with open(tmp / name, "wb") as f:
                f.write(src.tobytes())
                os.fsync(f.fileno())
        out[split].append({"file": name, "tokens": tokens})

    start = 0
    for path, count in parts:
        end = start + count
        if end <= cut:
            add("train", path, count)
        elif start >= cut:
            add("heldout", path, count)
        else:  # this part straddles the cut
            ids = np.fromfile(path, dtype=dtype)
            add("train", ids[: cut - start], cut - start)
            add("heldout", ids[cut - start :], end - cut)
            path.unlink()
        start = end
    return out


def prepare(inputs: list[Path], tokenizer_path: Path, out: Path, holdout_fraction: float = 0.1,
            shard_tokens: int = SHARD_TOKENS, progress: bool | None = None,
            say: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> Summary:
    """Tokenize `inputs` with `tokenizer_path` into a prepared corpus at `out`."""
    if out.exists():
        raise TokenDataError(f"output {out} exists; remove it or choose another --out")
    if not 0.0 < holdout_fraction < 1.0:
        raise TokenDataError(f"holdout fraction must lie in (0, 1), got {holdout_fraction}")
    try:
        tokenizer = plain(Tokenizer.from_file(str(tokenizer_path)))
    except Exception as exc:  # the library raises its own exception types
        raise TokenDataError(f"{tokenizer_path} is not a tokenizers document: "
                             f"{str(exc)[:120]}") from None
    vocab = vocab_of(tokenizer)  # the ids' range, not their count
    entries = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > max(4 * entries, entries + 65536):  # the model's vocabulary follows the range
        raise TokenDataError(f"{tokenizer_path}: its ids reach {vocab - 1:,} for {entries:,} "
                             f"entries: a model would have a vocabulary of {vocab:,}; "
                             f"renumber its ids")
    dtype_name = dtype_for(vocab)
    files = input_files(inputs)
    total_bytes = sum(p.stat().st_size for p in files)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    remove_orphans(out.parent, f".{out.name}.tmp-")  # of runs killed before their cleanup
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writer = _ShardWriter(tmp, DTYPES[dtype_name], shard_tokens, vocab)
        show = sys.stderr.isatty() if progress is None else progress
        done, last = 0, time.monotonic()
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                  disable=not show) as bar:
            for path in files:
                invalid = [0]
                for block in _blocks(path, invalid):
                    encoded = tokenizer.encode_batch(block.splitlines(keepends=True),
                                                     add_special_tokens=False)
                    writer.write(np.fromiter(itertools.chain.from_iterable(
                        e.ids for e in encoded), dtype=np.int64))
                    size = len(block.encode("utf-8", "replace"))
                    bar.update(size)
                    done += size
                    if not show and time.monotonic() - last >= PROGRESS_EVERY:  # a pipe, a log:
                        last = time.monotonic()  # a line now and then instead of the bar
                        say(f"tokenizing: {done / 1e6:,.1f} of {total_bytes / 1e6:,.1f} MB "
                            f"({100 * done / max(total_bytes, 1):.0f}%), {path.name}")
                if invalid[0]:
                    say(f"warning: {path} is not all UTF-8 text: {invalid[0]} of its blocks "
                        f"had invalid bytes, tokenized as U+FFFD (convert it to UTF-8 first?)")
                if not show:
                    say(f"tokenized {path}")
        writer.close()
        total = sum(n for _, n in writer.parts)
        cut = int(round(total * (1.0 - holdout_fraction)))
        if total < 2 or cut == 0 or cut == total:
            raise TokenDataError(f"the inputs give {total} tokens: too few to split")
        shards = _split(tmp, writer.parts, cut, DTYPES[dtype_name])
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        with open(tmp / TOKENIZER_FILE, "rb") as f:  # durable before the rename publishes it
            os.fsync(f.fileno())
        meta = {"format": FORMAT, "vocab_size": vocab, "dtype": dtype_name,
                "tokenizer_sha256": sha256_file(tmp / TOKENIZER_FILE), "tokens": total,
                "holdout_fraction": holdout_fraction, **shards,
                "sources": [str(p) for p in files][:1000]}
        atomic_write_bytes(tmp / META_FILE, json.dumps(meta, indent=1).encode())
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Summary(out, vocab, cut, total - cut, total_bytes,
                   len(shards["train"]) + len(shards["heldout"]))
