"""The hello exchange: how a sender learns the id and incarnation of the node at an address
before its first request (every request names its receiver, see auth.py).

    GET /v1/hello   headers X-P2P-Version, X-P2P-Sender, X-P2P-Nonce (32 random hex chosen by
                    the asker), X-P2P-Card (the asker's card: session.py) and X-P2P-MAC with
                    the swarm key over (sender, nonce, card). Answer 200 with {"node_id",
                    "incarnation", "version", "card"} and a MAC with the two lives' pair key
                    over (nonce, asker, body).

Only a holder of the swarm key can ask (401 otherwise, which tells a token-only joiner that
its token is wrong); only the node whose id the answer names can make it (the pair key needs
its card's private half), and a fresh nonce per hello means an old answer -- an earlier life
of the node -- cannot be played back. The answer keeps the asker's life and pair key on the
node; a replayed hello request re-derives the same key, and one of an older life than the
node has seen is refused, so hellos are not in the replay window. A node of protocol 1 has no
such route: its 404 is reported as "an older p2ptrain".

During a key rotation (keyring.py) a hello is made with the current key and, if the node
refuses it (401) while the previous key's grace lasts, once more with the previous key: a
member that does not hold the new key yet still answers, and the pair key made then derives
from the previous key (auth.Signer). The node asked answers with the key the hello came in
with.

Who says hello: the outbox, once per address (`Receivers`), and again before sending once
more when a receiver refuses a request (401: meant for another node or life, or a sender
the node has forgotten or never heard say hello); the token-only configuration fetch and
`checkpoint fetch` before their first GET. Seeds (`--peer HOST:PORT`, DNS names), mDNS finds
and member addresses are all handled alike: an address is all a sender needs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable

import aiohttp
from aiohttp import web

from p2ptrain.net.auth import AuthError, HelloBusy, Receiver, ServerAuth, Signer, VersionError
from p2ptrain.net.neterrors import explain
from p2ptrain.proto import PROTOCOL_VERSION

HELLO = "/v1/hello"
MAX_ANSWER = 4096  # bytes of a hello answer read, at most
HELLO_TIMEOUT = 10.0  # s for one hello round trip


class HelloError(Exception):
    """The node at an address could not be identified; the message says why."""


class HelloLater(HelloError):
    """The node asks us to say hello again later (HTTP 429: too many hellos from our address)."""


class HelloRefused(HelloError):
    """The node refused our credentials (HTTP 401): it does not accept our swarm key."""


async def hello(session: aiohttp.ClientSession, base: str, signer: Signer,
                timeout: float = HELLO_TIMEOUT) -> Receiver:
    """Ask the node at `base` (http://host:port) who it is; HelloError if it cannot say. Each
    key the signer may use is tried in turn while the node refuses the previous one (401)."""
    keys = signer.hello_keys()
    for i, key in enumerate(keys):
        try:
            receiver = await _hello(session, base, signer, key, timeout)
        except HelloRefused:
            if i + 1 == len(keys):
                raise
            continue
        return receiver
    raise AssertionError("a signer always has a key")


async def _hello(session: aiohttp.ClientSession, base: str, signer: Signer, key: bytes,
                 timeout: float) -> Receiver:
    """One hello made with `key`."""
    nonce = secrets.token_hex(16)
    try:
        async with session.get(f"{base}{HELLO}", headers=signer.hello_headers(nonce, key),
                               timeout=aiohttp.ClientTimeout(total=timeout),
                               allow_redirects=False) as resp:
            body = await resp.content.read(MAX_ANSWER + 1)
            status, headers = resp.status, resp.headers
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise HelloError(explain(exc, base.removeprefix("http://"))) from None
    if status == 429:
        raise HelloLater(f"{base} refused our hello for now (HTTP 429: {_reason(body)})")
    if status in (404, 405):
        raise HelloError(f"{base} does not answer {HELLO}: it runs an older p2ptrain (protocol "
                         f"1); this node speaks protocol {PROTOCOL_VERSION}")
    if status == 401:
        reason = _reason(body)
        raise HelloRefused(f"{base} refused our authentication (HTTP 401: {reason})"
                           f"{key_hint(reason)}")
    if status != 200 or len(body) > MAX_ANSWER:
        raise HelloError(f"{base} refused our hello (HTTP {status}: {_reason(body)})")
    try:
        version = json.loads(body)["version"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise HelloError(f"{base}: malformed hello answer") from None
    if version != PROTOCOL_VERSION:
        raise HelloError(f"{base} speaks protocol {version!r}, this node {PROTOCOL_VERSION}")
    try:
        return signer.check_welcome(nonce, headers, body, key)
    except AuthError as exc:
        raise HelloError(f"{base}: {exc.reason}") from None


def key_hint(reason: str) -> str:
    """What to add to a 401's `reason`: whether the swarm key is right -- unless the reason
    says already (ours say "wrong swarm key?"), or says why otherwise (an older life of this
    node, restored from a backup: refusals.py; a hello to say again)."""
    if any(why in reason for why in ("swarm key", "is older than", "say hello")):
        return ""
    return "; is this the right swarm key?"


def _reason(body: bytes) -> str:
    try:
        text = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return "no reason given"
    if not isinstance(text, str):
        return "no reason given"
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:200])


class Receivers:
    """Who is at each address, learnt by hello and kept until a request is refused as meant
    for another node or life. Concurrent senders to one address share one hello."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], signer: Callable[[], Signer]):
        self._session, self._signer = session, signer
        self.known: dict[str, Receiver] = {}
        self._asking: dict[str, asyncio.Future[Receiver]] = {}

    async def get(self, addr: str) -> Receiver:
        """The receiver at `addr` (host:port); HelloError if it cannot be learnt."""
        known = self.known.get(addr)
        if known is not None and self._signer().knows(known):
            return known
        asking = self._asking.get(addr)
        if asking is None:
            asking = asyncio.ensure_future(hello(self._session(), f"http://{addr}",
                                                 self._signer()))
            self._asking[addr] = asking
            asking.add_done_callback(lambda f: self._learnt(addr, f))
        return await asyncio.shield(asking)

    def _learnt(self, addr: str, fut: asyncio.Future[Receiver]) -> None:
        self._asking.pop(addr, None)
        if not fut.cancelled() and fut.exception() is None:
            self.known[addr] = fut.result()

    def forget(self, addr: str, receiver: Receiver) -> None:
        """`receiver` refused a request as not its own: ask again next time."""
        if self.known.get(addr) == receiver:
            del self.known[addr]


def add_hello_route(app: web.Application, auth: ServerAuth,
                    on_refused: Callable[[], None] | None = None,
                    allow: Callable[[str], bool] | None = None) -> None:
    """Register GET /v1/hello on `app`. `allow(address)` is asked before a card is checked (a
    signature check and a key agreement: the server limits them per address, server.py) --
    only for a hello whose swarm-key MAC verified and whose card is not among those checked
    lately, so neither a stranger nor a member replaying hellos spends an address's budget;
    refused, the hello is answered 429 (Retry-After: 1)."""

    async def welcome(request: web.Request) -> web.Response:
        remote = request.remote or ""
        try:
            body, headers = auth.welcome(request.headers, allow=lambda: allow is None or allow(
                remote))
        except HelloBusy as exc:
            return web.json_response({"error": exc.reason}, status=429,
                                     headers={"Retry-After": "1"})
        except VersionError as exc:
            return web.json_response({"error": exc.reason}, status=400)
        except AuthError as exc:
            if on_refused is not None:
                on_refused()
            return web.json_response({"error": exc.reason}, status=401)
        if request.body_exists:
            return web.json_response({"error": "a GET carries no body"}, status=400)
        return web.Response(body=body, content_type="application/json", headers=headers)

    app.router.add_get(HELLO, welcome, allow_head=False)
