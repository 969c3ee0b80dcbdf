"""Serving the checkpoints this node holds over HTTP: the MAC routes of the checkpoint API.

    GET /v1/checkpoint              {"id", "manifest", "have"} of the newest checkpoint this
                                    node holds, whole or in part (what it gossips); 404 if none
    GET /v1/checkpoint/{id}         the same for checkpoint `id` (whole or in part); 404 if none
    GET /v1/checkpoint/{id}/{file}  the bytes of one file of checkpoint `id`; HTTP Range

`have` is null when every chunk of both files is held, else per data file the runs
[first, end) of chunk indices held (a fetch in progress, or weights only). Any holder serves
(issue 14): the leader's own checkpoints, fetched ones, and the verified chunks of a fetch in
progress (see shelf.py); the manifest is always the one its leader signed.

Rules this file keeps:
- Authentication comes first: a request whose MAC or sequence fails gets 401 with the reason
  and nothing else is looked at. A GET that carries a body gets 400.
- Every other response (errors included) carries response MAC headers over its exact body.
  A body from a file -- a whole-file 200 (only of a file held whole) or a range -- is MACed
  in a first pass over a read-only mapping of the same open file, then streamed from it a
  PIECE at a time (checkpoint files are never rewritten in place -- store.save makes a new
  directory, a fetch writes each chunk once -- so the streamed bytes are the MACed ones): a
  client that does not read holds one piece of the server's memory, not its whole range.
  A range is at most MAX_RANGE bytes: a longer one (including the open form `bytes=a-`) is
  *clamped* to MAX_RANGE and answered 206 with the true Content-Range, which a client must
  read (ours always asks for one manifest chunk, never more than MAX_RANGE).
- A range is served only if every chunk it touches is held (else 404: "not held here"), so
  a partial holder never sends bytes it has not verified.
- Every body byte passes the node's upload bucket (the --max-upload-mbps cap covers serving)
  and is counted (`on_served`).
- `{id}` must be a checkpoint directory name (store.NAME_RE, ASCII) and `{file}` one of
  SERVED_FILES, checked before any path is built: anything else is 404.
- Only single ranges `bytes=a-b` and `bytes=a-` are understood; anything else (multiple
  ranges, suffix ranges, other units, garbage) and ranges starting past the end get 416.
- Blocking work (hashing, reading) runs in worker threads, never in the event loop.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.net.auth import AuthError, RequestId, ServerAuth
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.shelf import Held, Shelf, is_checkpoint_name

MAX_RANGE = mf.MAX_CHUNK_SIZE  # most bytes one range response carries
PIECE = 1 << 20  # bytes read from disk and written at a time (at most the bucket's slice)
SERVED_FILES = (mf.MODEL_FILE, mf.STATE_FILE, mf.MANIFEST_FILE)

__all__ = ["MAX_RANGE", "SERVED_FILES", "RangeError", "Serving", "add_checkpoint_routes",
           "is_checkpoint_name", "parse_range"]


class RangeError(ValueError):
    """A Range header this server will not satisfy (answered 416)."""


@dataclass(frozen=True)
class Serving:
    """What the checkpoint routes need."""

    shelf: Shelf
    auth: ServerAuth
    bucket: TokenBucket = field(default_factory=lambda: TokenBucket(0))  # upload cap
    on_refused: Callable[[], None] | None = None  # a request failed authentication
    on_served: Callable[[int], None] | None = None  # body bytes of checkpoint data sent


def describe(held: Held) -> dict:
    """The {id, manifest, have} document of a held checkpoint."""
    return {"id": held.id, "manifest": held.manifest.to_json(), "have": held.have_doc()}


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


def file_mac(auth: ServerAuth, method: str, path: str, rid: RequestId, status: int, fd: int,
             first: int, n: int) -> dict[str, str]:
    """MAC headers of a response whose body is bytes [first, first + n) of the open file
    `fd`, from a read-only mapping (in a worker thread: it reads them all)."""
    if n == 0:
        return auth.sign(method, path, rid, status, b"")
    start = first - first % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, first + n - start, access=mmap.ACCESS_READ, offset=start) as mapped, \
            memoryview(mapped) as view, view[first - start :] as body:
        return auth.sign(method, path, rid, status, body)


async def send_file(request: web.Request, status: int, headers: dict[str, str], fd: int,
                    first: int, n: int, bucket: TokenBucket,
                    on_served: Callable[[int], None] | None) -> web.StreamResponse:
    """Stream bytes [first, first + n) of the open file `fd` (MACed by `file_mac`), a PIECE
    at a time through the upload bucket; a read error from here on drops the connection."""
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_type = "application/octet-stream"
    resp.content_length = n
    await resp.prepare(request)
    step = min(PIECE, bucket.slice)
    for start in range(0, n, step):
        size = min(step, n - start)
        await bucket.take(size)
        await resp.write(await asyncio.to_thread(_pread_exact, fd, size, first + start))
        if on_served is not None:
            on_served(size)
    await resp.write_eof()
    return resp




def authenticate_get(auth: ServerAuth, request: web.Request,
                     on_refused: Callable[[], None] | None) -> RequestId | web.Response:
    """The request's id when its MAC holds and it carries no body; else the answer to send:
    401 with the reason (unsigned: nothing about the request is trusted), or a signed 400."""
    try:
        rid = auth.verify(request.method, request.path, request.headers, b"")
    except AuthError as exc:
        if on_refused is not None:
            on_refused()
        return web.json_response({"error": exc.reason}, status=401)
    if request.body_exists:
        body = json.dumps({"error": "a GET carries no body"}).encode()
        return web.Response(status=400, body=body, content_type="application/json",
                            headers=auth.sign(request.method, request.path, rid, 400, body))
    return rid


def add_checkpoint_routes(app: web.Application, serving: Serving) -> None:
    """Register the checkpoint routes (see the module docstring) on `app`."""
    auth, shelf, bucket = serving.auth, serving.shelf, serving.bucket

    def signed_json(request: web.Request, rid: RequestId, status: int, doc: dict,
                    extra: dict[str, str] | None = None) -> web.Response:
        body = json.dumps(doc, separators=(",", ":")).encode()
        headers = auth.sign(request.method, request.path, rid, status, body)
        return web.Response(status=status, body=body, content_type="application/json",
                            headers={**headers, **(extra or {})})

    def authenticate(request: web.Request) -> RequestId | web.Response:
        return authenticate_get(auth, request, serving.on_refused)

    async def latest(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        held = await asyncio.to_thread(shelf.advertised)
        if held is None:
            return signed_json(request, rid, 404, {"error": "no checkpoint held here"})
        return signed_json(request, rid, 200, describe(held))

    async def one(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        name = request.match_info["id"]
        held = await asyncio.to_thread(shelf.find, name) if is_checkpoint_name(name) else None
        if held is None:
            return signed_json(request, rid, 404, {"error": "checkpoint not held here"})
        return signed_json(request, rid, 200, describe(held))

    async def serve_file(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        name, file = request.match_info["id"], request.match_info["file"]
        if file not in SERVED_FILES or not is_checkpoint_name(name):
            return signed_json(request, rid, 404, {"error": "no such checkpoint file"})
        held = await asyncio.to_thread(shelf.find, name)
        if held is None:
            return signed_json(request, rid, 404, {"error": f"checkpoint {name} not held here"})
        if file == mf.MANIFEST_FILE:
            body = held.manifest.encode()
            return web.Response(body=body, content_type="application/json", headers=auth.sign(
                request.method, request.path, rid, 200, body))
        try:  # name and file were checked above: this path stays inside the holder's root
            fd = os.open(held.path / file, os.O_RDONLY)
        except OSError:
            return signed_json(request, rid, 404, {"error": f"{name}/{file} is gone"})
        try:
            size = held.manifest.files[file].size
            if os.fstat(fd).st_size != size:
                return signed_json(request, rid, 404, {"error": f"{name}/{file} is gone"})
            range_header = request.headers.get("Range")
            base = {"Accept-Ranges": "bytes"}
            if range_header is None:  # the same open file is MACed, then streamed
                if not held.complete((file,)):
                    return signed_json(request, rid, 404, {"error": f"{file} not held whole"})
                try:
                    mac = await asyncio.to_thread(file_mac, auth, request.method,
                                                  request.path, rid, 200, fd, 0, size)
                except (OSError, ValueError) as exc:
                    return signed_json(request, rid, 500, {"error": f"cannot read: {exc}"})
                return await send_file(request, 200, {**base, **mac}, fd, 0, size, bucket,
                                       serving.on_served)
            try:
                first, last = parse_range(range_header, size)
            except RangeError as exc:
                return signed_json(request, rid, 416, {"error": str(exc)},
                                   {**base, "Content-Range": f"bytes */{size}"})
            if not held.covers(file, first, last):
                return signed_json(request, rid, 404, {"error": "range not held here"})
            shelf.touch(name)  # pruning spares a checkpoint being fetched
            try:
                mac = await asyncio.to_thread(file_mac, auth, request.method, request.path,
                                              rid, 206, fd, first, last - first + 1)
            except (OSError, ValueError) as exc:
                return signed_json(request, rid, 500, {"error": f"cannot read: {exc}"})
            headers = {**base, **mac, "Content-Range": f"bytes {first}-{last}/{size}"}
            return await send_file(request, 206, headers, fd, first, last - first + 1,
                                   bucket, serving.on_served)
        finally:
            os.close(fd)

    app.router.add_get("/v1/checkpoint", latest, allow_head=False)
    app.router.add_get("/v1/checkpoint/{id}", one, allow_head=False)
    app.router.add_get("/v1/checkpoint/{id}/{file}", serve_file, allow_head=False)
