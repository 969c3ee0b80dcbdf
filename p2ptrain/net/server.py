"""The node's HTTP API (aiohttp): protocol messages in, replies out, and the read-only routes.

    GET  /v1/health    open: 200 while the process and its protocol loop run
    GET  /v1/status    open: the node's status document (JSON)
    GET  /metrics      open: Prometheus text
    GET  /v1/history   open: the node's recent past for the dashboard (history.py; JSON)
    GET  /             open: the dashboard page (dashboard.py), which polls the two above
    GET  /v1/hello     swarm key: who this node is (id, incarnation, version, card) and the
                       asker's pair key, see hello.py and session.py
    GET  /v1/config    MAC: the swarm-wide configuration (for a node joining with a token)
    POST /v1/control   MAC: probes, acks, leases, claims, leave (small control messages)
    POST /v1/members   MAC: full member-list exchange
    POST /v1/gossip    MAC: one gradient chunk message
    POST /v1/average   MAC: push-pull averaging; the response carries the peer's snapshot
    GET  /v1/checkpoint[/{id}/{file}]  MAC: see ckptserve.py

A message POST is checked in this order, and processed only if all pass: declared size
against the route's limit (413, nothing read); the authentication headers, before any body
byte is read -- protocol version (400, naming both versions), shape, that the request names
this node and this incarnation as its receiver, that its sender said hello to this life of
the node in the incarnation it names, that its (incarnation, sequence) is not already seen
(401); then the body is read with a deadline (408: it must keep `min_body_rate` after
`body_grace` seconds), up to the limit (413), into memory counted against a byte budget
per lane (bulk, control), while its MAC is computed as it streams; at the end the MAC and
replay window (401), frame type allowed on this route (400), strict decode (400), the
message's sender equals the authenticated sender (400). The runtime then handles it; replies
addressed to the sender travel in the response (the only way to reach an outbound-only
peer), as a concatenation of frames with a response MAC; a message the protocol refused gets
400 (or 409 for a configuration mismatch) with the reason. Open routes take no input and
never reveal the key or weights; `net.open_routes = false` puts them (not health) behind the MAC.

Connections are counted and timed out by gate.py (caps per IP and in total, header and idle
timeouts). A byte budget per lane bounds the memory held by request bodies that are not
verified yet (bodies.py: each address's share of it, how long a body may wait for room or
fall silent).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from p2ptrain.errors import UserError
from p2ptrain.net import baseserve, ckptserve, dashboard, metrics
from p2ptrain.net.auth import AuthError, Pending, ServerAuth, VersionError
from p2ptrain.net.bodies import BodyBudget, BodyError, read_body
from p2ptrain.net.gate import (
    GATE,
    ConnLimits,
    GatedSite,
    OpenRate,
    quiet_logs,
    track_requests,
)
from p2ptrain.net.hello import add_hello_route
from p2ptrain.net.neterrors import listen_error
from p2ptrain.net.pacing import TokenBucket, paced
from p2ptrain.net.routes import MAX_REPLY, ROUTES, MiB
from p2ptrain.net.shelf import Shelf
from p2ptrain.proto import RemoteProtocolError, wire

BULK_PATHS = ("/v1/gossip", "/v1/average", "/v1/track")
CONTROL_BODY_MEMORY = 16 * MiB  # bytes of control-lane bodies held at once (see the docstring)
# hellos per address (a second, burst): a hello costs a signature check and a key agreement
# (~0.2 ms); members say one per peer and again after a refusal, a NATed site's all at once
HELLO_RATE, HELLO_BURST = 20.0, 100.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts of its peers (net.* options; the defaults are the options')."""

    conns: ConnLimits = field(default_factory=ConnLimits)
    body_grace: float = 10.0  # s of slack before a body must keep min_body_rate
    min_body_rate: float = 8 * 1024  # bytes/s a request body must average after its grace
    body_memory: int = 64 * MiB  # bytes of bulk request bodies held in memory at once

    @classmethod
    def of(cls, net: Any) -> Limits:
        """From a settings.NetConfig."""
        return cls(ConnLimits(net.max_connections, net.max_connections_per_ip,
                              net.header_timeout, net.idle_timeout),
                   net.body_grace, net.min_body_rate_kib * 1024,
                   int(net.body_memory_mib * MiB))


class Host(Protocol):
    """What the server needs of the node it serves (the runtime implements it)."""

    node_id: str

    def count(self, what: str, n: int = 1) -> None:
        """Count `n` events (refused requests, bytes served) in the node's statistics."""

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
    """Everything the routes use: the node, its authenticator, its upload cap, its limits."""

    host: Host
    auth: ServerAuth
    bucket: TokenBucket  # every body the server sends counts against the upload cap
    open_routes: bool  # /v1/status, /v1/history, /metrics and / without a MAC
    limits: Limits = field(default_factory=Limits)
    history: Callable[[], dict[str, Any]] | None = None  # GET /v1/history's document (or 404)


SERVED: web.AppKey[Served] = web.AppKey("served")
METRICS: web.AppKey[CollectorRegistry] = web.AppKey("metrics")
BUDGETS: web.AppKey[dict[bool, BodyBudget]] = web.AppKey("budgets")
OPEN_RATE: web.AppKey[OpenRate] = web.AppKey("open_rate")
HISTORY: web.AppKey[dashboard.Built | None] = web.AppKey("history")


def _error(status: int, reason: str, headers: dict[str, str] | None = None,
           close: bool = False) -> web.Response:
    response = web.json_response({"error": reason}, status=status, headers=headers)
    if close:  # the rest of the body is not worth draining
        response.force_close()
    return response


def _refusal(srv: Served, exc: AuthError) -> web.Response:
    """400 for another protocol version, 401 for credentials that do not hold; counted."""
    if isinstance(exc, VersionError):
        srv.host.count("refused_version")
        return _error(400, exc.reason)
    srv.host.count("refused_auth")
    return _error(401, exc.reason)


def _begin(srv: Served, request: web.Request) -> Pending | web.Response:
    """The request's pending authentication, or the refusal (nothing of the body read)."""
    try:
        return srv.auth.begin(request.method, request.path, request.headers)
    except (VersionError, AuthError) as exc:
        return _refusal(srv, exc)


async def _message(request: web.Request) -> web.StreamResponse:
    srv = request.app[SERVED]
    path = request.path
    classes, limit = ROUTES[path]
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"body of {request.content_length} bytes exceeds {limit} on {path}",
                      close=True)
    pending = _begin(srv, request)  # no good credentials: refused before the body is read
    if isinstance(pending, web.Response):
        return pending
    control = path not in BULK_PATHS
    async with request.app[BUDGETS][control].body(request.remote or "") as take:
        try:
            body = await read_body(request, limit, pending, take, srv.limits)
        except BodyError as exc:
            srv.host.count("refused_body")
            return _error(exc.status, exc.reason, close=True)
        try:
            rid = pending.finish()
        except AuthError as exc:
            srv.host.count("refused_auth")
            return _error(401, exc.reason)
        return await _handle(request, srv, rid, body, classes, control)


async def _handle(request: web.Request, srv: Served, rid, body: bytearray, classes: tuple,
                  control: bool) -> web.StreamResponse:
    path = request.path

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
    if len(payload) <= MiB:  # answers to control messages never queue behind bulk bytes
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
    except (VersionError, AuthError) as exc:
        return _refusal(srv, exc)
    payload = json.dumps(srv.host.swarm_config()).encode()
    await srv.bucket.take(len(payload), True)
    return web.Response(body=payload, content_type="application/json",
                        headers=srv.auth.sign(request.method, request.path, rid, 200, payload))


def _open(handler):
    """An open read-only route, unless the configuration closes them (then MAC)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        srv = request.app[SERVED]
        if not request.app[OPEN_RATE].allow(request.remote or ""):
            srv.host.count("refused_rate")
            return _error(429, "too many requests to the open routes", {"Retry-After": "1"})
        if not srv.open_routes:
            try:
                srv.auth.verify(request.method, request.path, request.headers, b"")
            except VersionError as exc:
                return _error(400, exc.reason)
            except AuthError as exc:
                srv.host.count("refused_auth")
                return _error(401, exc.reason)
        return await handler(request)

    return wrapped


async def _health(request: web.Request) -> web.Response:
    srv = request.app[SERVED]
    return web.json_response(srv.host.health(), dumps=dashboard.dumps)


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVED].host.status(), dumps=dashboard.dumps)


async def _history(request: web.Request) -> web.Response:
    built = request.app[HISTORY]
    if built is None:
        return _error(404, "this node keeps no history")
    plain, packed = built.get(asyncio.get_running_loop().time())
    if dashboard.accepts_gzip(request.headers.get("Accept-Encoding", "")):
        return web.Response(body=packed, content_type="application/json", headers={
            "Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return web.Response(body=plain, content_type="application/json",
                        headers={"Vary": "Accept-Encoding"})


async def _metrics(request: web.Request) -> web.Response:
    body = metrics.render(request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})


async def _index(request: web.Request) -> web.Response:
    return web.Response(text=dashboard.PAGE, content_type="text/html", charset="utf-8")


def bases_of(model: Any) -> dict[str, Path]:
    """The base a LoRA model trains on (checked chunk by chunk when the node started), by id:
    what the node serves to joiners without it."""
    if getattr(model, "mode", "full") != "lora":
        return {}
    return {model.base_id: Path(model.base.path).parent}


def build_app(served: Served, shelf: Shelf, bases: dict[str, Path] | None = None
              ) -> web.Application:
    """The application of one node (its driver owns the lifecycle)."""
    app = web.Application(client_max_size=MAX_REPLY, middlewares=[track_requests])
    app[SERVED] = served
    app[METRICS] = metrics.registry_for(served.host.status)
    wait = 3 * served.limits.body_grace  # a body waits at most this for room, then 503
    app[BUDGETS] = {False: BodyBudget(served.limits.body_memory, wait),
                    True: BodyBudget(CONTROL_BODY_MEMORY, wait)}
    app[GATE] = []
    app[OPEN_RATE] = OpenRate()
    app[HISTORY] = dashboard.Built(served.history) if served.history is not None else None
    for route in ROUTES:
        app.router.add_post(route, _message)
    app.router.add_get("/v1/config", _config)
    app.router.add_get("/v1/health", _health)  # always open: Docker's HEALTHCHECK
    app.router.add_get("/v1/status", _open(_status))
    app.router.add_get("/v1/history", _open(_history))
    app.router.add_get("/metrics", _open(_metrics))
    app.router.add_get("/", _open(_index))
    host = served.host
    hellos = OpenRate(HELLO_RATE, HELLO_BURST)  # per address; this machine's not counted
    add_hello_route(app, served.auth, on_refused=lambda: host.count("refused_auth"),
                    allow=hellos.allow)
    ckptserve.add_checkpoint_routes(app, ckptserve.Serving(
        shelf, served.auth, served.bucket, on_refused=lambda: host.count("refused_auth"),
        on_served=lambda n: host.count("served_bytes", n)))
    baseserve.add_base_routes(app, baseserve.BaseServing(
        served.auth, lambda: bases or {}, served.bucket,
        on_refused=lambda: host.count("refused_auth"),
        on_served=lambda n: host.count("served_bytes", n)))
    return app


async def listen(runner: web.AppRunner, bind: str, port: int) -> int:
    """Serve on bind:port (0: any free port) behind the connection gate; the port bound. A
    busy or bad address is a UserError saying what to do. Rate-limits asyncio's logs too."""
    app = runner.app
    served = app[SERVED]
    quiet_logs()
    site = GatedSite(runner, bind, port, served.limits.conns, served.host.count)
    try:
        await site.start()
    except OSError as exc:
        raise UserError(listen_error(exc, bind, port)) from None
    assert site.gate is not None
    app[GATE].append(site.gate)
    return runner.addresses[0][1]
