"""The networked node's step driver (p2ptrain/net/steps.py): `Stepper.idle` returns only once
the step in flight is over and its result went to the node -- a join judges a fetched
checkpoint in the gradient buffer, which a step taken while joining writes."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from p2ptrain.net.steps import Stepper
from tests.test_node import learner


class _NoEvaluations:  # the housekeeping plan's part a Stepper reads
    def eval_due(self, now: float) -> bool:
        return False


def _failed(exc: BaseException) -> None:
    raise AssertionError(f"the step failed: {exc!r}")


def test_idle_waits_for_the_step_in_flight_and_its_hand_over():
    trainer = learner("ab" * 16)
    done: list[tuple[int, float]] = []
    seen_by_idle: list[int] = []

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            stepper = Stepper(trainer, pool, _NoEvaluations(), time.monotonic,
                              lambda step, loss, _e: done.append((step, loss)), _failed)
            await stepper.idle()  # nothing in flight: at once
            assert done == []
            for step in (1, 2):
                stepper.start(step, hold=False)
                assert stepper.future is not None
                await stepper.idle()
                seen_by_idle.append(len(done))
                assert stepper.future is None

    asyncio.run(main())
    assert [s for s, _ in done] == [1, 2] and seen_by_idle == [1, 2]


def test_idle_waits_for_a_result_a_checkpoint_write_holds_back():
    """A write that reads the buffers holds the step's result back (Saver.after_write): idle
    used to return as soon as the step ended, and the join's judge then loaded a fetched
    checkpoint's weights into the gradient buffer the held result was about to apply."""
    trainer = learner("cd" * 16)
    held: list = []
    done: list[int] = []
    order: list[str] = []

    def defer(fn):  # a write in progress: the result waits until `release`
        return lambda *args: held.append(lambda: fn(*args))

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            stepper = Stepper(trainer, pool, _NoEvaluations(), time.monotonic,
                              lambda step, loss, _e: (done.append(step), order.append("done")),
                              _failed, defer)
            stepper.start(1, hold=False)
            waiter = asyncio.ensure_future(stepper.idle())
            await asyncio.wait([stepper.future])
            await asyncio.sleep(0)
            assert held and not done and not waiter.done()  # the step is over, its result held
            order.append("release")
            held.pop()()  # the write ends
            await waiter
            order.append("idle")

    asyncio.run(main())
    assert done == [1] and order == ["release", "done", "idle"]
