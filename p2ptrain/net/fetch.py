"""Fetching the leader's latest checkpoint: verify everything, resume after a break.

The fetcher first learns who serves at the address (hello.py: every request names its
receiver), then asks `GET /v1/checkpoint` for the newest checkpoint's id and manifest, checks the
manifest field by field (types, sizes, chunk lists), its Ed25519 signature, that the signing
key belongs to the leader it names, and (when given) that this is the leader we expect. Then
it downloads the two data files chunk by chunk, one Range request per manifest chunk, a few
in flight, and checks each response's MAC and each chunk's xxh3_64 before writing it.

Rules this file keeps:
- Every byte from the network is hostile: bodies are read with a cap fixed before reading,
  JSON is checked for shape and type before use, sizes are bounded before any file is sized.
- Downloads land in `out_root/.partial-<id>/`: data files are pre-sized and written with
  positional writes; `progress.json` (replaced atomically) lists the chunks written. After a
  break, the chunks it lists are hashed again (a crash may have lost unsynced data, which is
  why it need not be fsynced) and only the others are fetched. A partial of another manifest
  under the same id is discarded.
- `out_root/<id>` only ever holds a checkpoint that store.read_manifest accepted: the
  finished partial is fsynced and verified, then renamed into place and out_root fsynced.
- One fetch per (out_root, id) at a time; one ClientSession, the caller's; no sleeps (a failed
  chunk is asked for again at once, up to `chunk_retries` times).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import xxhash
from yarl import URL

from p2ptrain.checkpoint import store
from p2ptrain.fsutil import atomic_write_bytes, fsync_dir
from p2ptrain.identity import node_id_of, verify_signature
from p2ptrain.net.auth import AuthError, Receiver, RequestId, Signer
from p2ptrain.net.ckptserve import MAX_RANGE, is_checkpoint_name
from p2ptrain.net.hello import HelloError, hello

MAX_ANSWER_BYTES = 8 * 2**20  # largest GET /v1/checkpoint answer read
MAX_ERROR_BYTES = 64 * 2**10  # largest error body read
MAX_FILE_BYTES = 256 * 2**30  # largest data file a manifest may announce
MIN_CHUNK_SIZE = 4096  # smallest chunk size accepted (bounds the number of requests)
IN_FLIGHT = 3  # chunk requests outstanding at once (the server MACs one while sending another)
PARTIAL_PREFIX, PROGRESS_FILE = ".partial-", "progress.json"
DATA_FILES = (store.MODEL_FILE, store.STATE_FILE)
_MANIFEST_KEYS = frozenset({"format", "step", "term", "leader", "leader_key", "fingerprint",
                            "arch", "swarm_samples", "swarm_count", "files", "signature"})
_ENTRY_KEYS = frozenset({"size", "chunk_size", "xxh3_64"})


class FetchError(Exception):
    """A checkpoint could not be fetched; the one-line message says why."""


class NoCheckpoint(FetchError):
    """The node asked holds no checkpoint (yet): asking it again at once will not help."""


class _Retry(Exception):
    """One attempt at a chunk failed in a way the next attempt may not (transport, MAC, hash)."""


@dataclass(frozen=True, slots=True)
class _Chunk:
    file: str  # data file name
    index: int  # chunk number in the manifest
    offset: int  # first byte in the file
    length: int  # bytes in this chunk
    digest: str  # xxh3_64 hex from the manifest


@dataclass(frozen=True, slots=True)
class _Conn:
    session: aiohttp.ClientSession
    base: str  # scheme://host:port[/prefix], no trailing slash
    signer: Signer
    timeout: aiohttp.ClientTimeout
    to: Receiver  # who serves at `base` (from hello)


def _is_hex(value: object, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _check_entry(name: str, entry: object) -> None:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise FetchError(f"manifest entry of {name} is malformed")
    size, chunk, digests = entry["size"], entry["chunk_size"], entry["xxh3_64"]
    if not _is_count(size) or not 0 < size <= MAX_FILE_BYTES:
        raise FetchError(f"manifest: {name} has an impossible size")
    if not _is_count(chunk) or not MIN_CHUNK_SIZE <= chunk <= MAX_RANGE:
        raise FetchError(f"manifest: {name} chunk size out of [{MIN_CHUNK_SIZE}, {MAX_RANGE}]")
    if not isinstance(digests, list) or len(digests) != -(-size // chunk):
        raise FetchError(f"manifest: {name} chunk list does not match its size")
    if not all(_is_hex(d, 16) for d in digests):
        raise FetchError(f"manifest: {name} has a malformed chunk hash")


def check_answer(doc: object) -> tuple[str, dict]:
    """The (id, manifest) of a GET /v1/checkpoint answer if well-formed and validly signed."""
    if not isinstance(doc, dict) or set(doc) != {"id", "manifest"}:
        raise FetchError("checkpoint answer is not an {id, manifest} object")
    ckid, m = doc["id"], doc["manifest"]
    if not isinstance(ckid, str) or not is_checkpoint_name(ckid):
        raise FetchError("checkpoint answer carries a malformed id")
    if not isinstance(m, dict):
        raise FetchError("manifest is not an object")
    if set(m) != _MANIFEST_KEYS:
        odd = sorted(_MANIFEST_KEYS.symmetric_difference(m))[:3]
        raise FetchError(f"manifest fields missing or unexpected: {[k[:40] for k in odd]}")
    if m["format"] != store.FORMAT:
        raise FetchError(f"manifest is not {store.FORMAT}")
    if not all(_is_count(m[k]) for k in ("step", "term", "swarm_samples")):
        raise FetchError("manifest step, term or swarm_samples is not a count")
    if ckid != store.checkpoint_name(m["term"], m["step"]):
        raise FetchError(f"id {ckid} does not name the manifest's term and step")
    if not (_is_hex(m["leader"], 32) and _is_hex(m["leader_key"], 64)
            and _is_hex(m["signature"], 128)):
        raise FetchError("manifest leader, key or signature is malformed")
    if not isinstance(m["fingerprint"], str) or not isinstance(m["arch"], dict):
        raise FetchError("manifest fingerprint or arch is malformed")
    counts = m["swarm_count"]
    if not isinstance(counts, dict) or not all(_is_count(v) for v in counts.values()):
        raise FetchError("manifest swarm_count is malformed")
    files = m["files"]
    if not isinstance(files, dict) or set(files) != set(DATA_FILES):
        raise FetchError("manifest lists the wrong files")
    for name in DATA_FILES:
        _check_entry(name, files[name])
    key = bytes.fromhex(m["leader_key"])
    if not verify_signature(key, bytes.fromhex(m["signature"]), store.canonical_bytes(m)):
        raise FetchError("manifest signature does not verify")
    if node_id_of(key) != m["leader"]:
        raise FetchError(f"manifest names leader {m['leader']} but is signed by another key")
    return ckid, m


def _reason(body: bytes | memoryview) -> str:
    """The `error` text of an error body, made printable and short (it may be hostile)."""
    try:
        text = json.loads(bytes(body))["error"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return "no reason given"
    if not isinstance(text, str):
        return "no reason given"
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:200])


@dataclass(frozen=True, slots=True)
class _Answer:
    rid: RequestId  # the request this answers
    path: str  # the URL path the request was signed for
    status: int
    headers: Mapping[str, str]
    body: memoryview


async def _get(conn: _Conn, path: str, ok_status: int, limit: int, into: bytearray | None,
               byte_range: tuple[int, int] | None = None) -> _Answer:
    """One signed GET of `path` under the base URL; its MAC is not checked here."""
    url = URL(conn.base + path, encoded=True)
    rid, headers = conn.signer.sign_request("GET", url.path, to=conn.to)
    if byte_range is not None:
        headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    try:
        async with conn.session.get(url, headers=headers, timeout=conn.timeout,
                                    allow_redirects=False) as resp:
            status = resp.status
            cap = limit if status == ok_status else MAX_ERROR_BYTES
            if resp.content_length is not None and resp.content_length > cap:
                raise _Retry(f"answer {status} of {resp.content_length} bytes is too long")
            buf = into if status == ok_status and into is not None else bytearray()
            n = 0
            while piece := await resp.content.readany():
                if n + len(piece) > cap:
                    raise _Retry(f"answer {status} is longer than {cap} bytes")
                buf[n : n + len(piece)] = piece
                n += len(piece)
            body, resp_headers = memoryview(buf)[:n], resp.headers
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _Retry(f"transfer failed ({type(exc).__name__}: {exc})".strip()) from None
    if status == 401:
        raise FetchError(f"the server refused our authentication (401: {_reason(body)}); "
                         "is this the right swarm key?")
    return _Answer(rid, url.path, status, resp_headers, body)


def _check_mac(signer: Signer, answer: _Answer) -> None:
    try:
        signer.check_response("GET", answer.path, answer.rid, answer.status, answer.headers,
                              answer.body)
    except AuthError as exc:
        raise _Retry(f"answer {answer.status} rejected: {exc.reason}") from None


def _check_and_write(signer: Signer, answer: _Answer, chunk: _Chunk, size: int,
                     target: Path) -> None:
    """In a worker thread: authenticate one chunk answer, check its hash, write it in place."""
    _check_mac(signer, answer)
    status, headers, body = answer.status, answer.headers, answer.body
    if status == 404:
        raise FetchError(f"{chunk.file}: no longer served ({_reason(body)})")
    if status >= 500:
        raise _Retry(f"server error {status} ({_reason(body)})")
    if status != 206:
        raise FetchError(f"{chunk.file}: answer {status} to a range request ({_reason(body)})")
    last = chunk.offset + chunk.length - 1
    if headers.get("Content-Range") != f"bytes {chunk.offset}-{last}/{size}" \
            or len(body) != chunk.length:
        raise FetchError(f"{chunk.file}: served range does not match the manifest")
    if xxhash.xxh3_64_hexdigest(body) != chunk.digest:
        raise _Retry("bytes do not match the manifest hash")
    fd = os.open(target, os.O_WRONLY)  # opened per chunk: no descriptor outlives a cancel
    try:
        done = 0
        while done < len(body):
            done += os.pwrite(fd, body[done:], chunk.offset + done)
    finally:
        os.close(fd)


async def _fetch_chunk(conn: _Conn, ckid: str, chunk: _Chunk, size: int, partial: Path,
                       buf: bytearray, retries: int, stop: list) -> bool:
    """Fetch, verify and write one chunk; False if the fetch was stopped meanwhile."""
    path = f"/v1/checkpoint/{ckid}/{chunk.file}"
    problem = ""
    for _attempt in range(retries + 1):
        if stop:
            return False
        try:
            answer = await _get(conn, path, 206, chunk.length, buf,
                                (chunk.offset, chunk.offset + chunk.length - 1))
            await asyncio.to_thread(_check_and_write, conn.signer, answer, chunk, size,
                                    partial / chunk.file)
            return True
        except _Retry as exc:
            problem = str(exc)
    raise FetchError(f"{chunk.file} chunk {chunk.index}: {problem} ({retries + 1} attempts)")


def _chunks(manifest: dict) -> list[_Chunk]:
    out = []
    for name in DATA_FILES:
        entry = manifest["files"][name]
        size, step = entry["size"], entry["chunk_size"]
        for i, digest in enumerate(entry["xxh3_64"]):
            out.append(_Chunk(name, i, i * step, min(step, size - i * step), digest))
    return out


def _write_progress(partial: Path, doc: dict) -> None:
    tmp = partial / f".{PROGRESS_FILE}.tmp"
    tmp.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    os.replace(tmp, partial / PROGRESS_FILE)  # atomic; durability is not needed (see above)


class _ProgressFile:
    """The chunks written so far, saved by one background writer that coalesces updates (a
    rename costs milliseconds on ext4, too much to pay in the event loop for every chunk)."""

    def __init__(self, partial: Path, tag: str, done: set[_Chunk]):
        self.partial, self.tag, self.done = partial, tag, done
        self._dirty, self._writer = False, None

    def add(self, chunk: _Chunk) -> None:
        self.done.add(chunk)
        self._dirty = True
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._dirty:
                self._dirty = False
                doc = {"manifest": self.tag, "done": {
                    n: sorted(c.index for c in self.done if c.file == n) for n in DATA_FILES}}
                await asyncio.to_thread(_write_progress, self.partial, doc)
        finally:
            self._writer = None

    async def flush(self) -> None:
        """Return once the file lists every chunk added so far."""
        while self._writer is not None:
            await self._writer


def _resume(partial: Path, tag: str, manifest: dict, chunks: list[_Chunk]) -> set[_Chunk]:
    """In a worker thread: the chunks already in `partial` whose bytes still hash right."""
    try:
        doc = json.loads((partial / PROGRESS_FILE).read_bytes())
        listed = {(n, i) for n in DATA_FILES for i in doc["done"][n] if type(i) is int}
        if doc["manifest"] != tag:
            raise ValueError("another manifest")
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        shutil.rmtree(partial, ignore_errors=True)  # unusable or of another checkpoint
        listed = set()
    total = sum(manifest["files"][n]["size"] for n in DATA_FILES)
    if not partial.is_dir():
        free = shutil.disk_usage(partial.parent).free
        if free < total:
            raise FetchError(f"needs {total} bytes of disk, {free} free")
        partial.mkdir()
    for name in DATA_FILES:
        fd = os.open(partial / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != manifest["files"][name]["size"]:
                os.ftruncate(fd, manifest["files"][name]["size"])
        finally:
            os.close(fd)
    good = set()
    for name in DATA_FILES:
        with open(partial / name, "rb") as f:
            for c in chunks:
                if c.file == name and (name, c.index) in listed:
                    f.seek(c.offset)
                    if xxhash.xxh3_64_hexdigest(f.read(c.length)) == c.digest:
                        good.add(c)
    return good


def _finish(partial: Path, final: Path, manifest: dict) -> None:
    """In a worker thread: make `partial` durable, verify it, rename it to `final`."""
    atomic_write_bytes(partial / store.MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    for name in DATA_FILES:
        fd = os.open(partial / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for leftover in (PROGRESS_FILE, f".{PROGRESS_FILE}.tmp"):
        (partial / leftover).unlink(missing_ok=True)
    fsync_dir(partial)
    try:
        if store.read_manifest(partial) != manifest:
            raise store.CheckpointError("manifest on disk differs from the one fetched")
    except store.CheckpointError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise FetchError(f"the downloaded checkpoint does not verify: {exc}") from None
    old = final.with_name(f".old-{final.name}-{os.getpid()}") if final.exists() else None
    if old is not None:  # same id, other content: the leader rewrote it
        os.rename(final, old)
    os.rename(partial, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _existing(final: Path, manifest: dict) -> bool:
    try:
        return final.is_dir() and store.read_manifest(final) == manifest
    except store.CheckpointError:
        return False


async def fetch_latest(session: aiohttp.ClientSession, base_url: str, signer: Signer,
                       out_root: Path, *, expected_leader: str | None,
                       progress: Callable[[int, int], None] | None = None,
                       chunk_retries: int = 5, timeout: float = 60) -> Path:
    """Fetch the newest checkpoint served at `base_url` into `out_root`; its directory."""
    base = base_url.rstrip("/")
    try:
        to = await hello(session, base, signer, timeout)
    except HelloError as exc:
        raise FetchError(f"checkpoint fetch from {base_url}: {exc}") from None
    conn = _Conn(session, base, signer,
                 aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout), to)
    try:
        return await _fetch(conn, out_root, expected_leader, progress, chunk_retries)
    except (FetchError, OSError) as exc:
        where = "" if isinstance(exc, FetchError) else f"{out_root}: "
        text = " ".join(f"{where}{exc}".split())[:500]  # one line, whatever a peer sent
        kind = NoCheckpoint if isinstance(exc, NoCheckpoint) else FetchError
        raise kind(f"checkpoint fetch from {base_url}: {text}") from None


async def _fetch(conn: _Conn, out_root: Path, expected_leader: str | None,
                 progress: Callable[[int, int], None] | None, retries: int) -> Path:
    try:
        answer = await _get(conn, "/v1/checkpoint", 200, MAX_ANSWER_BYTES, None)
        _check_mac(conn.signer, answer)
    except _Retry as exc:
        raise FetchError(str(exc)) from None
    status, body = answer.status, answer.body
    if status == 404:
        raise NoCheckpoint(f"no checkpoint to fetch ({_reason(body)})")
    if status != 200:
        raise FetchError(f"answer {status} ({_reason(body)})")
    try:
        doc = json.loads(bytes(body))
    except (ValueError, RecursionError):
        raise FetchError("checkpoint answer is not JSON") from None
    ckid, manifest = check_answer(doc)
    if expected_leader is not None and manifest["leader"] != expected_leader:
        raise FetchError(f"manifest signed by {manifest['leader']}, not the leader "
                         f"{expected_leader}")
    out_root.mkdir(parents=True, exist_ok=True)
    final, partial = out_root / ckid, out_root / f"{PARTIAL_PREFIX}{ckid}"
    if await asyncio.to_thread(_existing, final, manifest):
        return final
    tag = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    chunks = _chunks(manifest)
    done = await asyncio.to_thread(_resume, partial, tag, manifest, chunks)
    sizes = {n: manifest["files"][n]["size"] for n in DATA_FILES}
    total, done_bytes = sum(sizes.values()), sum(c.length for c in done)
    queue = collections.deque(c for c in chunks if c not in done)
    stop: list[BaseException] = []  # the first failure; workers finish their chunk and stop
    saved = _ProgressFile(partial, tag, done)

    async def worker(buf: bytearray) -> None:
        nonlocal done_bytes
        while queue and not stop:
            chunk = queue.popleft()
            try:
                if not await _fetch_chunk(conn, ckid, chunk, sizes[chunk.file], partial, buf,
                                          retries, stop):
                    return
                saved.add(chunk)
                done_bytes += chunk.length
                if progress is not None:
                    progress(done_bytes, total)
            except Exception as exc:  # re-raised below, once every worker has stopped
                stop.append(exc)
                return

    if queue:
        longest = max(c.length for c in queue)
        try:
            await asyncio.gather(*(worker(bytearray(longest))
                                   for _ in range(min(IN_FLIGHT, len(queue)))))
        finally:
            await saved.flush()
    if stop:
        raise stop[0]
    await asyncio.to_thread(_finish, partial, final, manifest)
    return final
