"""Joining: the node's first step is held back until the leader is known and its latest
checkpoint is fetched and verified (fetch.py), or found unnecessary.

If this node already holds a replica with at least as many swarm samples, it keeps its own
and catches up by averaging; if the leader has no checkpoint yet, or none answers within
`node.join_timeout`, it trains from what it has (the initial weights are the same on every
node: they come from `train.seed`). `JoinFlow` owns the joining state (waiting -> fetching ->
done) and nothing else: it is told when the leader changes, asks its driver to fetch through
a callable, and reports the end through another. A driver: sleeps and I/O are allowed here.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from p2ptrain import checkpoint
from p2ptrain.net.auth import Signer
from p2ptrain.net.fetch import FetchError, fetch_latest

if TYPE_CHECKING:
    from p2ptrain.learner import Learner
    from p2ptrain.report import Reporter

FETCHED_DIR = "fetched"  # under the state dir: checkpoints fetched from leaders
FETCH_DEADLINE = 600.0  # s for the whole join-time fetch (a stalled leader cannot hold us)


class JoinFlow:
    """Holds the first step back until the leader's checkpoint is in (or not needed)."""

    def __init__(self, timeout: float, own_id: str, addr_of: Callable[[str], str | None],
                 fetch: Callable[[str, str], Awaitable[str]], on_done: Callable[[str], None]):
        self.timeout, self.own_id = timeout, own_id
        self.addr_of = addr_of  # a member's address, None if unknown
        self.fetch = fetch  # (leader, addr) -> why training starts with the weights it has
        self.on_done = on_done  # (why) -> None: training may start
        self.state = "waiting"  # waiting -> fetching -> done
        self.task: asyncio.Task | None = None

    @property
    def holding(self) -> bool:
        return self.state != "done"

    def leader_changed(self, leader: str | None) -> None:
        if self.state != "waiting" or leader is None:
            return
        if leader == self.own_id:
            self.done("this node leads")
            return
        addr = self.addr_of(leader)
        if addr is None:
            return
        self.state = "fetching"
        self.task = asyncio.get_running_loop().create_task(self._fetch(leader, addr))

    async def run(self) -> None:
        """Give up waiting for a leader after the join timeout."""
        await asyncio.sleep(self.timeout)
        if self.state == "waiting":
            self.done(f"no leader answered within {self.timeout:g}s")

    def done(self, why: str) -> None:
        if self.state == "done":
            return
        self.state = "done"
        self.on_done(why)

    async def _fetch(self, leader: str, addr: str) -> None:
        why = "fetch failed"
        try:
            why = await self.fetch(leader, addr)
        finally:
            self.done(why)


async def adopt_leader_checkpoint(session: aiohttp.ClientSession, signer: Signer,
                                  state_dir: Path, learner: Learner, io: Executor,
                                  replica_replaced: Callable[[], None], reporter: Reporter,
                                  leader: str, addr: str) -> str:
    """Fetch the leader's latest checkpoint into `<state_dir>/fetched` and load its weights
    into `learner` when it is newer than the local replica; says what happened."""
    root = state_dir / FETCHED_DIR
    try:
        reporter.info(f"fetching the leader's checkpoint from {addr}", event="fetching",
                      leader=leader, addr=addr)
        path = await asyncio.wait_for(
            fetch_latest(session, f"http://{addr}", signer, root, expected_leader=leader),
            FETCH_DEADLINE)
        manifest = await asyncio.get_running_loop().run_in_executor(
            io, checkpoint.read_manifest, path)
        if manifest.get("fingerprint") != learner.fingerprint:
            why = "the leader's checkpoint is of another model (kept the local weights)"
        elif manifest["swarm_samples"] <= learner.count.total:
            why = (f"the local replica is as new as the leader's checkpoint "
                   f"({learner.count.total:,} swarm samples)")
        else:
            learner.restore(path, manifest, with_state=False)
            replica_replaced()
            why = (f"weights from the leader's checkpoint {path.name} "
                   f"({manifest['swarm_samples']:,} swarm samples)")
        for old in checkpoint.list_checkpoints(root)[1:]:
            shutil.rmtree(old, ignore_errors=True)
        return why
    except FetchError as exc:
        return f"no checkpoint from the leader ({exc}); starting from the local weights"
    except TimeoutError:
        return (f"the leader's checkpoint did not arrive within {FETCH_DEADLINE:g}s; "
                f"starting from the local weights (averaging catches up)")
    except checkpoint.CheckpointError as exc:
        return f"the fetched checkpoint is unusable ({exc}); starting from the local weights"


def read_int(path: Path) -> int:
    """An integer kept in a small file (0 when absent or unreadable)."""
    try:
        return max(0, int(path.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0
