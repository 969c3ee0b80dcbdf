"""When a running node evaluates, checkpoints and stops: one policy for both drivers (the
alone loop in solo.py and the networked runtime), so `--steps`, `--duration`, the evaluation
and checkpoint intervals and the grace period mean the same thing everywhere. Also when a run
has diverged (`diverged`): a non-finite held-out loss, or DIVERGED_SKIPS steps in a row
discarded as non-finite -- the driver then stops with exit 1 and writes nothing more.

Times are seconds on the driver's monotonic clock, passed in; this file never reads a clock,
sleeps or touches a file.
"""

from __future__ import annotations

import math

from p2ptrain.learner import DIVERGED_HINT
from p2ptrain.settings import Settings

DIVERGED_SKIPS = 20  # steps discarded in a row (non-finite loss or gradient): diverged
LEAD_SAVE_GAP = 120.0  # s between a new leader's own writes when timed checkpoints are off


class Housekeeping:
    """The schedule of evaluations, periodic checkpoints and stopping of one run."""

    def __init__(self, settings: Settings, start: float, first_step: int):
        self.eval_every = settings.eval.every_seconds  # 0: only at the end
        self.save_every = settings.checkpoint.every_seconds  # 0: no timed checkpoints
        self.save_every_steps = settings.checkpoint.every_steps  # 0: none by step count
        self.max_steps = settings.train.steps  # local steps of this run; 0: no limit
        self.max_seconds = settings.train.duration  # 0: no limit
        self.grace = settings.host.grace_seconds
        self.start, self.first_step = start, first_step
        self.last_eval = start
        self.last_save = start  # when the last checkpoint write started
        self.save_seconds = 0.0  # how long the last checkpoint write took
        self.saves = 0  # checkpoint writes this run has finished
        self.skip_run = 0  # steps discarded in a row
        self.last_lead_save = -math.inf  # when this node last wrote one on becoming leader

    def eval_due(self, now: float) -> bool:
        return self.eval_every > 0 and now - self.last_eval >= self.eval_every

    def evaluated(self, now: float) -> None:
        self.last_eval = now

    def save_due(self, now: float, step: int) -> bool:
        """A periodic checkpoint is due after local step `step`."""
        return bool((self.save_every and now - self.last_save >= self.save_every)
                    or (self.save_every_steps and step % self.save_every_steps == 0))

    def lead_save(self, now: float) -> bool:
        """Whether a node that has just become leader writes a checkpoint at once (and, if
        so, that it does): not again within a checkpoint interval -- a member claiming the
        next term every few seconds made each new leader write its replica every time,
        its training held meanwhile."""
        if now - self.last_lead_save < (self.save_every or LEAD_SAVE_GAP):
            return False
        self.last_lead_save = now
        return True

    def save_started(self, now: float) -> None:
        self.last_save = now

    def save_finished(self, seconds: float, written: bool = True) -> None:
        self.save_seconds = seconds
        self.saves += written  # (a failed write: the resume checkpoint is still the newest)

    def stop_reason(self, now: float, step: int) -> str | None:
        """Why the run's own bounds end it now (None: go on)."""
        if self.max_steps and step - self.first_step >= self.max_steps:
            return f"--steps {self.max_steps} reached"
        if self.max_seconds and now - self.start >= self.max_seconds:
            return f"--duration {self.max_seconds:g}s reached"
        return None

    def grace_left(self, now: float, stopping_since: float) -> float:
        return self.grace - (now - stopping_since)

    def final_save_fits(self, now: float, stopping_since: float, step: int) -> bool:
        """A last checkpoint is worth writing (steps were taken) and fits in what is left of
        the grace period (twice the last write's time, plus a second)."""
        return (step > self.first_step
                and self.grace_left(now, stopping_since) > 2 * self.save_seconds + 1)

    def diverged(self, step: int, skipped: bool, eval_loss: float | None) -> str:
        """After a step (`skipped`: discarded as non-finite): why the run diverged, or ""."""
        self.skip_run = self.skip_run + 1 if skipped else 0
        if self.skip_run >= DIVERGED_SKIPS:
            why = f"{self.skip_run} steps in a row with a non-finite loss or gradient"
        elif eval_loss is not None and not math.isfinite(eval_loss):
            why = f"held-out loss {eval_loss}"
        else:
            return ""
        return f"training diverged ({why}, at step {step}); {DIVERGED_HINT}{self.resumed_hint()}"

    def resumed_hint(self) -> str:
        """What a diverged run adds when it resumed from a checkpoint and wrote none since:
        the weights it resumed may be the diverging ones (finite, yet every gradient NaN),
        which no lower rate mends, and every restart would resume them again."""
        if self.first_step == 0 or self.saves:
            return ""
        return (f"; this run resumed at step {self.first_step} and wrote no checkpoint since: "
                f"if it diverges there at a lower rate too, that checkpoint holds the "
                f"diverging weights -- move it out of the checkpoints directory to resume "
                f"from the one before")
