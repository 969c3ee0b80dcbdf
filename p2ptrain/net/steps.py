"""Training steps of a networked node, off the event loop: a `RunStep` runs
`learner.compute_gradient()` (and, when due, a held-out evaluation) in the step thread, and its
result goes back to the node as `StepDone` (+ `Evaluated`) on the loop. A step asked for while
the node is joining, or stopping, is parked until released. A driver: threads, no decisions
beyond the evaluation schedule (housekeeping.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.housekeeping import Housekeeping
    from p2ptrain.learner import Learner


class Stepper:
    """Runs one training step at a time in `executor`; `done(step, loss, eval_loss)` gets
    its result on the loop, `failed(exc)` a step that raised."""

    def __init__(self, learner: Learner, executor: Executor, plan: Housekeeping,
                 now: Callable[[], float], done: Callable[[int, float, float | None], None],
                 failed: Callable[[BaseException], None]):
        self.learner, self.executor, self.plan, self.now = learner, executor, plan, now
        self.done, self.failed = done, failed
        self.future: asyncio.Future | None = None  # the step in flight
        self.parked: int | None = None  # a step held back (joining, stopping)

    def start(self, step: int, hold: bool) -> None:
        """Run step `step` now, or park it when `hold`."""
        if hold:
            self.parked = step
            return
        evaluate = self.plan.eval_due(self.now())
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._compute,
                                                            evaluate)
        self.future = future
        future.add_done_callback(lambda f: self._finished(step, f))

    def release(self) -> None:
        """Run the parked step, if any."""
        if self.parked is not None:
            step, self.parked = self.parked, None
            self.start(step, hold=False)

    def _compute(self, evaluate: bool) -> tuple[float, float | None]:
        loss = self.learner.compute_gradient()
        return loss, (self.learner.evaluate() if evaluate else None)

    def _finished(self, step: int, future: asyncio.Future) -> None:
        self.future = None
        try:
            loss, eval_loss = future.result()
        except Exception as exc:  # a bug or out of memory: the driver stops
            self.failed(exc)
            return
        if eval_loss is not None:
            self.plan.evaluated(self.now())
        self.done(step, float(loss), eval_loss)
