"""The running node's checkpoint writes (net/saving.py, issue 15): written from the live
buffers, so the driver hears when a write starts and ends, and what must not touch the
buffers meanwhile (a finished step, an adoption) waits for the end."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from p2ptrain.net.saving import Saver


class FakePlan:
    save_seconds = 0.0

    def save_started(self, now: float) -> None:
        pass

    def save_finished(self, seconds: float, written: bool = True) -> None:
        self.save_seconds = seconds


class Snap(NamedTuple):
    views: str
    term: int
    step: int = 7  # what the write's report names


class FakeLearner:
    step = 7

    def snapshot(self, term: int):
        return Snap("live views", term, self.step)


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
    assert written == [("live views", 1, 7)]
    assert log == [("step", (1, 2.5, None)), ("reading", True), ("reading", False),
                   ("step", (2, 2.4, None))]


def test_a_final_save_asked_for_during_a_write_is_written_when_it_ends():
    """The leader's final checkpoint (the run reached total_samples) while a periodic write
    runs: not skipped as a periodic one is, but written after it, the held step first."""
    release = threading.Event()
    written: list = []
    log: list = []
    reporter = FakeReporter()

    def write(snap, progress=None) -> Path:
        release.wait(5)
        written.append(snap)
        return Path(f"ckpt-{len(written)}")

    async def scenario() -> None:
        learner = FakeLearner()

        def applied(*args) -> None:  # the held step, applied at the write's end
            log.append(("step", args))
            learner.step = args[0]

        with ThreadPoolExecutor(1) as pool:
            saver = Saver(learner, write, pool, lambda: 0.0, reporter,
                          lambda name: log.append(name), lambda _n: None, FakePlan(),
                          lambda active: log.append(("reading", active)))
            step_done = saver.after_write(applied)
            saver.save(term=3, reason="local")
            step_done(9, 2.0, None)  # held for the write
            saver.save(term=3, reason="local")  # a periodic one: skipped
            saver.save(term=3, final=True, reason="leader")  # the final one: waits
            release.set()
            await saver.wait(5)  # the first write, then the final one started from its end
            assert saver.writing or len(written) == 2
            await saver.wait(5)
            assert not saver.writing

    asyncio.run(scenario())
    assert written == [("live views", 3, 7), ("live views", 3, 9)]
    assert log == [("reading", True), "checkpoints_skipped_busy", ("reading", False),
                   ("step", (9, 2.0, None)), ("reading", True), ("reading", False)]
    assert reporter.lines[-1] == "checkpoint ckpt-2 written in 0.00s (leader, final)"


def test_a_final_save_of_the_step_and_term_just_written_writes_nothing_again():
    """The run's end, right after a timed or a leader's write of the same step: the final
    save wrote the whole replica again (12 GB at 1B for nothing). Another term's is written:
    the final checkpoint is stamped with the term the node ends in."""
    written: list = []

    def write(snap, progress=None) -> Path:
        written.append(snap.term)
        return Path(f"ckpt-t{snap.term:06d}-s0000000007")

    async def scenario() -> list[str]:
        reporter = FakeReporter()
        with ThreadPoolExecutor(1) as pool:
            saver = Saver(FakeLearner(), write, pool, lambda: 0.0, reporter,
                          lambda _name: None, lambda _n: None, FakePlan(), lambda _a: None)
            saver.save(term=1)
            saver.save(term=1, final=True)  # asked during the write: waits for its end
            await saver.wait(5)
            await asyncio.sleep(0.05)
            await saver.wait(5)
            saver.save(term=1, final=True)
            saver.save(term=2, final=True)
            await saver.wait(5)
        return reporter.lines

    lines = asyncio.run(scenario())
    assert written == [1, 2]
    assert sum("is the final one" in line for line in lines) == 2
