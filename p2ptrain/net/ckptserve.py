"""Serving a node's own checkpoints over HTTP: the two MAC routes of the checkpoint API.

    GET /v1/checkpoint              {"id": <dir name>, "manifest": {...}} of the newest
                                    checkpoint this node signed itself; 404 if there is none
    GET /v1/checkpoint/{id}/{file}  the bytes of one file of checkpoint `id`; HTTP Range

Rules this file keeps:
- Authentication comes first: a request whose MAC or sequence fails gets 401 with the reason
  and nothing else is looked at. A GET that carries a body gets 400.
- Every other response (errors included) carries response MAC headers over its exact body.
  To MAC a range the server reads it into memory first, so a range is at most MAX_RANGE
  bytes: a longer one (including the open form `bytes=a-`) is *clamped* to MAX_RANGE and
  answered 206 with the true Content-Range, which a client must read (ours always asks for
  one manifest chunk, never more than MAX_RANGE). A whole-file 200 is MACed in a first pass
  over a read-only mapping of the same open file, then streamed in 1 MiB slices (checkpoint
  files are never rewritten or truncated in place -- store.save makes a new directory -- so
  the mapping cannot fault, and the streamed bytes are the MACed ones).
- Only checkpoints this node signed itself are served: the manifest verifies (signature and
  every chunk hash, via store.read_manifest), names this node as leader, and its key hashes
  to this node's id. Verification results are cached per (dir name, manifest inode, size,
  mtime), so bytes rotting on disk after the first check are caught by the fetcher's chunk
  hashes, not here.
- `{id}` must be a checkpoint directory name (store.NAME_RE, ASCII) and `{file}` one of
  SERVED_FILES, checked before any path is built: anything else is 404.
- Only single ranges `bytes=a-b` and `bytes=a-` are understood; anything else (multiple
  ranges, suffix ranges, other units, garbage) and ranges starting past the end get 416.
- Blocking work (hashing, reading) runs in worker threads, never in the event loop.
"""

from __future__ import annotations

import asyncio
import copy
import json
import mmap
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from p2ptrain.checkpoint import store
from p2ptrain.identity import node_id_of
from p2ptrain.net.auth import AuthError, RequestId, ServerAuth

MAX_RANGE = 16 * 2**20  # most bytes one range response holds (read into memory to be MACed)
SLICE = 2**20  # bytes per write when sending a body
SERVED_FILES = (store.MODEL_FILE, store.STATE_FILE, store.MANIFEST_FILE)
_CACHE_LIMIT = 256  # verification results remembered (oldest forgotten first)

# (checkpoint root, dir name) -> (manifest stamp, verified manifest or None if it failed)
_verdicts: dict[tuple[str, str], tuple[tuple[int, int, int], dict | None]] = {}
_verify_lock = threading.Lock()  # one hashing pass at a time; later callers hit the cache


class RangeError(ValueError):
    """A Range header this server will not satisfy (answered 416)."""


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = (path / store.MANIFEST_FILE).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _verified(ckroot: Path, name: str) -> dict | None:
    """The verified manifest of checkpoint `name` under `ckroot` (cached), or None."""
    path, key = ckroot / name, (str(ckroot), name)
    with _verify_lock:
        before = _stamp(path)
        if before is None:
            _verdicts.pop(key, None)
            return None
        cached = _verdicts.get(key)
        if cached is not None and cached[0] == before:
            return cached[1]
        try:
            manifest: dict | None = store.read_manifest(path)
        except store.CheckpointError:
            manifest = None
        if _stamp(path) == before:  # not replaced while we hashed it
            _verdicts.pop(key, None)
            _verdicts[key] = (before, manifest)
            while len(_verdicts) > _CACHE_LIMIT:
                del _verdicts[next(iter(_verdicts))]
        return manifest


def _signed_by(manifest: dict, node_id: str) -> bool:
    try:
        key_id = node_id_of(bytes.fromhex(manifest["leader_key"]))
    except (KeyError, TypeError, ValueError):
        return False
    return manifest.get("leader") == node_id and key_id == node_id


def own_manifest(ckroot: Path, name: str, node_id: str) -> dict | None:
    """The verified manifest of checkpoint `name` if this node signed it, else None."""
    if not is_checkpoint_name(name):
        return None
    manifest = _verified(ckroot, name)
    return manifest if manifest is not None and _signed_by(manifest, node_id) else None


def latest_own(ckroot: Path, node_id: str) -> tuple[str, dict] | None:
    """The newest checkpoint under `ckroot` that verifies and that `node_id` signed itself."""
    for path in store.list_checkpoints(ckroot):
        manifest = own_manifest(ckroot, path.name, node_id)
        if manifest is not None:
            return path.name, copy.deepcopy(manifest)
    return None


def is_checkpoint_name(text: str) -> bool:
    """Whether `text` is exactly a checkpoint directory name (ASCII digits, no newline)."""
    return text.isascii() and store.NAME_RE.fullmatch(text) is not None


def parse_range(header: str, size: int) -> tuple[int, int]:
    """(first, last) byte of a single `bytes=a-b` / `bytes=a-` range, clamped to MAX_RANGE."""
    unit, _, spec = header.strip().partition("=")
    first_text, dash, last_text = spec.strip().partition("-")
    if unit.strip().lower() != "bytes" or not dash:
        raise RangeError("only single byte ranges are served")
    for text in (first_text, last_text):
        if text and not (text.isascii() and text.isdigit() and len(text) <= 19):
            raise RangeError("malformed range")
    if not first_text:
        raise RangeError("suffix ranges are not served")
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last < first:
        raise RangeError("range ends before it starts")
    if first >= size:
        raise RangeError(f"range starts at {first}, file has {size} bytes")
    return first, min(last, size - 1, first + MAX_RANGE - 1)


def _pread_exact(fd: int, length: int, offset: int) -> bytearray:
    buf = bytearray(length)
    view, done = memoryview(buf), 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError("file shrank while being read")
        done += got
    return buf


def _whole_file_mac(auth: ServerAuth, method: str, path: str, rid: RequestId, fd: int,
                    size: int) -> dict[str, str]:
    if size == 0:
        return auth.sign(method, path, rid, 200, b"")
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        return auth.sign(method, path, rid, 200, mapped)


def _read_signed(auth: ServerAuth, method: str, path: str, rid: RequestId, fd: int, first: int,
                 last: int) -> tuple[memoryview, dict[str, str]]:
    body = memoryview(_pread_exact(fd, last - first + 1, first))
    return body, auth.sign(method, path, rid, 206, body)


def add_checkpoint_routes(app: web.Application, ckroot_of: Callable[[], Path],
                          auth: ServerAuth, node_id: str,
                          on_refused: Callable[[], None] | None = None) -> None:
    """Register GET /v1/checkpoint and GET /v1/checkpoint/{id}/{file} on `app`."""

    def signed_json(request: web.Request, rid: RequestId, status: int, doc: dict,
                    extra: dict[str, str] | None = None) -> web.Response:
        body = json.dumps(doc, separators=(",", ":")).encode()
        headers = auth.sign(request.method, request.path, rid, status, body)
        return web.Response(status=status, body=body, content_type="application/json",
                            headers={**headers, **(extra or {})})

    def authenticate(request: web.Request) -> RequestId | web.Response:
        try:
            rid = auth.verify(request.method, request.path, request.headers, b"")
        except AuthError as exc:
            if on_refused is not None:
                on_refused()
            return web.json_response({"error": exc.reason}, status=401)
        if request.body_exists:
            return signed_json(request, rid, 400, {"error": "a GET carries no body"})
        return rid

    async def latest(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        found = await asyncio.to_thread(latest_own, ckroot_of(), node_id)
        if found is None:
            return signed_json(request, rid, 404, {"error": "no checkpoint of ours to serve"})
        return signed_json(request, rid, 200, {"id": found[0], "manifest": found[1]})

    async def respond(request: web.Request, status: int, headers: dict[str, str], size: int,
                      pieces: Callable[[int], Awaitable[bytes | memoryview]]) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_type = "application/octet-stream"
        resp.content_length = size
        await resp.prepare(request)
        for start in range(0, size, SLICE):  # a read error from here on drops the connection
            await resp.write(await pieces(start))
        await resp.write_eof()
        return resp

    async def serve_file(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        name, file = request.match_info["id"], request.match_info["file"]
        if file not in SERVED_FILES or not is_checkpoint_name(name):
            return signed_json(request, rid, 404, {"error": "no such checkpoint file"})
        ckroot = ckroot_of()
        if await asyncio.to_thread(own_manifest, ckroot, name, node_id) is None:
            return signed_json(request, rid, 404, {"error": f"no checkpoint {name} of ours"})
        try:  # name and file were checked above: this path stays inside ckroot
            fd = os.open(ckroot / name / file, os.O_RDONLY)
        except OSError:
            return signed_json(request, rid, 404, {"error": f"{name}/{file} is gone"})
        try:
            size = os.fstat(fd).st_size
            range_header = request.headers.get("Range")
            base = {"Accept-Ranges": "bytes"}
            if range_header is None:  # the same open file is MACed, then streamed
                try:
                    mac = await asyncio.to_thread(_whole_file_mac, auth, request.method,
                                                  request.path, rid, fd, size)
                except (OSError, ValueError) as exc:
                    return signed_json(request, rid, 500, {"error": f"cannot read: {exc}"})

                async def from_disk(start: int) -> bytes | memoryview:
                    return await asyncio.to_thread(_pread_exact, fd, min(SLICE, size - start),
                                                   start)

                return await respond(request, 200, {**base, **mac}, size, from_disk)
            try:
                first, last = parse_range(range_header, size)
            except RangeError as exc:
                return signed_json(request, rid, 416, {"error": str(exc)},
                                   {**base, "Content-Range": f"bytes */{size}"})
            try:
                body, mac = await asyncio.to_thread(_read_signed, auth, request.method,
                                                    request.path, rid, fd, first, last)
            except OSError as exc:
                return signed_json(request, rid, 500, {"error": f"cannot read: {exc}"})
            headers = {**base, **mac, "Content-Range": f"bytes {first}-{last}/{size}"}

            async def from_memory(start: int) -> bytes | memoryview:
                return body[start : start + SLICE]

            return await respond(request, 206, headers, len(body), from_memory)
        finally:
            os.close(fd)

    app.router.add_get("/v1/checkpoint", latest, allow_head=False)
    app.router.add_get("/v1/checkpoint/{id}/{file}", serve_file, allow_head=False)
