"""The runtime's side of joining: it performs the node's `FetchCheckpoint` actions and answers
`CheckpointFetched`. The decisions -- when to fetch, from whom, whether to adopt, when to try
again -- are the sans-IO node's (p2ptrain/proto/joining.py); this file only moves bytes.

A join fetches the weights only (a joiner starts fresh optimiser moments) from every source
the node named -- the leader and the members that advertise the same checkpoint -- plus any
that start advertising it while the fetch runs (`holders`). It lands in
`<state dir>/fetched/`, verified chunk by chunk, resumable, and is served to later joiners
from its first verified chunk (the shelf). When the join is over, partial downloads and all
but the newest fetched checkpoint are removed. A fetch ends (to be tried again from whoever
leads then) once another node leads in this node's view (`leader_now`): a leader paused
mid-serve held its joiners for minutes, past the chunks' read timeouts, while a new one led
within seconds. A driver: I/O is allowed.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from p2ptrain import checkpoint
from p2ptrain.checkpoint.manifest import checkpoint_name
from p2ptrain.fsutil import remove_orphans
from p2ptrain.net.auth import Signer
from p2ptrain.net.fetch import PARTIAL_PREFIX, FetchError, NoCheckpoint, fetch_checkpoint
from p2ptrain.net.fetchprogress import FetchProgress
from p2ptrain.net.partial import OLD_PREFIX
from p2ptrain.net.shelf import Shelf
from p2ptrain.proto import CheckpointFetched, FetchCheckpoint, Holding, Holds

if TYPE_CHECKING:
    from p2ptrain.learner import Learner
    from p2ptrain.report import Reporter

FETCHED_DIR = "fetched"  # under the state dir: checkpoints fetched from leaders
LEADER_POLL = 2.0  # s between looks at who leads while a join-time fetch runs
FETCH_DEADLINE = 600.0  # s for one join-time fetch (a stalled leader cannot hold us)


class JoinFetcher:
    """Runs one join-time fetch at a time; `answer(CheckpointFetched)` gets its outcome. Also
    tells the node what this node holds (`answer(Holds)`) whenever the shelf changes."""

    def __init__(self, session: aiohttp.ClientSession, signer: Callable[[], Signer],
                 state_dir: Path, fingerprint: str, io: Executor, answer: Callable[[Any], Any],
                 reporter: Reporter, judge: Callable[[Path], tuple[float, float]],
                 between_steps: Callable[[], Awaitable[None]], shelf: Shelf,
                 holders: Callable[[str, str], list[str]],
                 leader_now: Callable[[], str | None] = lambda: None):
        # the node's signer of the moment (a new one after the switch to outbound-only)
        self.session, self.signer, self.io, self.shelf = session, signer, io, shelf
        self.holders = holders  # (leader, digest) -> addresses of members that hold it
        self.leader_now = leader_now  # who leads in the node's view (None: nobody known)
        self.judge = judge  # path -> (its held-out loss on a fixed batch, our replica's)
        self.between_steps = between_steps  # returns once no step runs (judge's buffer free)
        self.root = state_dir / FETCHED_DIR
        self.fingerprint, self.answer, self.reporter = fingerprint, answer, reporter
        self.manifests: dict[str, checkpoint.Manifest] = {}  # path -> what was fetched
        self.task: asyncio.Task | None = None
        self.loop = asyncio.get_running_loop()
        self.advertising: asyncio.Task | None = None
        self.told: Holding | None = None  # what the node was last told we hold
        shelf.changed = self.advertise_soon

    def advertise_soon(self) -> None:
        """The shelf changed (any thread): tell the node what we hold, from the event loop."""
        self.loop.call_soon_threadsafe(self._advertise)

    def readvertise(self) -> None:
        self.told = None
        self.advertise_soon()

    def _advertise(self) -> None:
        if self.advertising is None or self.advertising.done():
            self.advertising = self.loop.create_task(self._tell())

    async def _tell(self) -> None:
        held = await self.loop.run_in_executor(self.io, self.shelf.advertised)
        m = None if held is None else held.manifest
        holding = None if m is None else Holding(m.term, m.step, m.swarm_samples, m.digest)
        if holding != self.told:
            self.told = holding
            self.answer(Holds(holding))

    def start(self, action: FetchCheckpoint) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(action))

    async def _run(self, action: FetchCheckpoint) -> None:
        """Fetch and answer -- always: the node waits for this answer in `fetching` with no
        deadline of its own, so a defect escaping the fetch must still end the attempt."""
        try:
            answer = await self._fetch(action)
        except Exception as exc:  # (CancelledError is no Exception: a shutdown stays one)
            reason = f"{type(exc).__name__}: {exc}"
            self.reporter.warn(f"checkpoint fetch failed: {reason}", event="fetch_failed",
                               attempt=action.attempt)
            answer = CheckpointFetched(None, reason=reason, retry=True)
        self.answer(answer)

    async def _fetch(self, action: FetchCheckpoint) -> CheckpointFetched:
        sources = list(action.sources)
        others = f" and {len(sources) - 1} other holders" if len(sources) > 1 else ""
        self.reporter.info(f"fetching the leader's checkpoint from {sources[0]}{others} "
                           f"(attempt {action.attempt})", event="fetching",
                           leader=action.leader, addr=sources[0], sources=len(sources),
                           attempt=action.attempt)
        bar = FetchProgress("fetching the leader's checkpoint", say=lambda text: self.reporter.info(
            text, event="fetch_progress"))
        try:
            fetched = await self._while_leading(action.leader, asyncio.wait_for(
                fetch_checkpoint(self.session, sources, self.signer, self.root,
                                 expected_leader=action.leader, files=(checkpoint.MODEL_FILE,),
                                 progress=bar, shelf=self.shelf,
                                 more_sources=lambda digest: self.holders(action.leader,
                                                                          digest),
                                 prefer=None if action.prefer is None
                                 else checkpoint_name(*action.prefer),
                                 fingerprint=self.fingerprint),
                FETCH_DEADLINE))
        except NoCheckpoint as exc:
            return CheckpointFetched(None, reason=str(exc), retry=False)
        except FetchError as exc:
            reason = str(exc)
        except TimeoutError:
            reason = f"the checkpoint did not arrive within {FETCH_DEADLINE:g}s"
        else:
            manifest, path = fetched.manifest, fetched.path
            if manifest.fingerprint != self.fingerprint:
                return CheckpointFetched(None, reason="the leader's checkpoint is of another "
                                         "model", retry=False)
            for addr, why in fetched.dropped.items():
                self.reporter.warn(f"checkpoint source {addr} dropped: {why}",
                                   event="fetch_source_dropped", addr=addr)
            self.manifests[str(path)] = manifest
            await self.between_steps()  # a step taken while joining: the judge needs its buffer
            loss, own = await asyncio.get_running_loop().run_in_executor(self.io, self.judge,
                                                                         path)
            if not math.isfinite(loss):  # weights that do not load or are not finite: the
                self._drop(path)  # node refuses them; nobody else is served them, nor kept
            return CheckpointFetched(str(path), manifest.swarm_samples, loss=loss,
                                     own_loss=own, counts=manifest.swarm_count)
        finally:
            bar.close()
        self.reporter.warn(f"checkpoint fetch failed: {reason}", event="fetch_failed",
                           attempt=action.attempt)
        return CheckpointFetched(None, reason=reason, retry=True)

    async def _while_leading(self, leader: str, work: Awaitable[Any]) -> Any:
        """`work`'s result, unless another node comes to lead first: then FetchError (and the
        work is cancelled; what it fetched stays, resumable)."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=LEADER_POLL))[0]:
                if self.leader_now() not in (leader, None):
                    raise FetchError(f"{leader[:12]} no longer leads: the swarm's new leader "
                                     f"is asked")
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _drop(self, path: Path) -> None:
        held = self.shelf.find(path.name) if self.shelf is not None else None
        if held is not None and held.path == path:
            self.shelf.unregister(held)
        shutil.rmtree(path, ignore_errors=True)

    def adopt(self, path: str, learner: Learner) -> None:
        """Load a fetched checkpoint's weights now (the node decided they are newer)."""
        try:
            learner.restore(Path(path), self.manifests[path], with_state=False,
                            with_count=False)  # the node merged the bounded counter
        except checkpoint.CheckpointError as exc:
            self.reporter.warn(f"cannot load the fetched checkpoint ({exc}); training from the "
                               f"local weights", event="adopt_failed")

    def clean(self) -> None:
        """The join is over: drop partial downloads and all but the newest checkpoint."""
        clean_fetched(self.root)

    def cancel(self) -> None:
        for task in (self.task, self.advertising):
            if task is not None:
                task.cancel()


def clean_fetched(root: Path) -> None:
    """Drop from `root` partial downloads, checkpoints a killed fetch set aside while it
    replaced them, and all but the newest checkpoint."""
    if not root.is_dir():
        return
    for partial in root.glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(partial, ignore_errors=True)
    remove_orphans(root, OLD_PREFIX)
    for old in checkpoint.list_checkpoints(root)[1:]:
        shutil.rmtree(old, ignore_errors=True)
