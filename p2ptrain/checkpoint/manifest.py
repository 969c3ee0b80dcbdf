"""A checkpoint's manifest: one strict parser, one signer, one verifier of the files it lists.

The manifest (`manifest.json`) names the checkpoint (term, step), the leader that wrote it
and its Ed25519 key, the model (configuration fingerprint and architecture), the swarm's
sample G-counter, and for each data file its size, chunk size and the xxh3_64 of every chunk;
the leader's signature covers all of it (canonical JSON without the signature). The store
writes it, the server serves it, the fetcher checks chunks against it -- all three through
this file, so a manifest one accepts the others accept too.

Rules (a manifest from a file or a peer is hostile until `parse` accepted it):
- exactly the known keys; format FORMAT; step, term and counts are integers in [0, 2^63)
  (a term at most 2^52, the protocol's bound);
  swarm_samples is the sum of swarm_count;
- leader and key are hex of the right length and the key hashes to the leader's id; the
  signature verifies;
- exactly the two data files; each has 0 < size <= MAX_FILE_BYTES, a chunk size in
  [MIN_CHUNK_SIZE, MAX_CHUNK_SIZE] and exactly ceil(size / chunk) lowercase 16-hex hashes.
Every checkpoint this release and the previous one wrote passes (4 MiB chunks, both files
non-empty); one that does not is refused with the rule it breaks.
"""

from __future__ import annotations

import hashlib
import json
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from p2ptrain.fsutil import NotRegularFile, TooLarge, read_regular
from p2ptrain.identity import Identity, node_id_of, verify_signature

FORMAT = "p2ptrain-checkpoint/1"
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "state.safetensors", "manifest.json"
DATA_FILES = (MODEL_FILE, STATE_FILE)
CHUNK_SIZE = 4 * 2**20  # what the store writes
MIN_CHUNK_SIZE = 4096  # bounds the number of requests a fetch makes
MAX_CHUNK_SIZE = 16 * 2**20  # one chunk is one range response, held in memory to be MACed
MAX_FILE_BYTES = 256 * 2**30
MAX_MANIFEST_BYTES = 8 * 2**20
KEYS = frozenset({"format", "step", "term", "leader", "leader_key", "fingerprint", "arch",
                  "swarm_samples", "swarm_count", "files", "signature"})
ENTRY_KEYS = frozenset({"size", "chunk_size", "xxh3_64"})
_HEX = frozenset("0123456789abcdef")


class CheckpointError(Exception):
    """A checkpoint is missing, corrupt, unsigned or unreadable; the message says which."""


class ManifestError(CheckpointError):
    """A manifest breaks a rule (see the module docstring); the message names the rule."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One hashed piece of a data file."""

    file: str
    index: int
    offset: int
    length: int
    digest: str  # xxh3_64, 16 lowercase hex


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    chunk_size: int
    hashes: tuple[str, ...]

    def chunks(self, file: str) -> Iterator[Chunk]:
        step = self.chunk_size
        for i, digest in enumerate(self.hashes):
            yield Chunk(file, i, i * step, min(step, self.size - i * step), digest)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed, signature-checked manifest. `doc` is the JSON object it was parsed from (read
    only); everything else is taken from it."""

    doc: Mapping[str, Any]
    step: int
    term: int
    leader: str
    fingerprint: str
    swarm_samples: int
    files: Mapping[str, FileEntry]

    @property
    def id(self) -> str:
        """The checkpoint's directory name."""
        return checkpoint_name(self.term, self.step)

    @property
    def digest(self) -> str:
        """A short hash naming this exact manifest (what holders advertise)."""
        return hashlib.sha256(canonical_bytes(self.doc) + str(self.doc["signature"]).encode()
                              ).hexdigest()[:16]

    @property
    def arch(self) -> dict:
        return json.loads(json.dumps(self.doc["arch"]))  # a copy: the manifest stays as read

    @property
    def swarm_count(self) -> dict[str, int]:
        return dict(self.doc["swarm_count"])

    def chunks(self, files: tuple[str, ...] = DATA_FILES) -> list[Chunk]:
        return [c for name in files for c in self.files[name].chunks(name)]

    def size(self, files: tuple[str, ...] = DATA_FILES) -> int:
        return sum(self.files[name].size for name in files)

    def to_json(self) -> dict:
        """A plain copy of the document (to serve or write)."""
        return json.loads(json.dumps(dict(self.doc)))

    def encode(self) -> bytes:
        return json.dumps(dict(self.doc), indent=1).encode()


def checkpoint_name(term: int, step: int) -> str:
    return f"ckpt-t{term:06d}-s{step:010d}"


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """What the leader's signature covers: the manifest without its signature, canonical JSON."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and _HEX.issuperset(value)


MAX_TERM = 2**52  # the protocol's bound on a term (proto/records.py MAX_EPOCH)
# steps and sample counts: what the protocol carries exactly (proto/records.py MAX_TERM); a
# manifest past it was fetched, then advertised as a holding the node's own protocol core
# refused -- an internal error at every start, the checkpoint kept in fetched/
MAX_COUNT = 2**53


def _is_count(value: object, limit: int = 2**63) -> bool:
    return type(value) is int and 0 <= value < limit


def _entry(name: str, entry: object) -> FileEntry:
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise ManifestError(f"the entry of {name} is malformed")
    size, chunk, hashes = entry["size"], entry["chunk_size"], entry["xxh3_64"]
    if not _is_count(size) or not 0 < size <= MAX_FILE_BYTES:
        raise ManifestError(f"{name} has an impossible size ({str(size)[:30]})")
    if not _is_count(chunk) or not MIN_CHUNK_SIZE <= chunk <= MAX_CHUNK_SIZE:
        raise ManifestError(f"{name} has chunk size {str(chunk)[:30]}, outside "
                            f"[{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes")
    if not isinstance(hashes, list) or len(hashes) != -(-size // chunk):
        raise ManifestError(f"{name}: the chunk list does not match its size")
    if not all(_is_hex(d, 16) for d in hashes):
        raise ManifestError(f"{name} has a malformed chunk hash")
    return FileEntry(size, chunk, tuple(hashes))


def parse(doc: object) -> Manifest:
    """A Manifest from a JSON value, if every rule holds and the signature verifies."""
    if not isinstance(doc, dict):
        raise ManifestError("the manifest is not a JSON object")
    if set(doc) != KEYS:
        odd = sorted(str(k)[:40] for k in KEYS.symmetric_difference(doc))[:3]
        raise ManifestError(f"fields missing or unexpected: {odd}")
    if doc["format"] != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest")
    if not all(_is_count(doc[k], MAX_COUNT) for k in ("step", "term", "swarm_samples")):
        raise ManifestError("step, term or swarm_samples is not a count below 2^53")
    if doc["term"] > MAX_TERM:  # a node resuming it would take a term no peer accepts
        raise ManifestError(f"term {doc['term']} is beyond the protocol's 2^52")
    if not (_is_hex(doc["leader"], 32) and _is_hex(doc["leader_key"], 64)
            and _is_hex(doc["signature"], 128)):
        raise ManifestError("leader, key or signature is malformed")
    if not isinstance(doc["fingerprint"], str) or len(doc["fingerprint"]) > 256 \
            or not isinstance(doc["arch"], dict):
        raise ManifestError("fingerprint or arch is malformed")
    counts = doc["swarm_count"]
    if not isinstance(counts, dict) or len(counts) > 65536 or not all(
            isinstance(k, str) and len(k) <= 64 and _is_count(v, MAX_COUNT)
            for k, v in counts.items()):
        raise ManifestError("swarm_count is malformed")
    if sum(counts.values()) != doc["swarm_samples"]:
        raise ManifestError("swarm_samples is not the sum of swarm_count")
    files = doc["files"]
    if not isinstance(files, dict) or set(files) != set(DATA_FILES):
        raise ManifestError(f"it must list exactly {', '.join(DATA_FILES)}")
    entries = {name: _entry(name, files[name]) for name in DATA_FILES}
    key = bytes.fromhex(doc["leader_key"])
    if not verify_signature(key, bytes.fromhex(doc["signature"]), canonical_bytes(doc)):
        raise ManifestError("the signature does not verify")
    if node_id_of(key) != doc["leader"]:
        raise ManifestError(f"it names leader {doc['leader']} but is signed by another key")
    frozen = json.loads(json.dumps(doc))
    return Manifest(types.MappingProxyType(frozen), doc["step"], doc["term"], doc["leader"],
                    doc["fingerprint"], doc["swarm_samples"], types.MappingProxyType(entries))


def loads(data: bytes) -> Manifest:
    """`parse` of JSON bytes (at most MAX_MANIFEST_BYTES)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"the manifest is longer than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"the manifest is not JSON ({str(exc)[:80]})") from None
    return parse(doc)


def sign(identity: Identity, *, step: int, term: int, fingerprint: str, arch: dict,
         swarm_count: dict[str, int], files: Mapping[str, FileEntry]) -> Manifest:
    """A new manifest signed by `identity` (the store's writer)."""
    doc: dict[str, Any] = {
        "format": FORMAT, "step": step, "term": term, "leader": identity.node_id,
        "leader_key": identity.public_key.hex(), "fingerprint": fingerprint, "arch": arch,
        "swarm_samples": sum(swarm_count.values()), "swarm_count": swarm_count,
        "files": {name: {"size": e.size, "chunk_size": e.chunk_size, "xxh3_64": list(e.hashes)}
                  for name, e in files.items()},
    }
    doc["signature"] = identity.sign(canonical_bytes(doc)).hex()
    return parse(doc)


def read(path: Path) -> Manifest:
    """The parsed manifest of checkpoint directory `path` (its files are not checked)."""
    try:  # (never blocks: a FIFO planted there hung the node's start and its I/O thread)
        data = read_regular(path / MANIFEST_FILE, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: no manifest.json") from None
    except TooLarge:
        raise ManifestError(f"{path.name}: manifest refused: the manifest is longer than "
                            f"{MAX_MANIFEST_BYTES} bytes") from None
    except (OSError, NotRegularFile) as exc:
        raise CheckpointError(f"{path.name}: unreadable manifest ({exc})") from None
    try:
        return loads(data)
    except ManifestError as exc:
        raise ManifestError(f"{path.name}: manifest refused: {exc}") from None


def verify(path: Path, manifest: Manifest, files: tuple[str, ...] = DATA_FILES) -> None:
    """Check that each of `files` in directory `path` has the manifest's size and hashes."""
    for name in files:
        entry = manifest.files[name]
        where = f"{path.name}/{name}"
        try:
            actual = (path / name).stat().st_size
            if actual != entry.size:
                raise CheckpointError(f"{where}: {actual} bytes, manifest says {entry.size} "
                                      "(truncated?)")
            with open(path / name, "rb") as f:
                for chunk in entry.chunks(name):
                    if xxhash.xxh3_64_hexdigest(f.read(chunk.length)) != chunk.digest:
                        raise CheckpointError(f"{where}: chunk {chunk.index} does not match "
                                              "its hash")
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot be read ({exc.strerror or exc})") from None
