"""The runtime's side jobs: joining (wait for the leader, fetch its checkpoint), finding peers
(mDNS, static and DNS seeds), and the progress line.

Join: the node's first `RunStep` is held back until the leader is known and its latest
checkpoint is fetched and verified (fetch.py). If this node already holds a replica with at
least as many swarm samples, it keeps its own and catches up by averaging; if the leader has
no checkpoint yet, or none answers within `node.join_timeout`, it trains from what it has (the
initial weights are the same on every node: they come from `train.seed`). A driver: clock,
sleeps and I/O are allowed here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain import checkpoint
from p2ptrain.net.discovery import Discovery, resolve_seeds
from p2ptrain.net.fetch import FetchError, fetch_latest
from p2ptrain.proto.events import Discovered
from p2ptrain.report import human_count

if TYPE_CHECKING:
    from p2ptrain.net.runtime import Runtime

SEED_INTERVAL = 30.0  # s between re-resolutions of the static/DNS seeds
FETCHED_DIR = "fetched"  # under the state dir: checkpoints fetched from leaders
FETCH_DEADLINE = 600.0  # s for the whole join-time fetch (a stalled leader cannot hold us)


def read_int(path: Path) -> int:
    """An integer kept in a small file (0 when absent or unreadable)."""
    try:
        return max(0, int(path.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


class JoinFlow:
    """Holds the first step back until the leader's checkpoint is in (or not needed)."""

    def __init__(self, rt: Runtime, timeout: float):
        self.rt, self.timeout = rt, timeout
        self.state = "waiting"  # waiting -> fetching -> done
        self.task: asyncio.Task | None = None

    @property
    def holding(self) -> bool:
        return self.state != "done"

    def leader_changed(self, leader: str | None) -> None:
        if self.state != "waiting" or leader is None:
            return
        if leader == self.rt.node_id:
            self.done("this node leads")
            return
        member = self.rt.node.control.member(leader)
        if member is None:
            return
        self.state = "fetching"
        self.rt.phase = "fetching"
        self.task = asyncio.get_running_loop().create_task(self._fetch(leader, member[2].addr))

    async def run(self) -> None:
        """Give up waiting for a leader after the join timeout."""
        await asyncio.sleep(self.timeout)
        if self.state == "waiting":
            self.done(f"no leader answered within {self.timeout:g}s")

    def done(self, why: str) -> None:
        if self.state == "done":
            return
        self.state = "done"
        self.rt.node.hold = False
        if self.rt.phase in ("starting", "fetching"):
            self.rt.phase = "running"
        self.rt.reporter.info(f"training starts at step {self.rt.learner.step}: {why}",
                              event="training_starts", reason=why)
        self.rt.release_step()

    async def _fetch(self, leader: str, addr: str) -> None:
        rt = self.rt
        learner = rt.learner
        root = rt.state_dir / FETCHED_DIR
        why = "fetch failed"
        try:
            rt.reporter.info(f"fetching the leader's checkpoint from {addr}", event="fetching",
                             leader=leader, addr=addr)
            path = await asyncio.wait_for(
                fetch_latest(rt.session, f"http://{addr}", rt.signer, root,
                             expected_leader=leader), FETCH_DEADLINE)
            manifest = await asyncio.get_running_loop().run_in_executor(
                rt.io_pool, checkpoint.read_manifest, path)
            if manifest.get("fingerprint") != learner.fingerprint:
                why = "the leader's checkpoint is of another model (kept the local weights)"
            elif manifest["swarm_samples"] <= learner.count.total:
                why = (f"the local replica is as new as the leader's checkpoint "
                       f"({learner.count.total:,} swarm samples)")
            else:
                learner.restore(path, manifest, with_state=False)
                rt.node.replica_replaced()
                why = (f"weights from the leader's checkpoint {path.name} "
                       f"({manifest['swarm_samples']:,} swarm samples)")
            for old in checkpoint.list_checkpoints(root)[1:]:
                shutil.rmtree(old, ignore_errors=True)
        except FetchError as exc:
            why = f"no checkpoint from the leader ({exc}); starting from the local weights"
        except TimeoutError:
            why = (f"the leader's checkpoint did not arrive within {FETCH_DEADLINE:g}s; "
                   f"starting from the local weights (averaging catches up)")
        except checkpoint.CheckpointError as exc:
            why = f"the fetched checkpoint is unusable ({exc}); starting from the local weights"
        finally:
            self.done(why)


async def start_discovery(rt: Runtime, port: int, host: str) -> Discovery | None:
    """mDNS for this swarm (when enabled): every peer it finds is handed to the node."""
    if not rt.cfg["net.mdns"]:
        return None
    loop = asyncio.get_running_loop()

    def found(addr: str, node_id: str) -> None:
        if node_id != rt.node_id:
            loop.call_soon_threadsafe(rt.handle, Discovered(addr))

    loopback = rt.cfg["net.bind"].startswith("127.")
    try:
        ipaddress.ip_address(host)
        addresses = [host]
    except ValueError:  # a DNS name: let zeroconf advertise the host's addresses
        addresses = None
    discovery = None
    try:
        discovery = Discovery(swarm_id=rt.swarm.swarm_id, node_id=rt.node_id, port=port,
                              addresses=addresses, device_class=rt.me.device_class[:64] or "?",
                              on_found=found,
                              interfaces=[rt.cfg["net.bind"]] if loopback else None,
                              advertise=not rt.cfg["net.outbound_only"])
        await discovery.start()
    except Exception as exc:  # no multicast here: say so, go on with the seeds
        rt.reporter.warn(f"mDNS unavailable ({exc}); using seeds only", event="mdns_failed")
        if discovery is not None:
            await discovery.close()
        return None
    return discovery


async def every_second(job) -> None:
    """Run `job()` once a second until cancelled."""
    while True:
        await asyncio.sleep(1.0)
        job()


async def seed_loop(rt: Runtime) -> None:
    """Hand the static and DNS seeds to the node now and every SEED_INTERVAL seconds."""
    seeds = [s.strip() for s in rt.cfg["net.peers"].split(",") if s.strip()]
    if not seeds:
        return
    said: set[str] = set()
    while True:
        resolved, failed = await resolve_seeds(seeds, 7100)
        for problem in failed:
            if problem not in said:
                said.add(problem)
                rt.reporter.warn(f"seed {problem}", event="seed_unresolved")
        for addr in resolved:
            if addr != rt.me.addr:
                rt.handle(Discovered(addr))
        await asyncio.sleep(SEED_INTERVAL)


async def progress_loop(rt: Runtime) -> None:
    """One progress line every `log.every_seconds`: training, peers, leader, traffic."""
    every = rt.cfg["log.every_seconds"]
    last_in = last_out = 0
    last_t = rt.now()
    while True:
        await asyncio.sleep(every)
        node, learner = rt.node, rt.learner
        members = node.control.members()
        alive = sum(1 for state, _, _ in members.values() if state == "alive")  # peers
        bytes_in, bytes_out = sum(node.bytes_in.values()), rt.bucket.sent
        now = rt.now()
        span = max(now - last_t, 1e-9)
        rate_in, rate_out = (bytes_in - last_in) / span, (bytes_out - last_out) / span
        last_in, last_out, last_t = bytes_in, bytes_out, now
        leader = node.control.leader
        lead = "none" if leader is None else ("me" if leader == rt.node_id else leader[:12])
        total = learner.total_samples
        pct = 100.0 * learner.count.total / max(total, 1)
        loss = "-" if node.loss is None else f"{node.loss:.3f}"
        held = "-" if rt.eval_loss is None else f"{rt.eval_loss:.3f}"
        rt.reporter.info(
            f"step {learner.step:>6} | loss {loss} | held-out {held} | peers {alive}/"
            f"{len(members)} | leader {lead} (term {node.control.term}) | swarm "
            f"{human_count(learner.count.total)} samples ({pct:.1f}%) | up "
            f"{human_count(rate_out)}B/s down {human_count(rate_in)}B/s | {rt.phase}",
            event="progress", step=learner.step, loss=node.loss, eval_loss=rt.eval_loss,
            peers=alive, leader=leader, term=node.control.term,
            swarm_samples=learner.count.total, samples=learner.samples,
            up_bytes_per_s=rate_out, down_bytes_per_s=rate_in, phase=rt.phase)
