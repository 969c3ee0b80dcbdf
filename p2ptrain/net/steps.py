"""Training steps of a networked node, off the event loop: a `RunStep` runs
`learner.compute_gradient()` (and, when due, a held-out evaluation) in the step thread, and its
result goes back to the node as `StepDone` (+ `Evaluated`) on the loop. A step asked for while
the node is joining, or stopping, is parked until released. A driver: threads, no decisions
beyond the evaluation schedule (housekeeping.py).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from p2ptrain.data.tokens import TokenDataError

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # s

if TYPE_CHECKING:
    from p2ptrain.housekeeping import Housekeeping
    from p2ptrain.learner import Learner


def step_failure(exc: BaseException) -> tuple[str, str, int]:
    """Why a node whose step raised `exc` stops: (reason, detail, exit code). A shard damaged
    or replaced under the run is the data's fault (2); anything else a bug or out of memory
    (1). Either way the batch never reached the weights."""
    if isinstance(exc, TokenDataError):
        return "the data cannot be read", str(exc), 2
    return "training step failed", repr(exc), 1


class Stepper:
    """Runs one training step at a time in `executor`; `done(step, loss, eval_loss)` gets
    its result on the loop, `failed(exc)` a step that raised. With `train.ema` a step that
    evaluates also evaluates the average of the weights (what checkpoints carry):
    `average_eval` is its last held-out loss."""

    def __init__(self, learner: Learner, executor: Executor, plan: Housekeeping,
                 now: Callable[[], float], done: Callable[[int, float, float | None], None],
                 failed: Callable[[BaseException], None],
                 defer: Callable[[Callable[..., None]], Callable[..., None]] | None = None):
        self.learner, self.executor, self.plan, self.now = learner, executor, plan, now
        self.done, self.failed = done, failed
        # `defer` may hold a result back (Saver.after_write: a checkpoint write reads the
        # buffers); `idle` waits for the result to reach `done`, not only for the step
        self._hand_over = (defer or (lambda fn: fn))(self._deliver)
        self.future: asyncio.Future | None = None  # the step in flight
        self.undelivered: int | None = None  # a finished step whose result is held back
        self._delivered: asyncio.Event | None = None
        self.parked: int | None = None  # a step held back (joining, stopping)
        self.counts = [0] * len(STEP_BUCKETS)  # steps whose compute time fell in each bucket
        self.count, self.seconds, self.tokens = 0, 0.0, 0  # steps, their time and tokens
        self.average_eval: float | None = None  # train.ema: the average's held-out loss

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

    async def idle(self) -> None:
        """Return once no step is in flight and the last one's result went to the node (the
        gradient buffer is free: a join judges a fetched checkpoint in it)."""
        while self.future is not None or self.undelivered is not None:
            if self.future is not None:
                await asyncio.wait([self.future])  # its own callback (`_finished`) runs first
            else:
                self._delivered = asyncio.Event()
                await self._delivered.wait()

    def _deliver(self, step: int, loss: float, eval_loss: float | None) -> None:
        self.undelivered = None
        if self._delivered is not None:
            self._delivered.set()
        self.done(step, loss, eval_loss)

    def release(self) -> None:
        """Run the parked step, if any."""
        if self.parked is not None:
            step, self.parked = self.parked, None
            self.start(step, hold=False)

    def _compute(self, evaluate: bool) -> tuple[float, float | None, float | None]:
        started = time.perf_counter()
        loss = self.learner.compute_gradient()
        self._record(time.perf_counter() - started)
        if not evaluate:
            return loss, None, None
        return loss, self.learner.evaluate(), self.learner.evaluate_average()

    def _record(self, seconds: float) -> None:
        i = bisect.bisect_left(STEP_BUCKETS, seconds)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.seconds += seconds
        self.tokens += self.learner.batch * self.learner.model.ctx_len

    def stats(self) -> dict:
        """Step times as a cumulative histogram (for /metrics) and the tokens trained on."""
        cumulative, total = [], 0
        for bound, n in zip(STEP_BUCKETS, self.counts, strict=True):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "count": self.count, "seconds": self.seconds,
                "tokens": self.tokens}

    def _finished(self, step: int, future: asyncio.Future) -> None:
        self.future = None
        try:
            loss, eval_loss, average_eval = future.result()
        except Exception as exc:  # a bug or out of memory: the driver stops
            self.failed(exc)
            return
        if eval_loss is not None:
            self.plan.evaluated(self.now())
            self.average_eval = average_eval
        self.undelivered = step
        self._hand_over(step, float(loss), eval_loss)
