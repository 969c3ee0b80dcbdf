"""Reaching a swarm from a command that is not (yet) one of its nodes: the addresses to ask
(seeds, else mDNS), a throwaway request signer, and one status document."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time

import aiohttp

from p2ptrain.errors import UserError
from p2ptrain.swarm import Swarm


def throwaway_signer(swarm: Swarm):
    from p2ptrain.net.auth import Signer, derive_mac_key
    from p2ptrain.net.session import Life

    return Signer(derive_mac_key(swarm.key), Life.throwaway(0))


async def candidates(swarm: Swarm, peers: list[str], timeout: float, rounds: bool = False,
                     mdns: bool = True):
    """Addresses to ask, as they become known: the given peers (again every second until the
    timeout when `rounds`, as they may still be starting), else what mDNS finds."""
    from p2ptrain.net.discovery import Discovery, resolve_seeds

    deadline = time.monotonic() + timeout
    if peers:
        said: set[str] = set()
        while True:
            resolved, failed = await resolve_seeds(peers, 7100)
            for problem in set(failed) - said:
                said.add(problem)
                print(f"p2ptrain: warning: peer {problem}", file=sys.stderr)
            for addr in resolved:
                yield addr
            if not rounds or time.monotonic() >= deadline:
                return
            await asyncio.sleep(1.0)
    if not mdns:
        return
    queue: asyncio.Queue[str] = asyncio.Queue()
    discovery = Discovery(swarm_id=swarm.swarm_id, node_id=secrets.token_hex(16), port=1,
                          addresses=None, device_class="tool", advertise=False,
                          on_found=lambda addr, _node: queue.put_nowait(addr))
    try:
        await discovery.start()
        while (left := deadline - time.monotonic()) > 0:
            try:
                yield await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                return
    finally:
        await discovery.close()


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        if resp.status != 200:
            raise UserError(f"{url}: HTTP {resp.status}")
        try:
            doc = await resp.json(content_type=None)
        except ValueError:  # not JSON (/v1/status needs no key: anything may answer)
            raise UserError(f"{url}: not a status document (not JSON)") from None
        if not isinstance(doc, dict):
            raise UserError(f"{url}: not a status document")
        return doc
