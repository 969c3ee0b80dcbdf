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
