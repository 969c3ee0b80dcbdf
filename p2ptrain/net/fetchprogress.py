"""Progress of a checkpoint fetch, for people: a tqdm bar with rate and ETA on a terminal, a
plain line every `every` seconds anywhere else (a pipe, a log file, journald).

    bar = FetchProgress("fetching ckpt-t000002-s0000000100", say=print)
    fetch_checkpoint(..., progress=bar)   # called as (bytes done, bytes total, sources)
    bar.close()

The plain line reads `fetching ...: 45% of 1.2 GB, 38.1 MB/s from 3 peers, ETA 17s`. The
clock is passed in (tests drive it); nothing is printed for a fetch that needs no bytes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class FetchProgress:
    """A progress callback for fetch_checkpoint (see the module docstring)."""

    def __init__(self, what: str, *, say: Callable[[str], None], stream: TextIO | None = None,
                 every: float = 5.0, terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.say, self.every, self.clock = what, say, every, clock
        stream = stream if stream is not None else sys.stderr
        self.terminal = terminal if terminal is not None else stream.isatty()
        self.stream = stream
        self.bar: tqdm | None = None
        self.start: float | None = None
        self.first = 0  # bytes already there when the fetch began (a resume)
        self.last_said = -float("inf")
        self.done = self.total = self.sources = 0

    def __call__(self, done: int, total: int, sources: int = 1) -> None:
        now = self.clock()
        if self.start is None:
            self.start, self.first = now, done
        self.done, self.total, self.sources = done, total, sources
        if self.terminal:
            if self.bar is None:
                self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True,
                                unit_divisor=1000, desc=self.what, file=self.stream,
                                dynamic_ncols=True, leave=True)
            self.bar.set_postfix_str(f"{sources} peer{'s' * (sources != 1)}", refresh=False)
            self.bar.update(done - self.bar.n)
            return
        if now - self.last_said >= self.every or done >= total:
            self.last_said = now
            self.say(self.line(now))

    def line(self, now: float) -> str:
        pct = 100.0 * self.done / max(self.total, 1)
        elapsed = now - (self.start if self.start is not None else now)
        rate = (self.done - self.first) / elapsed if elapsed > 0 else 0.0
        text = f"{self.what}: {pct:.0f}% of {human_bytes(self.total)}"
        if rate > 0:
            text += f", {human_bytes(rate)}/s"
        text += f" from {self.sources} peer{'s' * (self.sources != 1)}"
        if rate > 0 and self.done < self.total:
            text += f", ETA {human_seconds((self.total - self.done) / rate)}"
        return text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
