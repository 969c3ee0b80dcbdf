"""The driver of a node that trains alone: clock, signals, files and progress output around
the pure Learner.

It finds the node's identity and newest valid checkpoint in the state directory, trains until
a bound is met (steps, duration, the run's total samples) or a signal arrives, evaluates on
the held-out split and checkpoints on intervals, and on SIGINT/SIGTERM stops after the step in
flight, writes its resume state if that fits in the grace period, and returns 0. A second
signal exits at once. (Networking -- gossip, election, checkpoint serving -- is not here yet.)
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from p2ptrain import checkpoint
from p2ptrain.config import Config
from p2ptrain.data import load_corpus
from p2ptrain.hw import choose_batch, detect
from p2ptrain.identity import load_or_create
from p2ptrain.learner import Learner
from p2ptrain.models import build_model
from p2ptrain.report import Reporter


class UserError(Exception):
    """A problem the user can fix (bad path, wrong checkpoint); printed as one line."""


@dataclass
class _Timers:
    start: float
    last_progress: float
    last_eval: float
    last_checkpoint: float | None
    checkpoint_seconds: float = 0.0  # duration of the last checkpoint write


def _fault_hook(spec: str | None, reporter: Reporter):
    """Test hook (P2PTRAIN_FAULT=kill-mid-checkpoint:N): SIGKILL this process halfway through
    writing the weights of its Nth checkpoint, to prove a torn write never loads."""
    if not spec or not spec.startswith("kill-mid-checkpoint:"):
        return lambda n: None
    target = int(spec.split(":", 1)[1])

    def for_checkpoint(n: int):
        if n != target:
            return None

        def progress(_name: str, done: int, total: int) -> None:
            if done >= total // 2:
                reporter.warn(f"fault injection: killing myself mid-checkpoint {n}")
                os.kill(os.getpid(), signal.SIGKILL)

        return progress

    return for_checkpoint


def prepare(cfg: Config, reporter: Reporter, alone: bool = True):
    """Identity, learner (resumed from the newest valid local checkpoint) and checkpoint root
    of the node whose state directory the configuration names."""
    state_dir = Path(cfg["node.state_dir"]).expanduser()
    identity = load_or_create(state_dir)
    model = build_model(cfg["model.name"], cfg.model_config())
    corpus = load_corpus(cfg["data.path"], cfg["data.holdout_fraction"], model.ctx_len + 2)
    train = cfg.section("train")
    batch, accum = train.batch, train.accum or 1
    hw = detect() if batch == 0 or not alone else None
    if batch == 0:
        batch, auto_accum = choose_batch(hw, model.flops_per_token() * model.ctx_len,
                                         model.activation_bytes_per_sample(),
                                         train.target_step_seconds)
        accum = train.accum or auto_accum
        micro = f" in {accum} micro-batches" if accum > 1 else ""
        reporter.info(f"hardware: {hw.device_class}, {hw.cpus:g} cores, "
                      f"{hw.memory_bytes / 2**30:.1f} GiB usable, {hw.matmul_gflops:.0f} GFLOP/s "
                      f"matmul -> batch {batch}{micro}",
                      event="hardware", batch=batch, accum=accum, **hw.as_dict())
    if batch % accum:
        raise UserError(f"batch {batch} is not a multiple of train.accum {accum}")
    learner = Learner(model, identity.node_id, train, corpus, batch, accum, cfg["eval.windows"])
    reporter.info(
        f"node {identity.node_id[:12]} (incarnation {identity.incarnation}) training "
        f"{model.name} ({model.space.n_params / 1e6:.2f}M parameters) on {corpus.name} "
        f"({corpus.train.size:,} training / {corpus.heldout.size:,} held-out bytes)"
        + (", alone" if alone else ""), event="start", node_id=identity.node_id,
        model=model.name, params=model.space.n_params, batch=batch)

    ckroot = state_dir / "checkpoints"
    for stale in checkpoint.stale_temporaries(ckroot):
        reporter.warn(f"removing partial checkpoint {stale.name} left by an interrupted write")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        found = checkpoint.find_latest(ckroot, learner.fingerprint)
    except checkpoint.CheckpointMismatch as exc:
        raise UserError(str(exc)) from None
    for reason in found.skipped:
        reporter.warn(f"skipping checkpoint: {reason}")
    if found.path is not None:
        try:
            learner.restore(found.path, found.manifest)
        except checkpoint.CheckpointError as exc:
            raise UserError(f"cannot resume: {exc}") from None
        reporter.info(f"resumed from {found.path.name}: step {learner.step}, "
                      f"{learner.swarm_samples:,} samples", event="resumed",
                      checkpoint=str(found.path), step=learner.step)
    return identity, learner, ckroot, hw


def run(cfg: Config, reporter: Reporter) -> int:
    """Train alone until a bound is met or a signal arrives."""
    identity, learner, ckroot, _ = prepare(cfg, reporter)
    return _loop(cfg, reporter, learner, identity, ckroot)


def _loop(cfg, reporter, learner, identity, ckroot) -> int:
    stop: dict = {"signal": None, "at": None}

    def on_signal(signum, _frame):
        if stop["signal"] is not None:
            reporter.warn("second signal: exiting without a final checkpoint")
            os._exit(130)
        stop["signal"] = signal.Signals(signum).name
        stop["at"] = time.monotonic()
        reporter.info(f"{stop['signal']}: stopping after the current step")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    fault = _fault_hook(os.environ.get("P2PTRAIN_FAULT"), reporter)
    ck_every, ck_steps = cfg["checkpoint.every_seconds"], cfg["checkpoint.every_steps"]
    eval_every, log_every = cfg["eval.every_seconds"], cfg["log.every_seconds"]
    steps_limit, duration = cfg["train.steps"], cfg["train.duration"]
    now = time.monotonic()
    t = _Timers(now, now, now, None)
    saves = 0
    eval_loss = None
    tokens, window_start = 0, now
    first_step = learner.step

    def save(final: bool = False) -> None:
        nonlocal saves
        saves += 1
        t0 = time.monotonic()
        path = checkpoint.save(ckroot, learner.snapshot(term=0), identity,
                               cfg["checkpoint.keep"], progress=fault(saves))
        t.checkpoint_seconds = time.monotonic() - t0
        t.last_checkpoint = time.monotonic()
        reporter.info(f"checkpoint {path.name} written in {t.checkpoint_seconds:.2f}s"
                      + (" (final)" if final else ""), event="checkpoint", path=str(path),
                      step=learner.step, final=final)

    reason = "stopped"
    try:
        if eval_every > 0 and learner.step == 0:
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
            if steps_limit and learner.step - first_step >= steps_limit:
                reason = f"--steps {steps_limit} reached"
                break
            if duration and now - t.start >= duration:
                reason = f"--duration {duration:g}s reached"
                break
            result = learner.train_step()
            tokens += result.tokens
            now = time.monotonic()
            if eval_every > 0 and now - t.last_eval >= eval_every:
                eval_loss = learner.evaluate()
                t.last_eval = time.monotonic()
                reporter.info(f"held-out loss {eval_loss:.3f} at step {learner.step} "
                              f"({now - t.start:.0f}s)", event="eval", step=learner.step,
                              eval_loss=eval_loss, elapsed_s=now - t.start)
            if now - t.last_progress >= log_every:
                rate = tokens / max(now - window_start, 1e-9)
                age = None if t.last_checkpoint is None else now - t.last_checkpoint
                reporter.progress(learner.step, result.loss, eval_loss, rate, learner.samples,
                                  learner.swarm_samples, learner.total_samples, result.lr, age)
                t.last_progress, tokens, window_start = now, 0, now
            last = t.last_checkpoint if t.last_checkpoint is not None else t.start
            if (ck_every and now - last >= ck_every) or (ck_steps and learner.step % ck_steps == 0):
                save()
        if stop["signal"]:
            # Stopping on a signal: write the resume state if it fits in the grace period.
            grace_left = cfg["node.grace_seconds"] - (time.monotonic() - stop["at"])
            if learner.step > first_step and grace_left > 2 * t.checkpoint_seconds + 1:
                save(final=True)
            elif learner.step > first_step:
                reporter.warn("no time left in the grace period; keeping the last checkpoint")
        else:
            eval_loss = learner.evaluate()
            reporter.info(f"held-out loss {eval_loss:.3f} at step {learner.step} "
                          f"({time.monotonic() - t.start:.0f}s)", event="eval",
                          step=learner.step, eval_loss=eval_loss,
                          elapsed_s=time.monotonic() - t.start)
            if learner.step > first_step:
                save(final=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    held = f", held-out loss {eval_loss:.3f}" if eval_loss is not None else ""
    reporter.info(f"stopped: {reason}; {learner.step} steps, {learner.samples:,} samples{held}",
                  event="stopped", reason=reason, step=learner.step, eval_loss=eval_loss)
    return 0

