"""Checkpoint directories on disk: write atomically, sign, keep the last K, find the newest
valid one.

A checkpoint is a directory `ckpt-t{term}-s{step}` holding `model.safetensors` (the weights),
`state.safetensors` (what resuming needs: optimiser moments and a JSON document of counters
and data position in its metadata) and `manifest.json` (step, term, leader, config
fingerprint, swarm sample count, per-chunk xxh3_64 of each file, and the leader's Ed25519
signature over all of it). It is written into a temporary directory, every file and the
directory fsynced, renamed into place, and the parent fsynced: a crash at any point leaves
either no new checkpoint or a complete one. Reading trusts nothing: the manifest's signature,
each file's size and every chunk hash are checked before a byte is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.checkpoint.manifest import (
    CHUNK_SIZE,
    DATA_FILES,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    Manifest,
    checkpoint_name,
)
from p2ptrain.checkpoint.safetensors_io import (
    SafetensorsError,
    read_header,
    read_into,
    write_safetensors,
)
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir
from p2ptrain.identity import Identity

MIN_WRITE_CHUNK = 256 * 2**10  # the smallest chunk the store writes
CHUNKS_WANTED = 64  # a file is cut into at least this many chunks while they stay >= the min
NAME_RE = re.compile(r"ckpt-t([0-9]{6,})-s([0-9]{10,})")  # use with fullmatch
TMP_PREFIX = ".tmp-ckpt-"
OLD_PREFIX = ".old-ckpt-"  # a checkpoint set aside while one of its name replaces it
STATE_META_KEY = "p2ptrain.state"
TOKENIZER_META_KEY = "p2ptrain.tokenizer"  # model.safetensors metadata: the tokenizers document


class CheckpointMismatch(CheckpointError):
    """A valid checkpoint of a different model or layout than the one asked for."""


@dataclass
class Snapshot:
    """Everything a checkpoint records, as views of live buffers (nothing is copied)."""

    step: int  # local steps of the node that wrote it
    term: int  # election term of the leader that wrote it (0 for a lone node)
    swarm_count: dict[str, int]  # G-counter of samples per node id
    fingerprint: str  # configuration fingerprint (model architecture and layout)
    arch: dict  # the architecture, so a reader can rebuild the model
    model_tensors: list[tuple[str, np.ndarray]]  # named weight views
    state_tensors: list[tuple[str, np.ndarray]]  # optimiser moments etc.
    state_meta: dict = field(default_factory=dict)  # JSON-able resume data
    model_meta: dict[str, str] = field(default_factory=dict)  # more metadata of the weights


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, newest (term, step) first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = NAME_RE.fullmatch(p.name)
        if m and p.is_dir():
            found.append(((int(m.group(1)), int(m.group(2))), p))
    return [p for _, p in sorted(found, reverse=True)]


def stale_temporaries(root: Path) -> list[Path]:
    """Partial checkpoints left by a crash in the middle of a write, after putting back a
    checkpoint set aside for a replacement that a crash kept from its place."""
    if not root.is_dir():
        return []
    for p in root.iterdir():  # (a fetch's finish sets aside as <name>-<pid>: net/partial.py)
        name = re.sub(r"-\d+$", "", p.name[len(OLD_PREFIX):])
        if (p.name.startswith(OLD_PREFIX) and NAME_RE.fullmatch(name)
                and not (root / name).exists()):
            os.rename(p, root / name)
    return sorted(p for p in root.iterdir()
                  if p.name.startswith(TMP_PREFIX) or p.name.startswith(OLD_PREFIX))


def chunk_size_for(nbytes: int) -> int:
    """The chunk size a file of about `nbytes` is hashed (and fetched) in: a power of two
    giving at least CHUNKS_WANTED chunks -- so many holders can serve one small file at once
    -- within [MIN_WRITE_CHUNK, CHUNK_SIZE] (CHUNK_SIZE wins if smaller: tests shrink it)."""
    want = 1 << max(0, (max(nbytes, 1) // CHUNKS_WANTED - 1).bit_length())
    return min(CHUNK_SIZE, max(MIN_WRITE_CHUNK, want))


def save(
    root: Path,
    snap: Snapshot,
    identity: Identity,
    keep: int,
    progress: Callable[[str, int, int], None] | None = None,
    pinned: Callable[[str], bool] | None = None,
) -> Path:
    """Write `snap` as a new checkpoint directory under `root`; prune to the newest `keep`
    (except those `pinned(name)` says are in use).

    `progress(file_name, bytes_written, total)` is called while the weight file is written.
    OSError (e.g. a full disk) leaves nothing behind and names `root` when the system did not
    name a file. A disk too full for one more while `keep` are there first loses the oldest
    of them, which the write would prune anyway -- never the newest, which stays whatever
    the retry does -- and tries once more: a disk that held `keep` checkpoints but not one
    more never took another."""
    try:
        return _save(root, snap, identity, keep, progress, pinned)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        final = checkpoint_name(snap.term, snap.step)
        held = [p for p in list_checkpoints(root) if p.name != final]
        spare = [p for p in held[max(keep - 1, 1):] if pinned is None or not pinned(p.name)]
        if not spare:
            raise
        shutil.rmtree(spare[-1], ignore_errors=True)  # the oldest
        return _save(root, snap, identity, keep, progress, pinned)


def _save(root: Path, snap: Snapshot, identity: Identity, keep: int,
          progress: Callable[[str, int, int], None] | None,
          pinned: Callable[[str], bool] | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(snap.term, snap.step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model_progress = None
        if progress:
            model_progress = lambda done, total: progress(MODEL_FILE, done, total)  # noqa: E731
        digests = {
            MODEL_FILE: write_safetensors(tmp / MODEL_FILE, snap.model_tensors,
                                          {"format": "pt", "p2ptrain.arch": json.dumps(snap.arch),
                                           **snap.model_meta},
                                          chunk_size_for(_nbytes(snap.model_tensors)),
                                          model_progress),
            STATE_FILE: write_safetensors(tmp / STATE_FILE, snap.state_tensors,
                                          {STATE_META_KEY: json.dumps(snap.state_meta)},
                                          chunk_size_for(_nbytes(snap.state_tensors))),
        }
        manifest = mf.sign(identity, step=snap.step, term=snap.term,
                           fingerprint=snap.fingerprint, arch=snap.arch,
                           swarm_count=snap.swarm_count,
                           files={name: mf.FileEntry(d.size, d.chunk_size, tuple(d.chunks))
                                  for name, d in digests.items()})
        atomic_write_bytes(tmp / MANIFEST_FILE, manifest.encode())
        fsync_dir(tmp)
        aside = root / f"{OLD_PREFIX}{final.name}"
        if final.exists():  # the same (term, step) again: set aside, never none on disk
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back at once
        if isinstance(exc, OSError) and exc.filename is None:  # say which disk
            raise OSError(exc.errno, exc.strerror, str(root)) from exc
        raise
    # the one just written always stays: a damaged newer one (skipped at the start, left on
    # disk) must not make every new checkpoint the first pruned
    for old in [p for p in list_checkpoints(root) if p != final][max(keep - 1, 0):]:
        if pinned is None or not pinned(old.name):  # e.g. being fetched right now
            shutil.rmtree(old, ignore_errors=True)
    return final


def _nbytes(tensors: list[tuple[str, np.ndarray]]) -> int:
    return sum(t.nbytes for _, t in tensors)


def read_manifest(path: Path, files: tuple[str, ...] = DATA_FILES) -> Manifest:
    """The manifest of checkpoint `path`, with its signature and the hashes of `files`
    verified (every data file unless told otherwise)."""
    manifest = mf.read(path)
    mf.verify(path, manifest, files)
    return manifest


def load_tensors(path: Path, file_name: str, targets: dict[str, np.ndarray]) -> dict[str, str]:
    """Fill `targets` from one file of a verified checkpoint; returns the file's metadata."""
    try:
        with open(path / file_name, "rb") as f:
            header, start = read_header(f)
            read_into(f, header, start, targets)
    except (OSError, SafetensorsError) as exc:
        raise CheckpointError(f"{path.name}/{file_name}: {exc}") from None
    return header.get("__metadata__", {})


def state_meta(metadata: dict[str, str]) -> dict:
    try:
        meta = json.loads(metadata[STATE_META_KEY])
    except (KeyError, ValueError, RecursionError):  # ValueError: JSON's, a 4,300-digit number
        raise CheckpointError("state.safetensors carries no resume data") from None
    if not isinstance(meta, dict):
        raise CheckpointError("state.safetensors resume data is not an object")
    return meta


@dataclass
class Found:
    path: Path | None  # the newest checkpoint that verifies, or None
    manifest: Manifest | None  # its verified manifest
    skipped: list[str]  # why each newer one was passed over


def find_latest(root: Path, fingerprint: str, arch: dict | None = None,
                passing_over: Collection[Path] = ()) -> Found:
    """The newest checkpoint under `root` that verifies, passing over those that do not
    (and those in `passing_over`: found to verify but not to load); CheckpointMismatch if it
    belongs to another model (`arch`: this one's, to say whether only the tokenizer
    differs)."""
    skipped = []
    for path in list_checkpoints(root):
        if path in passing_over:
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if manifest.fingerprint != fingerprint and arch is not None and manifest.arch == arch:
            raise CheckpointMismatch(
                f"{path} holds a checkpoint of this model's shape trained on another "
                f"tokenizer's ids (data prepared with another tokenizer.json, or bytes); "
                f"train on that data, or use another --state-dir")
        if manifest.fingerprint != fingerprint:
            raise CheckpointMismatch(
                f"{path} holds a checkpoint of another model ({describe_arch(manifest)}); "
                f"train that model, or use another --state-dir"
            )
        return Found(path, manifest, skipped)
    return Found(None, None, skipped)


def describe_arch(manifest: Manifest) -> str:
    arch = manifest.arch
    return " ".join(f"{k}={v}" for k, v in arch.items())
