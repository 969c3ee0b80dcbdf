"""Checkpoint writes of a running node: written in the I/O thread straight from the learner's
buffers (no copy: a second replica of weights and optimiser moments is what a big model on a
small machine cannot afford).

The write starts on the event loop between steps and tells the driver (`reading(True)`, then
`reading(False)` when it ends): meanwhile the node writes nothing of the replica (averaging
half steps are held, a finished step waits to be applied) while the next gradient is
computed. One write at a time: a save asked for while one is running is skipped and counted
(the next one comes soon) -- but for a final one (the leader's at the run's end), which is
written when that write ends: a periodic write in progress must not cost the run its last
checkpoint -- and not at all when the last write done was of the same step and term (a
timed or leader's write of the run's last step). A write that fails (a full disk) is one
warning line; training goes on and the save is retried after a back-off that doubles up to
RETRY_MAX (any save meanwhile, a periodic or a leader's one, takes the retry's place). A
driver: threads and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain import checkpoint
from p2ptrain.checkpoint.manifest import MAX_TERM
from p2ptrain.fsutil import describe_os_error, read_regular, write_small

RETRY_FIRST, RETRY_MAX = 5.0, 300.0  # s: back-off of the retry after a failed write

if TYPE_CHECKING:
    from p2ptrain.housekeeping import Housekeeping
    from p2ptrain.learner import Learner
    from p2ptrain.report import Reporter


class Saver:
    """Writes a running node's checkpoints, one at a time, in the I/O thread."""

    def __init__(self, learner: Learner, write: Callable[[checkpoint.Snapshot, Any], Path],
                 executor: Executor, now: Callable[[], float], reporter: Reporter,
                 count: Callable[[str], None], fault: Callable[[int], Any],
                 plan: Housekeeping, reading: Callable[[bool], None]):
        self.learner, self.write, self.executor = learner, write, executor
        self.now, self.reporter, self.count_event = now, reporter, count
        self.fault, self.plan, self.reading = fault, plan, reading
        self.future: asyncio.Future | None = None
        self._idle = threading.Event()  # no write reads the learner's buffers
        self._idle.set()
        self._after: list[Callable[[], None]] = []  # calls waiting for the write to end
        self._final: tuple[int, str] | None = None  # (term, reason) of a final save waiting
        self.count = 0  # saves started
        self.failures = 0  # writes failed in a row
        self.retry: asyncio.TimerHandle | None = None  # the retry of a failed write
        self.closed = ""  # why no more checkpoints are written ("": they are)
        self.lost = False  # a final write failed and none was written since
        self.written: tuple[int, int] | None = None  # (step, term) of the last write done

    @property
    def seconds(self) -> float:
        """Duration of the last write."""
        return self.plan.save_seconds

    def save(self, term: int, final: bool = False, reason: str = "") -> None:
        """Start writing a checkpoint stamped `term` (skipped if a write is running, or
        nothing if `closed` says why not: a diverged run's weights are no use)."""
        if self.closed:
            return
        if self.future is not None:
            if final:  # written when this write ends (module docstring)
                self._final = (term, reason)
            else:
                self.count_event("checkpoints_skipped_busy")
            return
        if self.retry is not None:  # this save takes the place of a pending retry
            self.retry.cancel()
            self.retry = None
        snap = self.learner.snapshot(term)  # views of the live buffers
        if final and self.written == (snap.step, term):  # (a timed or leader's write of the
            self.reporter.info(f"the checkpoint of step {snap.step} is the final one",  # last
                               event="checkpoint", step=snap.step, term=term, final=True)
            return  # step: at 1B, 12 GB written again for nothing)
        self.count += 1
        progress = self.fault(self.count)
        started = self.now()
        self.plan.save_started(started)
        self._idle.clear()
        self.reading(True)

        def write() -> Path:
            try:
                return self.write(snap, progress=progress)
            finally:
                self._idle.set()

        future = asyncio.get_running_loop().run_in_executor(self.executor, write)
        self.future = future

        def done(f: asyncio.Future) -> None:
            self.future = None
            self.plan.save_finished(self.now() - started,
                                    not f.cancelled() and f.exception() is None)
            try:
                self._report(f, snap.step, term, reason, final)
            finally:
                self.reading(False)
                after, self._after = self._after, []
                for call in after:  # e.g. a step that ended during the write: applied now
                    call()
                if self._final is not None:  # then the final save that waited
                    (term_, reason_), self._final = self._final, None
                    with contextlib.suppress(RuntimeError):  # the I/O thread is gone
                        self.save(term_, final=True, reason=reason_)

        future.add_done_callback(done)

    def _report(self, f: asyncio.Future, step: int, term: int, reason: str,
                final: bool) -> None:
        try:
            path = f.result()
        except Exception as exc:
            self._failed(exc, term, reason, final)
            return
        self.failures, self.lost, self.written = 0, False, (step, term)
        self.reporter.info(f"checkpoint {path.name} written in {self.seconds:.2f}s "
                           f"({reason}{', final' if final else ''})", event="checkpoint",
                           path=str(path), step=step, term=term, final=final)

    def _failed(self, exc: Exception, term: int, reason: str, final: bool) -> None:
        """Say in one line why the write failed; retry later (not a final save: the node is
        stopping)."""
        self.count_event("checkpoints_failed")
        self.failures += 1
        why = describe_os_error(exc) if isinstance(exc, OSError) else str(exc) or repr(exc)
        delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (self.failures - 1))
        then = "" if final else f"; training goes on, retrying in {delay:.0f}s"
        self.reporter.warn(f"checkpoint not written ({reason}): {why}{then}",
                           event="checkpoint_failed", reason=reason, failures=self.failures)
        self.lost = self.lost or final
        if not final:
            self.retry = asyncio.get_running_loop().call_later(
                delay, self._retry, term, reason.removesuffix(", retry") + ", retry")

    def lost_final(self, step: int, code: int = 0) -> int:
        """The exit code of a stopped run whose own reason gave `code`: `code` if not 0, else 1
        when its final checkpoint failed and none was written since (its last steps are lost;
        scripts must be able to tell: said in one line either way), else 0."""
        if not self.lost:
            return code
        self.reporter.error("the final checkpoint was not written (see the warning above): the "
                            "steps since the last checkpoint written are lost",
                            event="final_checkpoint_lost", step=step)
        return code or 1

    def _retry(self, term: int, reason: str) -> None:
        self.retry = None
        with contextlib.suppress(RuntimeError):  # the I/O thread is gone: the node stopped
            self.save(term, reason=reason)

    @property
    def writing(self) -> bool:
        """A write reads the learner's buffers (until its result reaches the loop)."""
        return self.future is not None

    @property
    def deferred(self) -> bool:
        """Calls wait for the write in progress to end."""
        return bool(self._after)

    def after_write(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn`, made to wait (on the loop) for the end of a write in progress, if any."""
        def call(*args: Any) -> None:
            if self.writing:
                self._after.append(lambda: fn(*args))
            else:
                fn(*args)
        return call

    def block_until_written(self) -> None:
        """Block the calling thread until no write reads the learner's buffers (before
        something overwrites them out of turn: adopting a fetched checkpoint)."""
        self._idle.wait()

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` s for the write in progress, if any."""
        if self.future is not None:
            await asyncio.wait([self.future], timeout=timeout)
            await asyncio.sleep(0)  # let its done-callback report it


def record_term(path: Path, term: int, warn: Callable[..., None]) -> None:
    """Keep the highest term this node led (its term floor after a restart). A full disk is
    one warning: the node leads on, and learns the swarm's term back from its peers."""
    try:
        write_small(path, f"{term}\n".encode())
    except OSError as exc:
        warn(f"cannot record the led term {term}: {describe_os_error(exc)}",
             event="term_not_recorded")


def read_term(path: Path) -> int:
    """The term kept by `record_term` (0 when absent, unreadable, or not below the protocol's
    2^52: a damaged file of 2^60 made the node lead in a term no peer accepts, write it into
    a checkpoint and stop with an internal error at every start; one of exactly 2^52 made it
    lead at 2^52 + 1, which its checkpoints cannot carry: it leads one above what it read)."""
    try:  # (a FIFO there would hang the start; NotRegularFile and TooLarge are ValueErrors)
        term = int(read_regular(path, 64).decode().strip() or 0)
    except (OSError, ValueError, UnicodeError):
        return 0
    return term if 0 <= term < MAX_TERM else 0
