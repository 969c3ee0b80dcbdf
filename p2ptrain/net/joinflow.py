"""The runtime's side of joining: it performs the node's `FetchCheckpoint` actions and answers
`CheckpointFetched`. The decisions -- when to fetch, from whom, whether to adopt, when to try
again -- are the sans-IO node's (p2ptrain/proto/joining.py); this file only moves bytes.

A fetch lands in `<state dir>/fetched/` (verified chunk by chunk, resumable: a partial download
of the same checkpoint is continued by the next attempt). When the join is over, partial
downloads and all but the newest fetched checkpoint are removed. A driver: I/O is allowed.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from p2ptrain import checkpoint
from p2ptrain.net.auth import Signer
from p2ptrain.net.fetch import PARTIAL_PREFIX, FetchError, NoCheckpoint, fetch_latest
from p2ptrain.proto import CheckpointFetched, FetchCheckpoint

if TYPE_CHECKING:
    from p2ptrain.report import Reporter

FETCHED_DIR = "fetched"  # under the state dir: checkpoints fetched from leaders
FETCH_DEADLINE = 600.0  # s for one join-time fetch (a stalled leader cannot hold us)


class JoinFetcher:
    """Runs one join-time fetch at a time; `answer(CheckpointFetched)` gets its outcome."""

    def __init__(self, session: aiohttp.ClientSession, signer: Signer, state_dir: Path,
                 fingerprint: str, io: Executor, answer: Callable[[CheckpointFetched], None],
                 reporter: Reporter, judge: Callable[[Path], tuple[float, float]]):
        self.session, self.signer, self.io = session, signer, io
        self.judge = judge  # path -> (its held-out loss on a fixed batch, our replica's)
        self.root = state_dir / FETCHED_DIR
        self.fingerprint, self.answer, self.reporter = fingerprint, answer, reporter
        self.manifests: dict[str, dict] = {}  # path -> manifest of what was fetched
        self.task: asyncio.Task | None = None

    def start(self, action: FetchCheckpoint) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(action))

    async def _run(self, action: FetchCheckpoint) -> None:
        self.answer(await self._fetch(action))

    async def _fetch(self, action: FetchCheckpoint) -> CheckpointFetched:
        addr = action.sources[0]
        self.reporter.info(f"fetching the leader's checkpoint from {addr} (attempt "
                           f"{action.attempt})", event="fetching", leader=action.leader,
                           addr=addr, attempt=action.attempt)
        try:
            path = await asyncio.wait_for(
                fetch_latest(self.session, f"http://{addr}", self.signer, self.root,
                             expected_leader=action.leader), FETCH_DEADLINE)
            manifest = await asyncio.get_running_loop().run_in_executor(
                self.io, checkpoint.read_manifest, path)
        except NoCheckpoint as exc:
            return CheckpointFetched(None, reason=str(exc), retry=False)
        except FetchError as exc:
            reason = str(exc)
        except TimeoutError:
            reason = f"the checkpoint did not arrive within {FETCH_DEADLINE:g}s"
        except checkpoint.CheckpointError as exc:
            reason = f"the fetched checkpoint is unusable ({exc})"
        else:
            if manifest.get("fingerprint") != self.fingerprint:
                return CheckpointFetched(None, reason="the leader's checkpoint is of another "
                                         "model", retry=False)
            self.manifests[str(path)] = manifest
            loss, own = await asyncio.get_running_loop().run_in_executor(self.io, self.judge,
                                                                         path)
            return CheckpointFetched(str(path), int(manifest["swarm_samples"]), loss=loss,
                                     own_loss=own, counts=dict(manifest["swarm_count"]))
        self.reporter.warn(f"checkpoint fetch failed: {reason}", event="fetch_failed",
                           attempt=action.attempt)
        return CheckpointFetched(None, reason=reason, retry=True)

    def clean(self) -> None:
        """The join is over: drop partial downloads and all but the newest checkpoint."""
        if not self.root.is_dir():
            return
        for partial in self.root.glob(f"{PARTIAL_PREFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)
        for old in checkpoint.list_checkpoints(self.root)[1:]:
            shutil.rmtree(old, ignore_errors=True)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

