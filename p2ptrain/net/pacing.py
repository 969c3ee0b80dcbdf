"""The upload cap: one token bucket over every body this node sends (requests and responses),
and the slicing of large bodies into ~1 MiB pieces.

Bodies go out as async iterators of slices (FIELD-NOTES: one huge write is quadratic on
Python 3.11); with a cap, each slice waits for its tokens first, so the node's total upload
rate stays at the cap however many transfers run at once. Slices shrink with the cap (a tenth
of a second's worth, at least 4 KiB), so the rate is smooth rather than bursty. A driver: it
reads the event loop's clock and sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

SLICE = 1 << 20  # bytes per slice without a cap
MIN_SLICE = 4096


class TokenBucket:
    """`rate` bytes per second with a burst of `burst` bytes; `rate` 0 means no cap."""

    def __init__(self, rate_bytes: float, burst: float | None = None):
        self.rate = float(rate_bytes)
        # a burst of three slices: lateness of the event loop is made up, not lost
        self.burst = float(burst if burst is not None else max(2 * MIN_SLICE, self.rate * 0.3))
        self.tokens = self.burst
        self.stamp: float | None = None
        self.sent = 0  # bytes that passed the bucket (also without a cap)
        self._lock = asyncio.Lock()

    @classmethod
    def mbps(cls, mbit_per_s: float) -> TokenBucket:
        return cls(mbit_per_s * 1e6 / 8)

    @property
    def slice(self) -> int:
        if self.rate <= 0:
            return SLICE
        return int(min(SLICE, max(MIN_SLICE, self.rate * 0.1)))

    async def take(self, n: int) -> None:
        """Wait until `n` bytes may go out (at once without a cap). Callers queue in order."""
        self.sent += n
        if self.rate <= 0:
            return
        async with self._lock:
            loop = asyncio.get_running_loop()
            while True:
                now = loop.time()
                if self.stamp is not None:
                    self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n or (self.tokens >= self.burst and n > self.burst):
                    self.tokens -= n  # a slice bigger than the burst goes into debt
                    return
                await asyncio.sleep((min(n, self.burst) - self.tokens) / self.rate)


async def paced(data: bytes | bytearray | memoryview, bucket: TokenBucket) -> AsyncIterator[bytes]:
    """`data` as slices, each released by the bucket."""
    view = memoryview(data).cast("B")
    step = bucket.slice
    for start in range(0, len(view), step):
        piece = view[start : start + step]
        await bucket.take(len(piece))
        yield bytes(piece)
