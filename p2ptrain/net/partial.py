"""A checkpoint download on disk: `out_root/.partial-<id>/`, resumable, made final atomically.

- The data files wanted are pre-sized and written with positional writes, one verified chunk
  at a time; `progress.json` (replaced atomically, coalesced by one background writer) lists
  the chunks written. After a break the chunks it lists are hashed again (a crash may have
  lost unsynced data, which is why it need not be fsynced) and only the others are fetched.
  A partial of another manifest under the same id is discarded.
- `finish` writes the manifest, fsyncs the files and the directory, and renames it to
  `out_root/<id>`, then fsyncs out_root. The chunks were verified as they arrived, so nothing
  is hashed again here: a fetched checkpoint is hashed once.
Blocking functions run in worker threads (the callers' `asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import xxhash

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir, read_regular

PARTIAL_PREFIX, PROGRESS_FILE = ".partial-", "progress.json"
MAX_PROGRESS_BYTES = 2 * mf.MAX_MANIFEST_BYTES  # a chunk index per chunk a manifest can list
OLD_PREFIX = ".old-"  # + "<id>-<pid>": a checkpoint set aside while a fetch replaces it


class PartialError(Exception):
    """The download cannot go on here (a full disk, say); the message says why."""


def write_chunk(target: Path, offset: int, body: memoryview) -> None:
    fd = os.open(target, os.O_WRONLY)  # opened per chunk: no descriptor outlives a cancel
    try:
        done = 0
        while done < len(body):
            done += os.pwrite(fd, body[done:], offset + done)
    finally:
        os.close(fd)


def _write_progress(partial: Path, doc: dict) -> None:
    tmp = partial / f".{PROGRESS_FILE}.tmp"
    tmp.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    os.replace(tmp, partial / PROGRESS_FILE)  # atomic; durability is not needed (see above)


class ProgressFile:
    """The chunks written so far (`have`: file -> indices), saved by one background writer
    that coalesces updates (a rename costs milliseconds on ext4: too much per chunk in the
    event loop)."""

    def __init__(self, partial: Path, tag: str, have: dict[str, set[int]]):
        self.partial, self.tag, self.have = partial, tag, have
        self._dirty, self._writer = False, None

    def add(self, chunk: mf.Chunk) -> None:
        self.have[chunk.file].add(chunk.index)
        self._dirty = True
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._dirty:
                self._dirty = False
                doc = {"manifest": self.tag,
                       "done": {n: sorted(self.have[n]) for n in mf.DATA_FILES}}
                await asyncio.to_thread(_write_progress, self.partial, doc)
        finally:
            self._writer = None

    async def flush(self) -> None:
        """Return once the file lists every chunk added so far."""
        while self._writer is not None:
            await self._writer


def resume(partial: Path, manifest: mf.Manifest, files: tuple[str, ...]) -> dict[str, set[int]]:
    """Prepare `partial` for `files` of `manifest`: the chunk indices already there whose bytes
    still hash right, per data file (files not wanted: empty)."""
    tag = manifest.digest
    try:
        doc = json.loads(read_regular(partial / PROGRESS_FILE, MAX_PROGRESS_BYTES))
        if doc["manifest"] != tag:
            raise ValueError("another manifest")
        listed = {(n, i) for n in mf.DATA_FILES for i in doc["done"][n] if type(i) is int}
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        listed = _finished(partial, manifest, files)
        if not listed:
            shutil.rmtree(partial, ignore_errors=True)  # unusable or of another checkpoint
    if not partial.is_dir():
        need = manifest.size(files)
        free = shutil.disk_usage(partial.parent).free
        if free < need:
            raise PartialError(f"needs {need:,} bytes of disk in {partial.parent}, "
                               f"{free:,} free")
        partial.mkdir()
    have: dict[str, set[int]] = {n: set() for n in mf.DATA_FILES}
    for name in files:
        size = manifest.files[name].size
        fd = os.open(partial / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        with open(partial / name, "rb") as f:
            for c in manifest.files[name].chunks(name):
                if (name, c.index) in listed:
                    f.seek(c.offset)
                    if xxhash.xxh3_64_hexdigest(f.read(c.length)) == c.digest:
                        have[name].add(c.index)
    return have


def _finished(partial: Path, manifest: mf.Manifest, files: tuple[str, ...]) -> set:
    """Every chunk of `files`, when `partial` holds this manifest: `finish` wrote it, then
    dropped the progress record, and was stopped before its rename (the chunks are still
    hashed by `resume`, not fetched again); else nothing."""
    try:
        if mf.read(partial).digest != manifest.digest:
            return set()
    except (mf.CheckpointError, OSError):
        return set()
    return {(n, c.index) for n in files for c in manifest.files[n].chunks(n)}


def finish(partial: Path, final: Path, manifest: mf.Manifest, files: tuple[str, ...]) -> None:
    """Make `partial` durable and rename it to `final` (every chunk of `files` verified)."""
    atomic_write_bytes(partial / mf.MANIFEST_FILE, manifest.encode())
    for name in files:
        fd = os.open(partial / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for leftover in (PROGRESS_FILE, f".{PROGRESS_FILE}.tmp",
                     *(n for n in mf.DATA_FILES if n not in files)):
        (partial / leftover).unlink(missing_ok=True)
    fsync_dir(partial)
    old = final.with_name(f"{OLD_PREFIX}{final.name}-{os.getpid()}") if final.exists() else None
    if old is not None:  # same id, other content (the leader rewrote it), or fewer files
        os.rename(final, old)
    os.rename(partial, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def existing(final: Path, manifest: mf.Manifest, files: tuple[str, ...]) -> bool:
    """Whether `final` already holds `files` of exactly this manifest, verified."""
    try:
        if not final.is_dir() or mf.read(final).digest != manifest.digest:
            return False
        mf.verify(final, manifest, files)
    except mf.CheckpointError:
        return False
    return True
