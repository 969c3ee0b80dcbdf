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

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from p2ptrain.checkpoint.safetensors_io import (
    SafetensorsError,
    read_header,
    read_into,
    write_safetensors,
)
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir
from p2ptrain.identity import Identity, node_id_of, verify_signature

FORMAT = "p2ptrain-checkpoint/1"
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "state.safetensors", "manifest.json"
CHUNK_SIZE = 4 * 2**20
MAX_CHUNK_SIZE = 64 * 2**20  # a manifest's chunk size, at most (one read)
NAME_RE = re.compile(r"ckpt-t([0-9]{6,})-s([0-9]{10,})")  # use with fullmatch
TMP_PREFIX = ".tmp-ckpt-"
STATE_META_KEY = "p2ptrain.state"


class CheckpointError(Exception):
    """A checkpoint is missing, corrupt, unsigned or unreadable; the message says which."""


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


def checkpoint_name(term: int, step: int) -> str:
    return f"ckpt-t{term:06d}-s{step:010d}"


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
    """Partial checkpoints left by a crash in the middle of a write."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX))


def canonical_bytes(manifest: dict) -> bytes:
    """What the leader's signature covers: the manifest without its signature, canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def save(
    root: Path,
    snap: Snapshot,
    identity: Identity,
    keep: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> Path:
    """Write `snap` as a new checkpoint directory under `root`; prune to the newest `keep`.

    `progress(file_name, bytes_written, total)` is called while the weight file is written.
    OSError (e.g. a full disk) leaves nothing behind and names `root` when the system did not
    name a file."""
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
                                          {"format": "pt", "p2ptrain.arch": json.dumps(snap.arch)},
                                          CHUNK_SIZE, model_progress),
            STATE_FILE: write_safetensors(tmp / STATE_FILE, snap.state_tensors,
                                          {STATE_META_KEY: json.dumps(snap.state_meta)},
                                          CHUNK_SIZE),
        }
        manifest = {
            "format": FORMAT,
            "step": snap.step,
            "term": snap.term,
            "leader": identity.node_id,
            "leader_key": identity.public_key.hex(),
            "fingerprint": snap.fingerprint,
            "arch": snap.arch,
            "swarm_samples": sum(snap.swarm_count.values()),
            "swarm_count": snap.swarm_count,
            "files": {name: {"size": d.size, "chunk_size": d.chunk_size, "xxh3_64": d.chunks}
                      for name, d in digests.items()},
        }
        manifest["signature"] = identity.sign(canonical_bytes(manifest)).hex()
        atomic_write_bytes(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        if final.exists():  # the same (term, step) again: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back at once
        if isinstance(exc, OSError) and exc.filename is None:  # say which disk
            raise OSError(exc.errno, exc.strerror, str(root)) from exc
        raise
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint `path`, with its signature and every file hash verified."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: no manifest.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path.name}: not a {FORMAT} manifest")
    try:
        key = bytes.fromhex(manifest["leader_key"])
        signature = bytes.fromhex(manifest["signature"])
        files = manifest["files"]
        for k in ("step", "term", "swarm_samples"):
            if not isinstance(manifest[k], int) or manifest[k] < 0:
                raise ValueError(k)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: manifest field missing or malformed ({exc})") from None
    if not verify_signature(key, signature, canonical_bytes(manifest)):
        raise CheckpointError(f"{path.name}: manifest signature does not verify")
    if node_id_of(key) != manifest.get("leader"):
        raise CheckpointError(f"{path.name}: manifest names a leader its key does not belong to")
    if not isinstance(files, dict) or set(files) != {MODEL_FILE, STATE_FILE}:
        raise CheckpointError(f"{path.name}: manifest lists the wrong files")
    for name, entry in files.items():
        _verify_file(path / name, entry)
    return manifest


def _verify_file(path: Path, entry: dict) -> None:
    where = f"{path.parent.name}/{path.name}"
    try:
        size, chunk, digests = entry["size"], entry["chunk_size"], entry["xxh3_64"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: malformed file entry in manifest") from None
    if (type(size) is not int or type(chunk) is not int or type(digests) is not list
            or size < 0 or not 0 < chunk <= MAX_CHUNK_SIZE
            or not all(type(d) is str for d in digests)):
        raise CheckpointError(f"{where}: malformed file entry in manifest")
    if len(digests) != max(1, -(-size // chunk)):
        raise CheckpointError(f"{where}: chunk list does not match the size")
    try:
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{where}: {actual} bytes, manifest says {size} (truncated?)")
        with open(path, "rb") as f:
            for i, want in enumerate(digests):
                if xxhash.xxh3_64_hexdigest(f.read(chunk)) != want:
                    raise CheckpointError(f"{where}: chunk {i} does not match its hash")
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot be read ({exc.strerror or exc})") from None


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
    except (KeyError, json.JSONDecodeError):
        raise CheckpointError("state.safetensors carries no resume data") from None
    if not isinstance(meta, dict):
        raise CheckpointError("state.safetensors resume data is not an object")
    return meta


@dataclass
class Found:
    path: Path | None  # the newest checkpoint that verifies, or None
    manifest: dict | None  # its verified manifest
    skipped: list[str]  # why each newer one was passed over


def find_latest(root: Path, fingerprint: str) -> Found:
    """The newest checkpoint under `root` that verifies, passing over those that do not;
    CheckpointMismatch if it belongs to another model."""
    skipped = []
    for path in list_checkpoints(root):
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if manifest.get("fingerprint") != fingerprint:
            raise CheckpointMismatch(
                f"{path} holds a checkpoint of another model ({describe_arch(manifest)}); "
                f"train that model, or use another --state-dir"
            )
        return Found(path, manifest, skipped)
    return Found(None, None, skipped)


def describe_arch(manifest: dict) -> str:
    arch = manifest.get("arch")
    if not isinstance(arch, dict):
        return "unknown architecture"
    return " ".join(f"{k}={v}" for k, v in arch.items())
