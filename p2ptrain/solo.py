"""The driver of a node that trains alone (`join --alone`): clock, signals, files and progress
output around the pure Learner, on the same schedule as the networked runtime (housekeeping.py).

It starts from the node's identity and newest valid checkpoint (startup.py), trains until a
bound is met (steps, duration, the run's total samples) or a signal arrives, evaluates on the
held-out split and checkpoints on intervals (a write that fails, e.g. on a full disk, is one
warning: training goes on and the next interval retries), and on SIGINT/SIGTERM stops after
the step in flight, writes its resume state if that fits in the grace period, and returns 0.
A second signal exits at once. A run whose data cannot be read any more (a shard damaged or
replaced under it) writes its final checkpoint and returns 2. A run that diverges (a
non-finite gradient or held-out loss) stops at once, writes nothing more and returns 1. So
does a run whose final checkpoint cannot be written (a full disk at the end): what it trained
since its last checkpoint is lost, and a script that goes on to use the checkpoint must not
take the older one for it. The networked node is p2ptrain.net.runtime.
"""

from __future__ import annotations

import os
import signal
import time

from p2ptrain import checkpoint
from p2ptrain.data.tokens import TokenDataError
from p2ptrain.fsutil import describe_os_error
from p2ptrain.housekeeping import Housekeeping
from p2ptrain.learner import DIVERGED_HINT
from p2ptrain.report import Reporter
from p2ptrain.settings import Settings
from p2ptrain.startup import Prepared, env_fault_hook, prepare


def run(settings: Settings, reporter: Reporter) -> int:
    """Train alone until a bound is met or a signal arrives."""
    return _loop(settings, reporter, prepare(settings, reporter))


def _loop(settings: Settings, reporter: Reporter, node: Prepared) -> int:
    learner = node.learner
    stop: dict = {"signal": None, "at": None}

    def on_signal(signum, _frame):
        if stop["signal"] is not None:
            reporter.warn("second signal: exiting without a final checkpoint")
            os._exit(130)
        stop["signal"] = signal.Signals(signum).name
        stop["at"] = time.monotonic()
        reporter.info(f"{stop['signal']}: stopping after the current step")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    fault = env_fault_hook(reporter)
    start = time.monotonic()
    plan = Housekeeping(settings, start, learner.step)
    last_progress, saves, eval_loss = start, 0, None
    saved_step, saved_path = -1, None  # the newest checkpoint this run wrote
    tokens, window_start = 0, start

    def save(final: bool = False) -> bool:
        nonlocal saves, saved_step, saved_path
        if final and saved_step == learner.step:  # the periodic one of this step: not twice
            reporter.info(f"checkpoint {saved_path.name} is the final one", event="checkpoint",
                          path=str(saved_path), step=learner.step, final=True, written=False)
            return True
        saves += 1
        t0 = time.monotonic()
        plan.save_started(t0)
        try:
            path = checkpoint.save(node.ckroot, learner.snapshot(term=0), node.identity,
                                   settings.checkpoint.keep, progress=fault(saves))
        except OSError as exc:
            reporter.warn(f"checkpoint not written: {describe_os_error(exc)}"
                          + ("" if final else "; training goes on, the next interval retries"),
                          event="checkpoint_failed", step=learner.step, final=final)
            return False
        plan.save_finished(time.monotonic() - t0)
        saved_step, saved_path = learner.step, path
        reporter.info(f"checkpoint {path.name} written in {plan.save_seconds:.2f}s"
                      + (" (final)" if final else ""), event="checkpoint", path=str(path),
                      step=learner.step, final=final)
        return True

    def evaluate(now: float) -> float:
        loss = learner.evaluate()
        average = learner.evaluate_average()  # train.ema: what the checkpoints carry
        plan.evaluated(time.monotonic())
        reporter.evaluated(learner.step, loss, average, now - start)
        return loss

    reason, diverged, damaged, lost = "stopped", "", "", False
    try:
        if plan.eval_every > 0 and learner.step == 0:
            eval_loss = learner.evaluate()
            reporter.info(f"held-out loss at start: {eval_loss:.3f}", event="eval",
                          step=0, eval_loss=eval_loss, elapsed_s=0.0)
        while True:
            now = time.monotonic()
            if stop["signal"]:
                reason = stop["signal"]
                break
            if learner.finished:
                reason = "the run reached train.total_samples"
                break
            bound = plan.stop_reason(now, learner.step)
            if bound:
                reason = bound
                break
            try:
                result = learner.train_step()
            except FloatingPointError as exc:  # the alone loop applies what it computes
                diverged = f"training diverged ({exc}); {DIVERGED_HINT}{plan.resumed_hint()}"
                break
            except TokenDataError as exc:  # a shard damaged or replaced under the run: the
                damaged = f"the data cannot be read: {exc}"  # batch was never applied
                break
            tokens += result.tokens
            now = time.monotonic()
            if plan.eval_due(now):
                eval_loss = evaluate(now)
                if diverged := plan.diverged(learner.step, False, eval_loss):
                    break
            if now - last_progress >= settings.log.every_seconds:
                rate = tokens / max(now - window_start, 1e-9)
                age = now - plan.last_save if saved_path is not None else None
                reporter.progress(learner.step, result.loss, eval_loss, rate, learner.samples,
                                  learner.swarm_samples, learner.total_samples, result.lr, age)
                last_progress, tokens, window_start = now, 0, now
            if plan.save_due(now, learner.step):
                save()
        if diverged:  # nothing more to save: the checkpoints before it are the ones to keep
            reason = diverged
        elif damaged:  # the weights are whole: keep what was trained, then say what is wrong
            reason = "the data cannot be read"
            if learner.step > plan.first_step:
                lost = not save(final=True)
        elif stop["signal"]:
            # Stopping on a signal: write the resume state if it fits in the grace period.
            if plan.final_save_fits(time.monotonic(), stop["at"], learner.step):
                lost = not save(final=True)
            elif learner.step > plan.first_step:
                reporter.warn("no time left in the grace period; keeping the last checkpoint")
        else:
            eval_loss = evaluate(time.monotonic())
            if learner.step > plan.first_step:
                lost = not save(final=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    reporter.stopped(reason, learner.step, learner.samples, eval_loss)
    if lost:
        newest = checkpoint.list_checkpoints(node.ckroot)
        reporter.error("the final checkpoint was not written (see the warning above): the "
                       f"steps since {newest[0].name if newest else 'the start'} are lost",
                       event="final_checkpoint_lost", step=learner.step)
    if damaged:
        reporter.error(damaged, event="data_error", step=learner.step)
        return 2
    return 1 if diverged or lost else 0
