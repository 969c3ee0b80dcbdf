"""What this node holds and may serve: verified checkpoints on disk and chunks of fetches in
progress.

Any holder serves (issue 14): the checkpoints this node wrote as leader, the ones it fetched
(whole, or weights only: a joiner needs no optimiser moments), and the chunks a fetch in
progress has already verified, so later fetchers can pull from earlier ones. A manifest stays
the one its leader signed; what a holder adds is only which chunks it has.

- Directories under the shelf's roots are verified once (signature and every chunk hash of the
  files present) and the verdict is cached per (root, name) against the manifest's inode, size
  and mtime: bytes rotting on disk after that are caught by the fetcher's chunk hashes.
- A fetch registers what it has verified (`register`); those entries are trusted without
  hashing again and win over a scan of the same directory.
- Nothing here trusts the network: the shelf only reads local files.
Blocking (it hashes files): call `find`/`latest` from a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.checkpoint import store

_CACHE_LIMIT = 256  # scan verdicts remembered (oldest forgotten first)
PIN_SECONDS = 300.0  # a checkpoint served this recently is not pruned (a fetch is under way)
PIN_MAX = 2  # ... but at most this many beyond `keep` (a member fetching forever cannot
             # make a node keep every checkpoint it writes)


@dataclass
class Held:
    """One checkpoint this node holds, whole or in part."""

    path: Path  # its directory (a fetch in progress: the partial directory)
    manifest: mf.Manifest
    have: dict[str, set[int]] | None  # verified chunk indices per file; None: every chunk

    @property
    def id(self) -> str:
        return self.manifest.id

    def complete(self, files: tuple[str, ...]) -> bool:
        if self.have is None:
            return True
        return all(len(self.have[f]) == len(self.manifest.files[f].hashes) for f in files)

    def covers(self, file: str, first: int, last: int) -> bool:
        """Whether bytes first..last of `file` lie in chunks this node holds."""
        if self.have is None:
            return True
        step = self.manifest.files[file].chunk_size
        held = self.have[file]
        return all(i in held for i in range(first // step, last // step + 1))

    def have_doc(self) -> dict[str, list[list[int]]] | None:
        """`have` as runs [first, end) of chunk indices per file (None: everything)."""
        if self.have is None:
            return None
        return {f: runs(sorted(self.have[f])) for f in mf.DATA_FILES}


def runs(indices: list[int]) -> list[list[int]]:
    """Sorted indices as [first, end) runs: [0, 1, 2, 5] -> [[0, 3], [5, 6]]."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = (path / mf.MANIFEST_FILE).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _scan_one(path: Path) -> Held | None:
    """A checkpoint directory verified from disk: whole, weights only, or nothing."""
    try:
        manifest = mf.read(path)
        present = tuple(f for f in mf.DATA_FILES if (path / f).exists())
        if mf.MODEL_FILE not in present:
            return None
        mf.verify(path, manifest, present)
    except mf.CheckpointError:
        return None
    if len(present) == len(mf.DATA_FILES):
        return Held(path, manifest, None)
    return Held(path, manifest, {f: set(range(len(manifest.files[f].hashes))) if f in present
                                 else set() for f in mf.DATA_FILES})


class Shelf:
    """The checkpoints under `roots()` plus those registered by fetches (see the docstring)."""

    def __init__(self, roots: Callable[[], list[Path]]):
        self.roots = roots
        self._verdicts: dict[tuple[str, str], tuple[tuple[int, int, int], Held | None]] = {}
        self._live: dict[str, Held] = {}  # checkpoint id -> what a fetch registered
        self._scan_lock = threading.Lock()  # one hashing pass at a time; later ones hit the cache
        self._live_lock = threading.Lock()  # held only for a dictionary update (event loop)
        self.changed: Callable[[], None] | None = None  # told when a registration changes
        self.served_at: dict[str, float] = {}  # checkpoint id -> when a chunk of it was served

    def register(self, held: Held) -> None:
        """A fetch's verified chunks (a partial) or its finished directory: served as they are."""
        with self._live_lock:
            self._live[held.id] = held
        if self.changed is not None:
            self.changed()

    def unregister(self, held: Held) -> None:
        with self._live_lock:
            if self._live.get(held.id) is held:
                del self._live[held.id]
        if self.changed is not None:
            self.changed()

    def _scanned(self, root: Path, name: str) -> Held | None:
        path, key = root / name, (str(root), name)
        before = _stamp(path)
        if before is None:
            self._verdicts.pop(key, None)
            return None
        cached = self._verdicts.get(key)
        if cached is not None and cached[0] == before:
            return cached[1]
        held = _scan_one(path)
        if _stamp(path) == before:  # not replaced while we hashed it
            self._verdicts.pop(key, None)
            self._verdicts[key] = (before, held)
            while len(self._verdicts) > _CACHE_LIMIT:
                del self._verdicts[next(iter(self._verdicts))]
        return held

    def find(self, ckid: str) -> Held | None:
        """What this node holds of checkpoint `ckid` (`ckid` must be a checkpoint name)."""
        if not is_checkpoint_name(ckid):
            return None
        with self._live_lock:
            live = self._live.get(ckid)
        if live is not None and live.path.is_dir():
            return live
        with self._scan_lock:
            for root in self.roots():
                held = self._scanned(root, ckid)
                if held is not None:
                    return held
        return None

    def latest(self) -> Held | None:
        """The newest (term, step) checkpoint held with its weights whole."""
        names = {p.name for root in self.roots() for p in store.list_checkpoints(root)}
        with self._live_lock:
            names |= {k for k, h in self._live.items() if h.complete((mf.MODEL_FILE,))}
        for name in sorted(names, key=_order, reverse=True):
            held = self.find(name)
            if held is not None and held.complete((mf.MODEL_FILE,)):
                return held
        return None

    def touch(self, ckid: str) -> None:
        """A chunk of `ckid` was served just now (a fetch is under way)."""
        self.served_at[ckid] = time.monotonic()
        while len(self.served_at) > _CACHE_LIMIT:
            del self.served_at[min(self.served_at, key=self.served_at.__getitem__)]

    def pinned(self, ckid: str) -> bool:
        """Whether pruning should spare `ckid`: one of the PIN_MAX most recently served, and
        within PIN_SECONDS."""
        recent = sorted(((t, k) for k, t in self.served_at.items()
                         if time.monotonic() - t < PIN_SECONDS), reverse=True)[:PIN_MAX]
        return any(k == ckid for _, k in recent)

    def advertised(self) -> Held | None:
        """What to tell the swarm this node holds: the newest of what fetches registered
        (a fetch in progress included) and what is held with whole weights."""
        found = [h for h in self.live() if h.path.is_dir()]
        latest = self.latest()
        if latest is not None:
            found.append(latest)
        return max(found, key=lambda h: _order(h.id), default=None)

    def live(self) -> list[Held]:
        """What fetches registered (partials included), newest first."""
        with self._live_lock:
            return sorted(self._live.values(), key=lambda h: _order(h.id), reverse=True)


def shelved(write: Callable[..., Path], shelf: Shelf) -> Callable[..., Path]:
    """`write` (store.save, bound) that spares checkpoints being fetched when it prunes and
    puts what it wrote on the shelf (no hashing: this node just wrote and hashed it)."""
    def run(snap: store.Snapshot, progress: Callable | None = None) -> Path:
        path = write(snap, progress=progress, pinned=shelf.pinned)
        shelf.register(Held(path, mf.read(path), None))
        return path
    return run


def _order(name: str) -> tuple[int, int]:
    m = store.NAME_RE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def is_checkpoint_name(text: str) -> bool:
    """Whether `text` is exactly a checkpoint directory name (ASCII digits, no newline)."""
    return text.isascii() and store.NAME_RE.fullmatch(text) is not None
