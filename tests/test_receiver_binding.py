"""A request is bound to the node it was meant for, in the life it was meant for.

Two real nodes of one swarm (processes on 127.0.0.1). The test, holding the swarm key,
captures a valid request for node A; B refuses it, and so does A after a restart (the replay
window was in memory, the incarnation was not). A peer of the previous protocol version is
refused with a message that says which versions meet.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import signal
import urllib.error
import urllib.request

import aiohttp
import pytest

from p2ptrain.net.auth import Receiver, Signer, derive_mac_key
from p2ptrain.net.hello import hello
from p2ptrain.net.session import Life
from p2ptrain.proto import PROTOCOL_VERSION
from tests.swarmlab import SwarmLab, free_ports, get_json, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def http(addr: str, path: str, headers: dict[str, str], data: bytes | None = None,
         method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{addr}{path}", data=data, headers=headers,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def reason(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("latin-1")


def capture(signer: Signer, addr: str, path: str) -> dict[str, str]:
    """The headers of a valid signed GET of `path` meant for the node at `addr` (learnt by
    hello, as every sender does)."""
    async def who() -> Receiver:
        async with aiohttp.ClientSession() as session:
            return await hello(session, f"http://{addr}", signer)

    _, headers = signer.sign_request("GET", path, to=asyncio.run(who()))
    return headers


def version_1_headers(key: bytes, sender: str, method: str, path: str, body: bytes = b""
                      ) -> dict[str, str]:
    """How a protocol-1 node signed a request (no receiver, no version header)."""
    h = hmac.new(key, b"p2ptrain/1 request\n", hashlib.sha256)
    for field in (method, path, sender, "1", "1"):
        h.update(len(field.encode()).to_bytes(4, "big") + field.encode())
    h.update(body)
    return {"X-P2P-Sender": sender, "X-P2P-Seq": "1.1", "X-P2P-MAC": h.hexdigest()}


def test_a_captured_request_is_refused_by_another_node_and_after_a_restart(tmp_path):
    with SwarmLab(tmp_path) as lab:
        pa, pb = free_ports(2)
        a = lab.start("a", pa, [])
        b = lab.start("b", pb, [])
        for node in (a, b):
            wait_for(f"{node.addr} to answer", lambda n=node: get_json(n.addr, "/v1/health"), 30)
        key = derive_mac_key(lab.swarm.key)
        signer = Signer(key, Life.throwaway(1))
        headers = capture(signer, a.addr, "/v1/config")
        status, body = http(a.addr, "/v1/config", headers)
        assert status == 200, (status, reason(body))  # the original, delivered once

        status, body = http(b.addr, "/v1/config", headers)  # the copy, to another node
        print(f"\nrequest for A replayed to B: {status} {reason(body)}")
        assert status == 401, (status, reason(body))
        assert "addressed to" in reason(body)

        lab.kill(a, signal.SIGTERM)
        assert a.popen.wait(30) == 0
        a2 = lab.start("a", pa, [], state=a.state_dir)
        wait_for("A to answer again", lambda: get_json(a2.addr, "/v1/health"), 30)
        status, body = http(a2.addr, "/v1/config", headers)  # the copy, to A's next life
        print(f"request for A replayed to A after a restart: {status} {reason(body)}")
        assert status == 401, (status, reason(body))
        assert "incarnation" in reason(body)

        # a node of the previous protocol: refused, and told why
        old = version_1_headers(key, secrets.token_hex(16), "GET", "/v1/config")
        status, body = http(b.addr, "/v1/config", old)
        print(f"protocol-1 request: {status} {reason(body)}")
        assert status == 400, (status, reason(body))
        assert "protocol 1" in reason(body) and f"protocol {PROTOCOL_VERSION}" in reason(body)
        assert a2.alive() and b.alive()
