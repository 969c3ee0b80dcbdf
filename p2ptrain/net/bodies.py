"""Reading request bodies that are not authenticated yet (their MAC covers the whole body, so
it is known only at the end): the memory they may hold, how slowly they may arrive.

Each lane (bulk, control) has a byte budget for the bodies being read. A body takes budget
as its bytes arrive; it waits (reading stops, TCP pushes back on its sender) while
- the lane's budget is spent, or
- the lane is more than `SHARE` full and its sender's address already holds `SHARE` of it
  (machines behind one NAT share an address: below that, nobody is held to a share),
unless it holds the most bytes of the lane's bodies (the oldest of equals), which always goes
on: a body larger than the budget still comes in, and bodies that need each other's room do
not hold each other. A body that waits more than `wait` seconds (the server gives three body
graces) for room is refused (503) and releases what it held.

A body must arrive at `min_body_rate` after `body_grace` seconds, and may never fall silent
for longer than `body_grace` while we wait for it: bytes sent ahead of that rate buy no more
than `body_grace` of silence later. (They bought it all: a stranger sending 72 MiB fast and
then nothing held the bulk lane's budget -- every other node's averaging and pushes -- for
~2.5 hours. One that keeps the minimum rate after its burst still holds it while the rest of
its body trickles in: at most the body's limit over that rate.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from itertools import count as counter
from typing import Any

from aiohttp import web

from p2ptrain.net.auth import Pending

SHARE = 0.5  # of a lane's budget one address may hold while other bodies are read


class BodyError(Exception):
    """A request body was refused while it was read: (HTTP status, reason)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class BodyBudget:
    """Bytes of request bodies held in memory by one lane (see the module docstring)."""

    def __init__(self, cap: int, wait: float):
        self.cap, self.used, self.wait = cap, 0, wait
        self.held: dict[int, int] = {}  # body number -> bytes it holds
        self.by_addr: Counter[str] = Counter()  # sender address -> bytes its bodies hold
        self._numbers = counter()
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def body(self, addr: str) -> AsyncIterator[Callable[[int], Any]]:
        """A body's account: `await take(n)` before holding n more bytes (BodyError 503
        after `wait` s without room); all released at the end of the block."""
        number = next(self._numbers)
        self.held[number] = 0
        share = int(self.cap * SHARE)

        def favoured() -> bool:  # the body holding most (the oldest of equals) goes on:
            most = max(self.held.values())  # bodies that need each other's room cannot
            return self.held[number] == most and number == min(  # hold each other
                k for k, v in self.held.items() if v == most)

        def room(n: int) -> bool:  # (an address's share counts once the lane is half full)
            return favoured() or (self.used + n <= self.cap and (
                self.by_addr[addr] + n <= share or self.used + n <= share))

        async def take(n: int) -> None:
            if not room(n):
                try:
                    async with self._cond:
                        await asyncio.wait_for(self._cond.wait_for(lambda: room(n)), self.wait)
                except TimeoutError:
                    raise BodyError(503, f"busy: request bodies fill this node's memory "
                                         f"budget for {self.wait:g}s; try again") from None
            self.used += n
            self.held[number] += n
            self.by_addr[addr] += n

        try:
            yield take
        finally:
            mine = self.held.pop(number)
            self.used -= mine
            self.by_addr[addr] -= mine
            if self.by_addr[addr] <= 0:
                del self.by_addr[addr]
            async with self._cond:
                self._cond.notify_all()


async def read_body(request: web.Request, limit: int, pending: Pending, take,
                    limits: Any) -> bytearray:
    """The whole body, MACed into `pending` as it arrives; BodyError when it exceeds `limit`,
    falls behind `limits.min_body_rate` or falls silent for `limits.body_grace` (time spent
    waiting for the budget is ours, not the sender's, and is not counted)."""
    loop = asyncio.get_running_loop()
    declared = request.content_length
    buf = bytearray()  # grown as bytes arrive (a pre-sized one is zero-filled: all resident)
    got, start = 0, loop.time()
    due = start + limits.body_grace  # the next bytes must arrive by then
    while True:
        left = due - loop.time()
        try:  # (bytes already buffered are taken even past the deadline: a busy event loop
            async with asyncio.timeout(max(left, 0.0)):  # of ours is not the sender's delay)
                piece = await request.content.readany()
        except TimeoutError:
            raise BodyError(408, f"request body too slow: {got} bytes in "
                                 f"{loop.time() - start:.1f}s") from None
        if not piece:
            break
        if got + len(piece) > limit:
            raise BodyError(413, f"body exceeds {limit} bytes on {request.path}")
        before = loop.time()
        await take(len(piece))
        pending.update(piece)
        buf += piece
        got += len(piece)
        after = loop.time()
        # the rate's schedule moves on by the piece (and by our own time: the wait for room,
        # the MAC), but never further than one grace past now: no credit for silence later
        due = min(due + (after - before) + len(piece) / limits.min_body_rate,
                  after + limits.body_grace)
    if declared is not None and got != declared:
        raise BodyError(400, f"body ended after {got} of {declared} bytes")
    return buf
