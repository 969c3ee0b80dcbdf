"""The server's door: how many connections it keeps, for how long, and what it logs.

A `GatedSite` listens like aiohttp's TCPSite, but every accepted connection passes a `Gate`
first: a thin protocol wrapped around aiohttp's request handler that counts connections per
peer IP and in total, and times out connections that do not use their slot:

- caps: at most `per_ip` connections from one IP and `total` in all (also at most half the
  process's open-file limit, so a flood of connections can never make the node run out of
  descriptors for its own files, checkpoints and outgoing requests). At a cap, a new
  connection evicts the oldest *idle* connection of the same IP (or, at the total cap, of
  the IP holding most): first one that has not sent a complete request head yet, then a
  kept-alive one between requests. Connections inside a request are never evicted; if none
  is idle, the new connection is closed at once. So idle connections cannot keep a real
  peer out: it takes the slot of one of them, whoever opened it.
- timeouts: a connection must complete a request head within `header_timeout` of opening
  (or of the first byte of its next request), and a kept-alive connection is closed after
  `idle_timeout` without a request. Request bodies have their own deadline (server.py). A
  closed connection has CLOSE_GRACE seconds to flush its last answers, then is aborted: a
  peer that pipelines requests and never reads the answers would otherwise keep the socket
  open, no longer counted.

Counting at the protocol (not in a middleware) means a connection is counted from accept to
close, whatever it sends; a middleware of the app marks when a request is being handled.

`quiet_logs()` rate-limits the records of asyncio's and aiohttp's loggers (accept errors,
connection resets, handler errors): the first of each kind is logged, the next ones at most
once per LOG_EVERY seconds, with the count of those left out. A flood of bad connections must
not fill the disk with tracebacks.

A driver: it owns sockets and reads the loop's clock.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import defaultdict
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_runner import BaseSite

BACKLOG = 128  # listen() backlog
LOG_EVERY = 30.0  # s between two log records of one kind, at most
CLOSE_GRACE = 5.0  # s a closed connection may take to flush its last answers


@dataclass(frozen=True, slots=True)
class ConnLimits:
    total: int = 512
    per_ip: int = 64
    header_timeout: float = 10.0
    idle_timeout: float = 60.0


def fd_cap(total: int) -> int:
    """`total`, lowered to half the soft open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return total
    return max(8, min(total, soft // 2))


class _Conn(asyncio.Protocol):
    """One accepted connection: counted by the gate, then handed to aiohttp's handler."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.ip = ""
        self.opened = 0.0
        self.busy = 0  # requests being handled
        self.served = 0  # requests handled
        self.head_started: float | None = None  # bytes of a next request arrived
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if peer else "?"
        self.opened = self.gate.loop.time()
        if not self.gate.admit(self):
            self.closed = True
            transport.abort()
            return
        self.inner = self.gate.factory()
        self.inner.connection_made(transport)
        self._arm(self.opened + self.gate.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self.busy and self.head_started is None and self.served:
            self.head_started = self.gate.loop.time()
            self._arm(self.head_started + self.gate.limits.header_timeout)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.gate.release(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # -- state ----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.busy

    def rank(self) -> tuple[int, float]:
        """Eviction order among idle connections: never used first, then oldest."""
        return (1 if self.served else 0, self.opened)

    def request_started(self) -> None:
        self.busy += 1
        self.head_started = None
        self._disarm()

    def request_done(self) -> None:
        self.busy -= 1
        self.served += 1
        if not self.busy and not self.closed:
            self._arm(self.gate.loop.time() + self.gate.limits.idle_timeout)

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.gate.count(why)
        self.gate.release(self)
        if self.transport is not None:
            self.transport.close()  # flushes what is queued, then closes ...
            # ... unless the peer never reads: then the socket (and its send queue) would
            # stay open, uncounted; a client pipelining requests it never reads could open
            # such sockets until the process ran out of descriptors (review)
            self.gate.loop.call_later(CLOSE_GRACE, self.transport.abort)

    def _arm(self, when: float) -> None:
        self._disarm()
        self._timer = self.gate.loop.call_at(when, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.busy:
            return
        self.close("conn_header_timeout" if not self.served or self.head_started is not None
                   else "conn_idle_closed")


class Gate:
    """Counts the connections of one listening socket and enforces `ConnLimits`."""

    def __init__(self, factory, limits: ConnLimits, count=None):
        self.factory, self.limits = factory, limits
        self.total = fd_cap(limits.total)
        self.per_ip = min(limits.per_ip, self.total)
        self.by_ip: dict[str, set[_Conn]] = defaultdict(set)
        self.open = 0
        self.by_transport: dict[asyncio.BaseTransport, _Conn] = {}
        self._count = count
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> _Conn:
        return _Conn(self)

    def count(self, what: str) -> None:
        if self._count is not None:
            self._count(what)

    def admit(self, conn: _Conn) -> bool:
        mine = self.by_ip[conn.ip]
        if len(mine) >= self.per_ip:
            pool = mine
        elif self.open >= self.total:
            pool = {c for conns in self.by_ip.values() for c in conns}
        else:
            pool = None
        if pool is not None:
            idle = [c for c in pool if c.idle]
            if not idle:
                if not mine:
                    del self.by_ip[conn.ip]
                self.count("conn_refused")
                return False
            sizes = {ip: len(conns) for ip, conns in self.by_ip.items()}
            victim = min(idle, key=lambda c: (c.rank()[0], -sizes.get(c.ip, 0), c.rank()[1]))
            victim.close("conn_evicted")
        self.by_ip[conn.ip].add(conn)
        self.by_transport[conn.transport] = conn
        self.open += 1
        return True

    def release(self, conn: _Conn) -> None:
        if self.by_transport.pop(conn.transport, None) is None:
            return
        mine = self.by_ip.get(conn.ip)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self.by_ip[conn.ip]
        self.open -= 1

    def of(self, request: web.BaseRequest) -> _Conn | None:
        return self.by_transport.get(request.transport)


GATE: web.AppKey[list] = web.AppKey("gate")  # [Gate] once listening


@web.middleware
async def track_requests(request: web.Request, handler):
    """Marks the request's connection busy while it is handled (never evicted then)."""
    gates = request.app.get(GATE) or []
    conn = gates[0].of(request) if gates else None
    if conn is not None:
        conn.request_started()
    try:
        return await handler(request)
    finally:
        if conn is not None:
            conn.request_done()


class OpenRate:
    """Requests to the open read-only routes, per address: at most `rate` a second, in
    bursts of `burst` (a dashboard polls every few seconds; a flood of /v1/history took a
    node from 512 to 102 steps a second). This machine's own (loopback) requests are not
    counted. Bounded: the longest-idle addresses are forgotten."""

    def __init__(self, rate: float = 50.0, burst: float = 100.0, most: int = 4096,
                 clock=time.monotonic):
        self.rate, self.burst, self.most, self.clock = rate, burst, most, clock
        self.tokens: dict[str, tuple[float, float]] = {}  # addr -> (tokens, when)

    def allow(self, addr: str) -> bool:
        if addr.startswith("127.") or addr == "::1":
            return True
        now = self.clock()
        tokens, then = self.tokens.pop(addr, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if len(self.tokens) >= self.most:  # oldest first (re-inserted on use)
            del self.tokens[next(iter(self.tokens))]
        self.tokens[addr] = (tokens - 1.0 if tokens >= 1.0 else tokens, now)
        return tokens >= 1.0


class GatedSite(BaseSite):
    """A TCP site whose connections pass a `Gate`."""

    __slots__ = ("_host", "_port", "_limits", "_count", "gate")

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: ConnLimits,
                 count=None):
        super().__init__(runner, backlog=BACKLOG)
        self._host, self._port, self._limits, self._count = host, port, limits, count
        self.gate: Gate | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self.gate = Gate(server, self._limits, self._count)
        self._server = await loop.create_server(self.gate, self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)


class _RateLimit(logging.Filter):
    """Lets the first record of each kind through, then one per LOG_EVERY seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[tuple[str, str], float] = {}
        self.dropped: dict[tuple[str, str], int] = defaultdict(int)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:80])
        now = time.monotonic()
        last = self.last.get(key)
        if last is not None and now - last < LOG_EVERY:
            self.dropped[key] += 1
            return False
        if len(self.last) > 1024:
            self.last.clear()
        self.last[key] = now
        dropped = self.dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} [{dropped} more like this in the last {LOG_EVERY:g}s]"
        return True


_LIMITED = ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal")


def quiet_logs() -> None:
    """Rate-limit asyncio's and aiohttp's log records (idempotent)."""
    for name in _LIMITED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RateLimit) for f in logger.filters):
            logger.addFilter(_RateLimit())
