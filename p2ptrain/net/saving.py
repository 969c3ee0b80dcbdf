"""Checkpoint writes of a running node: copy the replica on the event loop (between steps, so
it is consistent), write the copy in the I/O thread while training goes on.

One write at a time: a save asked for while one is running is skipped and counted (the next
one comes soon). The copy costs one replica of memory (weights and optimiser moments) for the
duration of the write. A driver: threads and files.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from p2ptrain import checkpoint

if TYPE_CHECKING:
    from p2ptrain.net.runtime import Runtime


def copy_snapshot(learner, term: int) -> checkpoint.Snapshot:
    """A checkpoint snapshot that owns copies of the buffers (written while training goes on)."""
    snap = learner.snapshot(term)
    space = learner.model.space
    params = learner.params.copy()
    return checkpoint.Snapshot(
        step=snap.step, term=term, swarm_count=dict(snap.swarm_count),
        fingerprint=snap.fingerprint, arch=snap.arch,
        model_tensors=[(s.name, space.view(params, s.name)) for s in space],
        state_tensors=[(name, np.array(a, copy=True)) for name, a in snap.state_tensors],
        state_meta=json.loads(json.dumps(snap.state_meta)))


class Saver:
    """Writes the runtime's checkpoints into its checkpoint root, one at a time."""

    def __init__(self, rt: Runtime, fault: Callable[[int], object]):
        self.rt, self.fault = rt, fault
        self.future: asyncio.Future | None = None
        self.count = 0  # saves started
        self.seconds = 0.0  # duration of the last write
        self.last_started = 0.0  # runtime clock of the last save started

    def save(self, term: int, final: bool = False, reason: str = "") -> None:
        """Start writing a checkpoint stamped `term` (skipped if a write is running)."""
        rt = self.rt
        if self.future is not None:
            rt.count("checkpoints_skipped_busy")
            return
        snap = copy_snapshot(rt.learner, term)
        self.count += 1
        progress = self.fault(self.count)
        started = self.last_started = rt.now()
        future = rt.loop.run_in_executor(
            rt.io_pool, lambda: checkpoint.save(rt.ckroot, snap, rt.identity,
                                                rt.cfg["checkpoint.keep"], progress))
        self.future = future

        def done(f: asyncio.Future) -> None:
            self.future = None
            self.seconds = rt.now() - started
            try:
                path = f.result()
            except Exception as exc:
                rt.reporter.warn(f"checkpoint failed: {exc}", event="checkpoint_failed")
                return
            rt.reporter.info(f"checkpoint {path.name} written in {self.seconds:.2f}s "
                             f"({reason}{', final' if final else ''})", event="checkpoint",
                             path=str(path), step=snap.step, term=term, final=final)

        future.add_done_callback(done)

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` s for the write in progress, if any."""
        if self.future is not None:
            await asyncio.wait([self.future], timeout=timeout)
            await asyncio.sleep(0)  # let its done-callback report it
