"""Outgoing protocol messages: each `Send` action becomes one authenticated POST on the
node's single client session; the frames in the response come back as received messages.

Fire and forget: a send never blocks the caller. A gradient push is dropped (and counted)
whole, every chunk of its vector, when too many bodies are already in flight to that peer --
back-pressure instead of a growing queue; averaging and control messages always go. Bodies
stream in slices through the upload token bucket. A failed request (refused connection,
timeout, non-2xx, a response whose MAC does not verify) is counted per address and otherwise
ignored: the protocol's own probes and timeouts decide what a silent peer means. Every
request names its receiver (auth.py): the outbox learns who is at an address by hello
(hello.py) before its first request there, and when a receiver refuses a request as not
meant for it (401: it restarted, or another node took the address), it says hello again and,
if someone else answers, sends the message once more. Control bodies use the upload cap's
control lane (pacing.py). Refusals of our MAC (HTTP 401 without a response MAC) go to a
`RefusalWatch` (refusals.py), which ends the node when every peer refuses its swarm key.
Every body this node sends is encoded here -- requests, and the reply frames the server puts
in its responses (`encode_replies`) -- and counted by kind as it goes over HTTP (sent.py). A
driver: it does I/O and never decides anything else.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp

from p2ptrain.net.auth import MAC, AuthError, Signer
from p2ptrain.net.hello import HelloError, HelloRefused, Receivers
from p2ptrain.net.pacing import TokenBucket, paced
from p2ptrain.net.refusals import RefusalWatch
from p2ptrain.net.routes import REPLY_LIMIT, read_limited, route_of
from p2ptrain.net.sent import SentByKind
from p2ptrain.proto import AverageRequest, RemoteProtocolError, Send, wire

if TYPE_CHECKING:
    from p2ptrain.proto import NodeConfig
    from p2ptrain.report import Reporter

BULK_ROUTES = ("/v1/gossip", "/v1/average", "/v1/track")
DROPPABLE = "/v1/gossip"  # gradient pushes: fire and forget, dropped when the peer lags
MAX_PUSH_PEERS = 4096  # addresses whose last push's fate is remembered (`_admit`)
MAX_FAILING = 4096  # addresses whose failures are remembered (made-up adverts add them)
WARNINGS_PER_MINUTE = 20  # send_failed lines (600 made-up adverts made 591 of them)
CONTROL_TIMEOUT = 10.0  # s for a control message round trip
BULK_TIMEOUT = 300.0  # s for a gradient push (slow uplinks)
CONNECT_TIMEOUT = 5.0  # s to open a connection



class WarnBudget:
    """At most `n` warnings per `window` seconds; the next one says how many were not."""

    def __init__(self, n: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.n, self.window, self.clock = n, window, clock
        self.start, self.said, self.held = clock(), 0, 0

    def allow(self) -> bool:
        now = self.clock()
        if now - self.start >= self.window:
            self.start, self.said = now, 0
        if self.said < self.n:
            self.said += 1
            return True
        self.held += 1
        return False

    def suppressed(self) -> str:
        held, self.held = self.held, 0
        return f" (and {held} failed requests not shown)" if held else ""

class Refused(Exception):
    """A peer answered 401 without a MAC: it does not accept ours."""


class Outbox:
    """Posts messages for one node; `on_frames(addr, frames)` receives response frames."""

    @classmethod
    def open(cls, signer: Signer, bucket: TokenBucket,
             on_frames: Callable[[str, list[bytes]], None], reporter: Reporter,
             limits: NodeConfig, refused_seconds: float = 0.0,
             stop: Callable[[str, int], None] | None = None) -> Outbox:
        """An outbox with its own two connection pools (closed by `close`); when every peer
        refuses our key for `refused_seconds` (0: never), it calls `stop(reason, 2)`. Only
        the addresses in `box.seeds` and those that once answered us count (refusals.py)."""
        bulk, control = (aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=limit, limit_per_host=per_host), auto_decompress=False)
            for limit, per_host in ((64, 4), (256, 8)))
        box = cls(bulk, control, signer, bucket, on_frames, reporter, limits)

        def wrong_key(message: str) -> None:
            reporter.error(message, event="wrong_key")
            if stop is not None:
                stop("the swarm key is wrong: every peer refuses it", 2)

        box.refusals = RefusalWatch(refused_seconds, asyncio.get_running_loop().time,
                                    wrong_key, lambda text: reporter.warn(text,
                                                                          event="refused"),
                                    box.seeds.__contains__)
        return box

    def __init__(self, session: aiohttp.ClientSession, control_session: aiohttp.ClientSession,
                 signer: Signer, bucket: TokenBucket,
                 on_frames: Callable[[str, list[bytes]], None], reporter: Reporter,
                 limits: NodeConfig):
        # two connection pools: a peer that hangs on bulk transfers cannot starve the small
        # control messages (heartbeats, probes) to everyone else
        self.session, self.control_session = session, control_session
        self.signer, self.bucket = signer, bucket
        self.on_frames, self.reporter = on_frames, reporter
        # gradient pushes in flight to one peer, at most; an averaging request's time limit
        # (shorter than the node's give-up, so a reply never lands after it)
        self.bulk_in_flight = limits.bulk_in_flight
        self.average_timeout = limits.average_request_timeout
        self.in_flight: Counter[str] = Counter()  # bulk requests per address
        self.pushing: dict[str, tuple[int, bool]] = {}  # addr -> (step, sent?) of its last push
        self.failures: Counter[str] = Counter()  # failed requests per address
        self.stats: Counter[str] = Counter()
        self.sent = SentByKind()  # bodies that went over HTTP, by message kind
        self.tasks: set[asyncio.Task] = set()
        self.last_error: dict[str, str] = {}
        self.warned = WarnBudget(WARNINGS_PER_MINUTE, 60.0)  # send_failed lines, at most
        self.receivers = Receivers(lambda: self.control_session, lambda: self.signer)
        self.refusals: RefusalWatch | None = None  # see `open`
        self.seeds: set[str] = set()  # seeds' addresses: their refusals judge our key
        # (peer, seed, part, timed out): an averaging request's POST is over, its response's
        # frames handled -- if the exchange still waits on that part, no reply will come
        self.on_unanswered: Callable[[str, int, int, bool], None] | None = None

    def send(self, action: Send) -> None:
        """Start posting `action.envelope` to `action.addr` (returns at once)."""
        route = route_of(action.envelope.body)
        bulk = route in BULK_ROUTES
        if route == DROPPABLE and not self._admit(action.addr, action.envelope.body.step):
            return  # the averaging exchange never is dropped
        body = action.envelope.body
        ask = (action.to, body.seed, body.part) if type(body) is AverageRequest else None
        try:
            data = wire.encode(action.envelope)
        except ValueError as exc:  # too large for the wire: say so once, drop it
            self._failed(action.addr, route, exc)
            asyncio.get_running_loop().call_soon(self._over, ask, False)  # not from within
            return
        if bulk:
            self.in_flight[action.addr] += 1
        task = asyncio.get_running_loop().create_task(self._post(action.addr, route, data, bulk,
                                                                 ask))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _admit(self, addr: str, step: int) -> bool:
        """Whether a gradient push's chunk to `addr` goes out. A vector goes whole or not at
        all (a part of one is useless to the receiver): its first chunk decides, by the bodies
        still in flight to that peer, and its other chunks follow that decision."""
        decided = self.pushing.get(addr)
        if decided is None or decided[0] != step:
            if len(self.pushing) >= MAX_PUSH_PEERS and addr not in self.pushing:
                self.pushing.clear()  # addresses come and go: forget the decided ones
            decided = self.pushing[addr] = (step, self.in_flight[addr] < self.bulk_in_flight)
            if not decided[1]:
                self.stats["gradients_dropped_busy_peer"] += 1
        return decided[1]

    def encode_replies(self, replies: list[Send]) -> list[bytes]:
        """The frames of the replies a response carries (counted as sent)."""
        frames = [wire.encode(send.envelope) for send in replies]
        for frame in frames:
            self.sent.add(frame)
        return frames

    async def _post(self, addr: str, route: str, data: bytes, bulk: bool,
                    ask: tuple[str | None, int, int] | None = None) -> None:
        timed_out = False
        timeout = aiohttp.ClientTimeout(
            total=self.average_timeout if route == "/v1/average" else
            BULK_TIMEOUT if bulk else CONTROL_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
        session = self.session if bulk else self.control_session
        try:
            for attempt in range(2):
                to = await self.receivers.get(addr)
                rid, headers = self.signer.sign_request("POST", route, data, to=to)
                headers["Content-Type"] = "application/octet-stream"
                headers["Content-Length"] = str(len(data))
                body_iter = paced(data, self.bucket, control=not bulk)  # control: its own lane
                async with session.post(f"http://{addr}{route}", data=body_iter,
                                        headers=headers, timeout=timeout) as resp:
                    self.sent.add(data)  # answered: the body went over HTTP
                    body = await read_limited(resp.content, REPLY_LIMIT[route])
                    if body is None:
                        raise RemoteProtocolError("response body too large")
                    if resp.status == 401 and attempt == 0:
                        # not for this receiver (any more), or it forgot our hello? ask again
                        # who is there (a hello keeps our pair key there again), send once more
                        self.receivers.forget(addr, to)
                        await self.receivers.get(addr)
                        continue
                    if resp.status == 401 and MAC not in resp.headers:  # our key refused
                        raise Refused(_reason(body))
                    if resp.status >= 400 and MAC not in resp.headers:  # refused unread
                        raise RemoteProtocolError(f"refused (HTTP {resp.status}): "
                                                  f"{bytes(body[:300]).decode('latin-1')}")
                    self.signer.check_response("POST", route, rid, resp.status, resp.headers,
                                               body)
                    if resp.status not in (200, 409):
                        raise RemoteProtocolError(f"HTTP {resp.status}: {bytes(body[:200])!r}")
                    frames = [bytes(f) for f in wire.split(body)]
                break
            self.stats["sent"] += 1
            self.failures.pop(addr, None)
            self.last_error.pop(addr, None)
            if self.refusals is not None:
                self.refusals.accepted(addr)
            if frames:
                self.on_frames(addr, frames)
        except asyncio.CancelledError:
            raise
        except (Refused, HelloRefused) as exc:
            self.failures[addr] += 1
            self.stats["refused"] += 1
            if self.refusals is not None:
                self.refusals.refused(addr, str(exc))
        except (aiohttp.ClientError, TimeoutError, OSError, AuthError, HelloError,
                RemoteProtocolError) as exc:
            # (the request's time limit, not a connect timeout: an unreachable peer's
            # link is not slow)
            timed_out = isinstance(exc, TimeoutError) and not isinstance(
                exc, aiohttp.ServerTimeoutError)
            self._failed(addr, route, exc)
            if self.refusals is not None:
                self.refusals.failed(addr)
        finally:
            if bulk:
                self.in_flight[addr] -= 1
                if self.in_flight[addr] <= 0:
                    del self.in_flight[addr]
        self._over(ask, timed_out)

    def _over(self, ask: tuple[str | None, int, int] | None, timed_out: bool) -> None:
        """An averaging request (`ask`: peer, seed, part; None: another kind) is over."""
        if ask is not None and ask[0] and self.on_unanswered is not None:
            self.on_unanswered(ask[0], ask[1], ask[2], timed_out)

    def _failed(self, addr: str, route: str, exc: BaseException) -> None:
        self.failures[addr] += 1
        self.stats["failed"] += 1
        reason = str(exc) or type(exc).__name__
        if self.last_error.get(addr) != reason:  # say each new kind of failure once
            self.last_error[addr] = reason
            if len(self.last_error) > MAX_FAILING:  # addresses come from anyone's adverts:
                for old in list(self.last_error)[: MAX_FAILING // 2]:  # the oldest go
                    self.last_error.pop(old)
                    self.failures.pop(old, None)
            if self.warned.allow():
                self.reporter.warn(f"request to {addr}{route} failed: {reason}"
                                   + self.warned.suppressed(), event="send_failed",
                                   addr=addr, route=route, reason=reason)

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` s for the messages in flight (e.g. leave announcements)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    async def close(self) -> None:
        """Cancel what is in flight and close both connection pools."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()
        await self.control_session.close()


def _reason(body: bytes) -> str:
    """The refusal's reason as the peer put it (unauthenticated: short, printable only)."""
    try:
        text = str(json.loads(body).get("error", ""))
    except (ValueError, AttributeError):
        text = ""
    return "".join(c for c in text[:120] if c.isprintable()) or "unauthorized"
