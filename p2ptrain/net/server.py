"""The node's HTTP API (aiohttp): protocol messages in, replies out, and the read-only routes.

    GET  /v1/health    open: 200 while the process and its protocol loop run
    GET  /v1/status    open: the node's status document (JSON)
    GET  /metrics      open: Prometheus text
    GET  /             open: a dashboard page that polls /v1/status
    GET  /v1/config    MAC: the swarm-wide configuration (for a node joining with a token)
    POST /v1/control   MAC: probes, acks, leases, claims, leave (small control messages)
    POST /v1/members   MAC: full member-list exchange
    POST /v1/gossip    MAC: one gradient chunk message
    POST /v1/average   MAC: push-pull averaging; the response carries the peer's snapshot
    GET  /v1/checkpoint[/{id}/{file}]  MAC: see ckptserve.py

A message POST is checked in this order, and processed only if all pass: declared size
against the route's limit (413, nothing read), body read up to the limit (413), MAC and
replay (401), frame type allowed on this route (400), strict decode (400), the message's
sender equals the authenticated sender (400). The runtime then handles it; replies addressed
to the sender travel in the response (the only way to reach an outbound-only peer), as a
concatenation of frames with a response MAC; a message the protocol refused gets 400 (or 409
for a configuration mismatch) with the reason. Open routes take no input and never reveal
the key or weights; `net.open_routes = false` puts them behind the MAC too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from p2ptrain.errors import UserError
from p2ptrain.net import ckptserve, dashboard
from p2ptrain.net.auth import AuthError, ServerAuth, parse_request
from p2ptrain.net.pacing import TokenBucket, paced
from p2ptrain.net.routes import MAX_REPLY, ROUTES, MiB, read_limited
from p2ptrain.proto import RemoteProtocolError, wire


class Host(Protocol):
    """What the server needs of the node it serves (the runtime implements it)."""

    node_id: str

    def count(self, what: str) -> None:
        """Count one event (refused requests) in the node's statistics."""

    def deliver(self, envelope: Any, remote: str, sender: str, size: int
                ) -> tuple[int, list[bytes], str]:
        """Hand an authenticated message to the node: (HTTP status, reply frames, reason)."""

    def status(self) -> dict[str, Any]:
        """The /v1/status document."""

    def health(self) -> dict[str, Any]:
        """The /v1/health document."""

    def swarm_config(self) -> dict[str, Any]:
        """The /v1/config document: the swarm's name and its swarm-wide options."""


@dataclass(frozen=True)
class Served:
    """Everything the routes use: the node, its authenticator, its upload cap."""

    host: Host
    auth: ServerAuth
    bucket: TokenBucket  # every body the server sends counts against the upload cap
    open_routes: bool  # /v1/status, /metrics and / without a MAC


SERVED: web.AppKey[Served] = web.AppKey("served")
BULK_READS: web.AppKey[asyncio.Semaphore] = web.AppKey("bulk_reads")
MAX_BULK_READS = 4  # bulk request bodies being read at once
BULK_PATHS = ("/v1/gossip", "/v1/average")

def _error(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": reason}, status=status, headers=headers)


async def _message(request: web.Request) -> web.StreamResponse:
    srv = request.app[SERVED]
    path = request.path
    classes, limit = ROUTES[path]
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"body of {request.content_length} bytes exceeds {limit} on {path}")
    try:
        parse_request(request.headers)  # no credentials: refused before the body is read
    except AuthError as exc:
        srv.host.count("refused_auth")
        return _error(401, exc.reason)
    if limit > MiB:  # bulk bodies: a few at a time, so junk cannot fill the memory
        async with request.app[BULK_READS]:
            body = await read_limited(request.content, limit)
    else:
        body = await read_limited(request.content, limit)
    if body is None:
        return _error(413, f"body exceeds {limit} bytes on {path}")
    try:
        rid = srv.auth.verify(request.method, path, request.headers, body)
    except AuthError as exc:
        srv.host.count("refused_auth")
        return _error(401, exc.reason)

    def signed(status: int, payload: bytes) -> dict[str, str]:
        return srv.auth.sign(request.method, path, rid, status, payload)

    def refuse(status: int, reason: str) -> web.Response:
        payload = json.dumps({"error": reason}).encode()
        srv.host.count("refused_bad_input")
        return web.Response(status=status, body=payload, content_type="application/json",
                            headers=signed(status, payload))

    if wire.peek_type(body) not in classes:
        return refuse(400, f"{path} does not carry this message type")
    try:
        envelope = wire.decode(body)
    except RemoteProtocolError as exc:
        return refuse(400, str(exc))
    if envelope.header.sender != rid.sender:
        return refuse(400, "message sender differs from the authenticated sender")
    remote = f"{request.remote}"
    status, replies, reason = srv.host.deliver(envelope, remote, rid.sender, len(body))
    if status >= 400 and not replies:
        return refuse(status, reason)
    payload = b"".join(replies)
    headers = signed(status, payload)
    control = path not in BULK_PATHS  # answers to control messages never queue behind bulk
    if len(payload) <= MiB:
        await srv.bucket.take(len(payload), control)  # every body we send counts
        return web.Response(status=status, body=payload, headers=headers,
                            content_type="application/octet-stream")
    response = web.StreamResponse(status=status, headers=headers)
    response.content_type = "application/octet-stream"
    response.content_length = len(payload)
    await response.prepare(request)
    async for piece in paced(payload, srv.bucket, control):
        await response.write(piece)
    await response.write_eof()
    return response


async def _config(request: web.Request) -> web.Response:
    srv = request.app[SERVED]
    try:
        rid = srv.auth.verify(request.method, request.path, request.headers, b"")
    except AuthError as exc:
        srv.host.count("refused_auth")
        return _error(401, exc.reason)
    payload = json.dumps(srv.host.swarm_config()).encode()
    return web.Response(body=payload, content_type="application/json",
                        headers=srv.auth.sign(request.method, request.path, rid, 200, payload))


def _open(handler):
    """An open read-only route, unless the configuration closes them (then MAC)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        srv = request.app[SERVED]
        if not srv.open_routes:
            try:
                srv.auth.verify(request.method, request.path, request.headers, b"")
            except AuthError as exc:
                srv.host.count("refused_auth")
                return _error(401, exc.reason)
        return await handler(request)

    return wrapped


async def _health(request: web.Request) -> web.Response:
    srv = request.app[SERVED]
    return web.json_response(srv.host.health())


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVED].host.status())


async def _metrics(request: web.Request) -> web.Response:
    text = dashboard.metrics(request.app[SERVED].host.status())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _index(request: web.Request) -> web.Response:
    return web.Response(text=dashboard.PAGE, content_type="text/html", charset="utf-8")


def build_app(served: Served, checkpoint_root: Callable[[], Path]) -> web.Application:
    """The application of one node (its driver owns the lifecycle)."""
    app = web.Application(client_max_size=MAX_REPLY)
    app[SERVED] = served
    app[BULK_READS] = asyncio.Semaphore(MAX_BULK_READS)
    for route in ROUTES:
        app.router.add_post(route, _message)
    app.router.add_get("/v1/config", _config)
    app.router.add_get("/v1/health", _health)  # always open: Docker's HEALTHCHECK
    app.router.add_get("/v1/status", _open(_status))
    app.router.add_get("/metrics", _open(_metrics))
    app.router.add_get("/", _open(_index))
    host = served.host
    ckptserve.add_checkpoint_routes(app, checkpoint_root, served.auth, host.node_id,
                                    on_refused=lambda: host.count("refused_auth"))
    return app


async def listen(runner: web.AppRunner, bind: str, port: int) -> int:
    """Start serving on bind:port (0: any free port); the port bound. A busy or forbidden
    address is a UserError naming it."""
    site = web.TCPSite(runner, bind, port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        raise UserError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
    return runner.addresses[0][1]
