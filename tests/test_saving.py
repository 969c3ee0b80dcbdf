"""The running node's checkpoint writes (net/saving.py, issue 15): written from the live
buffers, so the driver hears when a write starts and ends, and what must not touch the
buffers meanwhile (a finished step, an adoption) waits for the end."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from p2ptrain.net.saving import Saver


class FakePlan:
    save_seconds = 0.0

    def save_started(self, now: float) -> None:
        pass

    def save_finished(self, seconds: float) -> None:
        self.save_seconds = seconds


class FakeLearner:
    def snapshot(self, term: int):
        return ("live views", term)


class FakeReporter:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message: str, **_fields) -> None:
        self.lines.append(message)

    warn = info


def test_a_write_reads_the_live_buffers_and_holds_back_what_would_change_them():
    release = threading.Event()
    written: list = []
    log: list = []

    def write(snap, progress=None) -> Path:
        release.wait(5)
        written.append(snap)
        return Path("ckpt-t000001-s0000000007")

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            saver = Saver(FakeLearner(), write, pool, lambda: 0.0, FakeReporter(),
                          lambda _name: None, lambda _n: None, FakePlan(),
                          lambda active: log.append(("reading", active)))
            step_done = saver.after_write(lambda *args: log.append(("step", args)))
            step_done(1, 2.5, None)  # no write yet: at once
            saver.save(term=1)
            assert saver.writing and log[-1] == ("reading", True)
            step_done(2, 2.4, None)  # a step ends during the write: it waits
            assert saver.deferred and log[-1] == ("reading", True)
            saver.save(term=1)  # one write at a time
            blocked = asyncio.get_running_loop().run_in_executor(None, saver.block_until_written)
            await asyncio.sleep(0.05)
            assert not blocked.done()  # an adoption waits for the write, too
            release.set()
            await saver.wait(5)
            await asyncio.wait_for(blocked, 5)
            assert not saver.writing and not saver.deferred

    asyncio.run(scenario())
    assert written == [("live views", 1)]
    assert log == [("step", (1, 2.5, None)), ("reading", True), ("reading", False),
                   ("step", (2, 2.4, None))]
