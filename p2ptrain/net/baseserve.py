"""Serving the frozen base of a LoRA swarm: the MAC routes a joiner without it fetches from.

    GET /v1/base/{id}                    the base's manifest (base.json, as stored)
    GET /v1/base/{id}/base.safetensors   bytes of the base file; a Range is required

A node serves the base it trains on (checked chunk by chunk when it started) and nothing
else. The fetcher needs no signature: the id is the SHA-256 of the manifest, and every chunk
is checked against the manifest's xxh3_64 (net/basefetch.py). The rules of the checkpoint
routes hold here too (ckptserve.py): authentication first, every answer MACed over its exact
body (a range MACed over a mapping of the file, then streamed from it), ranges clamped to
MAX_RANGE, every body byte through the upload bucket and counted, `{id}` and the file name
checked before a path is built (anything else is 404).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from p2ptrain.net.auth import RequestId, ServerAuth
from p2ptrain.net.ckptserve import RangeError, authenticate_get, file_mac, parse_range, send_file
from p2ptrain.net.pacing import TokenBucket

BASE_FILE, MANIFEST = "base.safetensors", "base.json"
ID_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class BaseServing:
    auth: ServerAuth
    bases: Callable[[], dict[str, Path]]  # id -> directory of the bases served (checked ones)
    bucket: TokenBucket = field(default_factory=lambda: TokenBucket(0))
    on_refused: Callable[[], None] | None = None
    on_served: Callable[[int], None] | None = None


def add_base_routes(app: web.Application, serving: BaseServing) -> None:
    auth, bucket = serving.auth, serving.bucket

    def signed(request: web.Request, rid: RequestId, status: int, body: bytes,
               headers: dict[str, str] | None = None, kind: str = "application/json"
               ) -> web.Response:
        mac = auth.sign(request.method, request.path, rid, status, body)
        return web.Response(status=status, body=body, content_type=kind,
                            headers={**mac, **(headers or {})})

    def error(request: web.Request, rid: RequestId, status: int, text: str,
              headers: dict[str, str] | None = None) -> web.Response:
        return signed(request, rid, status, json.dumps({"error": text}).encode(), headers)

    def authenticate(request: web.Request) -> RequestId | web.Response:
        return authenticate_get(auth, request, serving.on_refused)

    def held(request: web.Request) -> Path | None:
        base_id = request.match_info["id"]
        return serving.bases().get(base_id) if ID_RE.fullmatch(base_id) else None

    async def manifest(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        where = held(request)
        if where is None:
            return error(request, rid, 404, "base not held here")
        try:
            body = await asyncio.to_thread((where / MANIFEST).read_bytes)
        except OSError:
            return error(request, rid, 404, "base is gone")
        return signed(request, rid, 200, body)

    async def data(request: web.Request) -> web.StreamResponse:
        rid = authenticate(request)
        if isinstance(rid, web.Response):
            return rid
        where = held(request)
        if where is None or request.match_info["file"] != BASE_FILE:
            return error(request, rid, 404, "no such base file here")
        range_header = request.headers.get("Range")
        if range_header is None:
            return error(request, rid, 416, "a base is served in ranges only")
        try:
            fd = os.open(where / BASE_FILE, os.O_RDONLY)
        except OSError:
            return error(request, rid, 404, "base is gone")
        try:
            size = os.fstat(fd).st_size
            try:
                first, last = parse_range(range_header, size)
            except RangeError as exc:
                return error(request, rid, 416, str(exc), {"Content-Range": f"bytes */{size}"})
            try:
                mac = await asyncio.to_thread(file_mac, auth, request.method, request.path,
                                              rid, 206, fd, first, last - first + 1)
            except (OSError, ValueError) as exc:
                return error(request, rid, 500, f"cannot read: {exc}")
            return await send_file(request, 206, {
                **mac, "Accept-Ranges": "bytes", "Content-Range": f"bytes {first}-{last}/{size}"},
                fd, first, last - first + 1, bucket, serving.on_served)
        finally:
            os.close(fd)

    app.router.add_get("/v1/base/{id}", manifest, allow_head=False)
    app.router.add_get("/v1/base/{id}/{file}", data, allow_head=False)
