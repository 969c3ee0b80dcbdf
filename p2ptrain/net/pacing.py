"""The upload cap: one token bucket over every body this node sends (requests and responses),
and the slicing of large bodies into ~1 MiB pieces.

Bodies go out as async iterators of slices (FIELD-NOTES: one huge write is quadratic on
Python 3.11); with a cap, each slice waits for its tokens first, so the node's total upload
rate stays at the cap however many transfers run at once. Slices shrink with the cap (a tenth
of a second's worth, at least 4 KiB), so the rate is smooth rather than bursty.

Two lanes share the one cap:

- bulk (gradient pushes, averaging snapshots, their responses): callers queue in order on one
  lock and each waits for its tokens;
- control (probes, acks, heartbeats, claims, member lists, hello, config: everything posted on
  /v1/control and /v1/members and the answers to them): never queues behind bulk bytes. A
  control body takes its bytes from a small allowance of its own (CONTROL_SHARE of the cap,
  at least CONTROL_BURST bytes of burst) and goes at once; the same bytes are taken from the
  shared bucket too, which may go into debt -- bulk slices then wait that much longer, so the
  total still averages to the cap (within one control burst). Only a flood of control
  traffic beyond its allowance waits, and then on its own allowance, not behind bulk.

A driver: it reads the event loop's clock and sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

SLICE = 1 << 20  # bytes per slice without a cap
MIN_SLICE = 4096
CONTROL_SHARE = 0.5  # of the cap: the control lane's own refill rate
CONTROL_BURST = 64 * 1024  # bytes the control lane may send at once (at least)


class TokenBucket:
    """`rate` bytes per second with a burst of `burst` bytes; `rate` 0 means no cap."""

    def __init__(self, rate_bytes: float, burst: float | None = None):
        self.rate = float(rate_bytes)
        # a burst of three slices: lateness of the event loop is made up, not lost
        self.burst = float(burst if burst is not None else max(2 * MIN_SLICE, self.rate * 0.3))
        self.tokens = self.burst
        self.stamp: float | None = None
        self.control_rate = self.rate * CONTROL_SHARE
        self.control_burst = max(float(CONTROL_BURST), self.control_rate * 0.5)
        self.control_tokens = self.control_burst
        self.control_stamp: float | None = None
        self.sent = 0  # bytes that passed the bucket (also without a cap)
        self.control_sent = 0  # of which on the control lane
        self._lock = asyncio.Lock()

    @classmethod
    def mbps(cls, mbit_per_s: float) -> TokenBucket:
        return cls(mbit_per_s * 1e6 / 8)

    @property
    def slice(self) -> int:
        if self.rate <= 0:
            return SLICE
        return int(min(SLICE, max(MIN_SLICE, self.rate * 0.1)))

    def _refill(self, now: float) -> None:
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, n: int, control: bool = False) -> None:
        """Wait until `n` bytes may go out (at once without a cap). Bulk callers queue in
        order; `control` callers use the control lane (see the module docstring)."""
        self.sent += n
        if control:
            self.control_sent += n
        if self.rate <= 0:
            return
        loop = asyncio.get_running_loop()
        if control:
            await self._take_control(n, loop)
            return
        async with self._lock:
            while True:
                self._refill(loop.time())
                if self.tokens >= n or (self.tokens >= self.burst and n > self.burst):
                    self.tokens -= n  # a slice bigger than the burst goes into debt
                    return
                await asyncio.sleep((min(n, self.burst) - self.tokens) / self.rate)

    async def _take_control(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            now = loop.time()
            if self.control_stamp is not None:
                self.control_tokens = min(self.control_burst, self.control_tokens
                                          + (now - self.control_stamp) * self.control_rate)
            self.control_stamp = now
            if self.control_tokens >= n or (self.control_tokens >= self.control_burst
                                            and n > self.control_burst):
                self.control_tokens -= n
                self._refill(now)
                self.tokens -= n  # counted against the cap: bulk waits that much longer
                return
            await asyncio.sleep((min(n, self.control_burst) - self.control_tokens)
                                / self.control_rate)


async def paced(data: bytes | bytearray | memoryview, bucket: TokenBucket,
                control: bool = False) -> AsyncIterator[bytes]:
    """`data` as slices, each released by the bucket (on the control lane if `control`)."""
    view = memoryview(data).cast("B")
    step = bucket.slice
    for start in range(0, len(view), step):
        piece = view[start : start + step]
        await bucket.take(len(piece), control)
        yield bytes(piece)
