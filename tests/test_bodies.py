"""Request bodies read before their MAC (net/bodies.py): the lane's budget always lets the
body holding most go on (a review of session 27's first version found two honest 48 MiB
tracking parts refused with 503 after waiting on each other), one address is held to half a
lane only while it is more than half full, and our own time with a piece is not the sender's
silence."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from p2ptrain.net.bodies import BodyBudget, BodyError, read_body
from p2ptrain.net.server import Limits
from tests.test_ckptfetch import serving

MiB = 1 << 20


def _feed(budget: BodyBudget, bodies: list[tuple[str, int]], piece: int = 256 * 1024):
    """Each (address, size) body taken a piece at a time, all at once: its outcome."""
    async def one(addr: str, size: int) -> str:
        async with budget.body(addr) as take:
            try:
                for _ in range(size // piece):
                    await take(piece)
                    await asyncio.sleep(0.001)
            except BodyError as exc:
                return f"{exc.status}"
        return "ok"

    async def run():
        return await asyncio.gather(*(one(a, n) for a, n in bodies))

    return asyncio.run(run())


def test_bodies_that_need_each_others_room_all_come_in():
    for bodies in ([("A", 48 * MiB), ("B", 48 * MiB)],  # two tracking parts, two peers
                   [("A", 48 * MiB), ("A", 48 * MiB)],  # ... or one peer
                   [("A", 20 * MiB)] * 2 + [("B", 70 * MiB)],  # a body past the budget
                   [("N", 8 * MiB)] * 5):  # five machines behind one NAT
        assert _feed(BodyBudget(64 * MiB, wait=1.0), bodies) == ["ok"] * len(bodies), bodies


def test_past_half_a_lane_one_address_waits_and_gets_503():
    budget = BodyBudget(64 * MiB, wait=0.5)

    async def run():
        async with budget.body("S") as held:  # a stranger's body: the most, half the lane
            for _ in range(32):
                await held(MiB)
            async with budget.body("S") as more, budget.body("B") as other:
                await other(8 * MiB)  # another address: room in the other half
                try:
                    await more(MiB)  # the same address past its half while others read
                except BodyError as exc:
                    return exc.status
        return None

    assert asyncio.run(run()) == 503


def test_a_busy_event_loop_of_ours_is_not_the_senders_silence():
    """Our own time with a piece (its MAC; here a 1.5 s stall, past a 1 s grace) was counted
    as the sender's silence: the rest of a body sent at once was refused (408)."""
    limits = Limits(body_grace=1.0)

    class Pending:
        calls = 0

        def update(self, piece):
            self.calls += 1
            if self.calls == 1:
                time.sleep(1.5)  # our own loop busy mid-body (a big decode, a slow disk)

    async def handler(request):
        try:
            body = await read_body(request, 8 * MiB, Pending(), _no_wait, limits)
        except BodyError as exc:
            return web.Response(status=exc.status, text=exc.reason)
        return web.Response(text=str(len(body)))

    async def _no_wait(n):
        pass

    async def run():
        app = web.Application()
        app.router.add_post("/", handler)
        async with serving(app) as base, aiohttp.ClientSession() as session, \
                session.post(f"{base}/", data=bytes(MiB)) as r:
            return r.status, await r.text()

    assert asyncio.run(run()) == (200, str(MiB))
