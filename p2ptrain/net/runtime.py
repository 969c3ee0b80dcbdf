"""The asyncio runtime of a networked node: it drives the sans-IO `Node` for real.

One event loop owns the node: every `node.handle(now, event)` call happens on it, with `now`
from the loop's monotonic clock. Around it: the HTTP server (server.py), one client session
(outbox.py), mDNS and static seeds (discovery.py), a worker thread for training steps (numpy
releases the GIL in its kernels, so requests are answered while a Pi computes) and one for
checkpoint writes. Actions map to I/O:

    Send            POST it (outbox), or return it in the response to the request it answers
    RunStep         learner.compute_gradient() in the step thread -> StepDone (+ Evaluated)
    SaveCheckpoint  copy the replica on the loop, write it in the I/O thread (leader)
    LeaderChanged   persist the led term; release the join fetch; say it
    Finished        stop after the final checkpoint

Join flow (joinflow.py): before its first step the node waits for the leader and fetches its
latest checkpoint (verified), unless it already holds a newer one or none comes within
`node.join_timeout`. Stopping (DESIGN.md): on SIGINT/SIGTERM finish the step in flight, resign
and leave, write the local resume state if it fits in the grace period, send the mDNS
goodbye, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import signal
import socket
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from p2ptrain.config import Config, swarm_options
from p2ptrain.fsutil import atomic_write_bytes
from p2ptrain.identity import load_or_create
from p2ptrain.net import joinflow
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.discovery import format_peer, host_ipv4_addresses, parse_peer
from p2ptrain.net.outbox import Outbox
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.saving import Saver
from p2ptrain.net.server import build_app
from p2ptrain.proto import wire
from p2ptrain.proto.config import PRESETS
from p2ptrain.proto.events import (
    Discovered,
    Evaluated,
    Finished,
    LeaderChanged,
    Leave,
    MemberDown,
    MemberUp,
    Received,
    Refused,
    RemoteError,
    RunStep,
    SaveCheckpoint,
    Send,
    StepDone,
    Tick,
)
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.node import Node, NodeConfig
from p2ptrain.proto.records import MemberInfo
from p2ptrain.report import Reporter, human_count
from p2ptrain.solo import UserError, _fault_hook, prepare
from p2ptrain.swarm import Swarm

TERM_FILE = "term"  # highest term this node led: its term_floor after a restart


def guess_address(bind: str, toward: str | None = None) -> str:
    """The address peers should use: the bound one, else the source address of the route
    toward the first seed (its network is the peers' network), else of the default route,
    else any non-loopback address (an offline LAN)."""
    if bind not in ("", "0.0.0.0", "::"):
        return bind
    targets = [toward] if toward else []
    for target in [*targets, "192.0.2.1"]:  # TEST-NET: picks a route, sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))
                return s.getsockname()[0]
            except (OSError, UnicodeError):
                continue
    return host_ipv4_addresses()[0]


def gossip_config(cfg: Config) -> GossipConfig:
    codec = cfg["gossip.codec"]
    params = {"fraction": cfg["gossip.fraction"]} if codec in ("topk", "randomk") else {}
    return GossipConfig(fanout=cfg["gossip.fanout"], codec=codec, codec_params=params,
                        average_every=cfg["gossip.average_every"],
                        averaging=cfg["gossip.averaging"],
                        subset_fraction=cfg["gossip.subset_fraction"],
                        average_part=cfg["gossip.average_part"],
                        max_staleness_samples=cfg["gossip.max_staleness_samples"])


class Runtime:
    """One networked node; `await Runtime(cfg, reporter, swarm).run()` returns the exit code."""

    def __init__(self, cfg: Config, reporter: Reporter, swarm: Swarm):
        self.cfg, self.reporter, self.swarm = cfg, reporter, swarm
        self.state_dir = Path(cfg["node.state_dir"]).expanduser()
        self.open_routes = cfg["net.open_routes"]
        self.bucket = TokenBucket.mbps(cfg["net.max_upload_mbps"])
        self.node: Node | None = None
        self.phase = "starting"
        self.stats: dict[str, int] = {}
        self.stop_reason: str | None = None
        self.exit_code = 0
        self._signalled = False
        self._stop = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._step_future: asyncio.Future | None = None
        self._parked: int | None = None  # a RunStep held back until the join fetch is done
        self._last_eval = 0.0
        self.eval_loss: float | None = None
        self._first_exchange = False
        self.outbound_only = cfg["net.outbound_only"]
        self.inbound = 0  # authenticated messages peers sent us (reachability)
        self._unreached_since: float | None = None
        self._switch_pending = False

    # -- small helpers ------------------------------------------------------------------------

    def now(self) -> float:
        return self.loop.time() - self.t0

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def swarm_options(self) -> dict[str, Any]:
        return swarm_options(self.cfg)

    def status(self) -> dict[str, Any]:
        doc = self.node.status() if self.node is not None else {"node_id": self.node_id}
        doc.update(swarm=self.swarm.name, swarm_id=self.swarm.swarm_id,
                   addr=self.me.addr if self.node else None,
                   outbound_only=self.outbound_only,
                   upload_bytes=self.bucket.sent,
                   runtime={**self.stats, **(self.outbox.stats if self.node else {})})
        if self.phase in ("starting", "fetching", "stopping"):
            doc["phase"] = self.phase
        return doc

    # -- the node ------------------------------------------------------------------------------

    def handle(self, event, reply_to: str | None = None) -> tuple[list, list[Send]]:
        """Feed one event to the node and perform its actions; Sends that answer `reply_to`'s
        request are returned instead of posted."""
        node = self.node
        if node is None or self.exit_code:
            return [], []
        try:
            actions = node.handle(self.now(), event)
        except Exception as exc:  # a bug: stop loudly rather than run on with a broken node
            self.reporter.warn("internal error in the protocol node:\n"
                               + "".join(traceback.format_exception(exc)), event="internal_error")
            self.exit_code = 1
            self.request_stop(f"internal error ({exc!r})")
            return [], []
        replies: list[Send] = []
        for action in actions:
            kind = type(action)
            if kind is Send:
                if reply_to is not None and action.reply and action.to == reply_to:
                    replies.append(action)
                else:
                    self.outbox.send(action)
            elif kind is RunStep:
                self._start_step(action.step)
            elif kind is SaveCheckpoint:
                self.saver.save(action.term, final=action.final, reason="leader")
            elif kind is LeaderChanged:
                self._leader_changed(action)
            elif kind is Finished:
                self.request_stop("the run reached train.total_samples")
            elif kind is MemberUp:
                self.reporter.info(f"member {action.info.node_id[:12]} up at {action.info.addr} "
                                   f"({action.info.device_class})", event="member_up",
                                   node_id=action.info.node_id, addr=action.info.addr)
            elif kind is MemberDown:
                word = "left" if action.left else "down"
                self.reporter.info(f"member {action.node_id[:12]} {word}", event="member_down",
                                   node_id=action.node_id, left=action.left)
            elif kind is Refused:
                self.reporter.warn(f"{'refused by' if action.by_peer else 'refusing'} "
                                   f"{action.addr}: {action.reason}", event="refused",
                                   addr=action.addr, keys=list(action.keys))
            elif kind is RemoteError:
                self.count("remote_errors")
        self._arm_timer()
        return actions, replies

    def deliver(self, envelope, remote: str, sender: str, size: int
                ) -> tuple[int, list[bytes], str]:
        """A message that arrived in a request: (HTTP status, reply frames, refusal reason)."""
        self.inbound += 1
        # where the sender accepts requests (the TCP peer address has an ephemeral port)
        addr = envelope.header.addr or remote
        actions, replies = self.handle(Received(addr, envelope), reply_to=sender)
        self._note_first_exchange()
        status, reason = 200, ""
        for action in actions:
            if type(action) is RemoteError and action.sender in (sender, None):
                status, reason = 400, action.reason
            elif type(action) is Refused and not action.by_peer:
                status, reason = 409, action.reason
        return status, [wire.encode(s.envelope) for s in replies], reason

    def on_frames(self, addr: str, frames: list[bytes]) -> None:
        """Frames that came back in a response: each is a message from that peer."""
        for frame in frames:
            self.handle(Received(addr, frame))
        self._note_first_exchange()

    def _note_first_exchange(self) -> None:
        """Say once when the first complete peer gradient arrived (a join-time figure)."""
        if self._first_exchange or self.node is None:
            return
        if self.node.trainer.stats.get("gradient_complete", 0) > 0:
            self._first_exchange = True
            self.reporter.info(f"first gradient from a peer after {self.now():.2f}s",
                               event="first_exchange", elapsed_s=self.now())

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.node.next_deadline() if self.node is not None else None
        if deadline is not None and not self._stop.is_set():
            self._timer = self.loop.call_at(self.t0 + max(deadline, self.now()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.handle(Tick())

    # -- steps -----------------------------------------------------------------------------------

    def _start_step(self, step: int) -> None:
        if self._switch_pending:  # at a step boundary: the new node asks for its own step
            self._become_outbound_only()
            return
        if self.joining.holding or self._stop.is_set():
            self._parked = step
            return
        every = self.cfg["eval.every_seconds"]
        evaluate = every > 0 and self.now() - self._last_eval >= every
        future = self.loop.run_in_executor(self.step_pool, self._compute, evaluate)
        self._step_future = future
        future.add_done_callback(lambda f: self._step_done(step, f))

    def release_step(self) -> None:
        """The join flow is done: run the step held back meanwhile."""
        if self._parked is not None and not self._stop.is_set():
            step, self._parked = self._parked, None
            self._start_step(step)

    def _compute(self, evaluate: bool) -> tuple[float, float | None]:
        loss = self.learner.compute_gradient()
        return loss, (self.learner.evaluate() if evaluate else None)

    def _step_done(self, step: int, future: asyncio.Future) -> None:
        self._step_future = None
        try:
            loss, eval_loss = future.result()
        except Exception as exc:  # a bug or out of memory: stop rather than spin
            self.reporter.warn(f"training step failed: {exc!r}", event="step_failed")
            self.request_stop(f"training step failed: {exc}")
            return
        if eval_loss is not None:
            self._last_eval = self.now()
        self.handle(StepDone(step, float(loss)))
        if eval_loss is not None:
            self.eval_loss = eval_loss
            self.handle(Evaluated(eval_loss))
            self.reporter.info(f"held-out loss {eval_loss:.3f} at step {self.learner.step} "
                               f"({self.now():.0f}s)", event="eval", step=self.learner.step,
                               eval_loss=eval_loss, elapsed_s=self.now())
        self._check_bounds()
        every_steps = self.cfg["checkpoint.every_steps"]
        every_s = self.cfg["checkpoint.every_seconds"]
        if not self.node.is_leader and (
                (every_steps and self.learner.step % every_steps == 0)
                or (every_s and self.now() - self.saver.last_started >= every_s)):
            self.saver.save(self.node.control.term, reason="local")

    def _check_bounds(self) -> None:
        steps, duration = self.cfg["train.steps"], self.cfg["train.duration"]
        if steps and self.learner.step - self.first_step >= steps:
            self.request_stop(f"--steps {steps} reached")
        elif duration and self.now() >= duration:
            self.request_stop(f"--duration {duration:g}s reached")

    # -- checkpoints -----------------------------------------------------------------------------

    def _leader_changed(self, action: LeaderChanged) -> None:
        if action.leader == self.node_id:
            atomic_write_bytes(self.state_dir / TERM_FILE, f"{action.term}\n".encode())
            self.reporter.info(f"leading the swarm (term {action.term})", event="leader",
                               leader=action.leader, term=action.term)
            self.saver.save(action.term, reason="new leader")
        elif action.leader is None:
            self.reporter.info("no leader: lease lapsed", event="leader", leader=None,
                               term=action.term)
        else:
            self.reporter.info(f"leader is {action.leader[:12]} (term {action.term})",
                               event="leader", leader=action.leader, term=action.term)
        self.joining.leader_changed(action.leader)

    # -- lifecycle -------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.reporter.info(f"{reason}: stopping", event="stopping", reason=reason)
        self._stop.set()

    def _on_signal(self, signum: int) -> None:
        if self._signalled:
            self.reporter.warn("second signal: exiting at once")
            os._exit(130)
        self._signalled = True
        self.request_stop(signal.Signals(signum).name)

    def _member_info(self, hw, addr: str) -> MemberInfo:
        model = self.learner.model
        fields = {"arch": json.dumps(model.arch(), sort_keys=True),
                  "layout": model.space.fingerprint(), "vocab": str(model.vocab_size),
                  "mode": "full"}
        return MemberInfo(self.node_id, addr, hw.device_class, float(hw.matmul_gflops),
                          self.cfg["node.priority"], self.learner.fingerprint, fields,
                          self.outbound_only)

    def _make_node(self) -> Node:
        cfg = self.cfg
        gossip = gossip_config(cfg)
        term_floor = joinflow.read_int(self.state_dir / TERM_FILE)
        seed = int.from_bytes(hashlib.sha256(
            f"{self.node_id}/{self.identity.incarnation}".encode()).digest()[:8], "big")
        return Node(self._proto_config(), self.me, self.learner,
                    NodeConfig(gossip=gossip, min_peers=cfg["node.min_peers"],
                               join_timeout=cfg["node.join_timeout"]),
                    incarnation=self.identity.incarnation, now=self.now(),
                    rng=random.Random(seed), term_floor=term_floor)

    def check_reachability(self) -> None:
        """Called every second: a node that reaches its peers but that no peer has reached
        for three member-list periods sits behind NAT or a firewall -- it turns
        outbound-only (DESIGN.md, Reachability) at the next step boundary."""
        if self.outbound_only or self.node is None or self.inbound > 0 or self._stop.is_set():
            return
        if self.outbox.stats.get("sent", 0) == 0:
            self._unreached_since = None
            return
        if self._unreached_since is None:
            self._unreached_since = self.now()
        window = 3 * self.node.control.config.sync_interval
        if self.now() - self._unreached_since >= window and not self._switch_pending:
            self._switch_pending = True
            self.reporter.warn(f"no peer has reached this node in {window:g}s although it "
                               f"reaches them (NAT or firewall?): switching to outbound-only",
                               event="outbound_only_detected")
            if self._step_future is None:
                self._become_outbound_only()

    def _become_outbound_only(self) -> None:
        """Rejoin under a new incarnation as an outbound-only member (a member's info is
        fixed for one incarnation), keeping the learner and the known peers."""
        self._switch_pending = False
        self.outbound_only = True
        old = self.node
        self.identity = load_or_create(self.state_dir)  # bumps the incarnation
        self.signer = Signer(self.signer.key, self.node_id, self.identity.incarnation)
        self.outbox.signer = self.signer
        self.me = dataclasses.replace(self.me, outbound_only=True)
        self._parked = None  # the old node's step; the new node asks for its own
        self.node = self._make_node()
        self.node.hold = self.joining.holding
        for state, _, info in old.control.members().values():
            if state == "alive":
                self.handle(Discovered(info.addr))
        self.handle(Tick())
        self.reporter.info(f"now outbound-only (incarnation {self.identity.incarnation})",
                           event="outbound_only", incarnation=self.identity.incarnation)

    def _proto_config(self):
        preset = PRESETS[self.cfg["net.timing"]]
        every = self.cfg["checkpoint.every_seconds"]
        return preset.with_(checkpoint_interval=every if every > 0 else 1e12)

    async def run(self) -> int:
        cfg, reporter = self.cfg, self.reporter
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.identity, self.learner, self.ckroot, hw = prepare(cfg, reporter, alone=False)
        self.first_step = self.learner.step
        self.saver = Saver(self, _fault_hook(os.environ.get("P2PTRAIN_FAULT"), reporter))
        self.step_pool = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-step")
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-io")
        mac_key = derive_mac_key(self.swarm.key)
        self.auth = ServerAuth(mac_key, self.node_id)
        self.signer = Signer(mac_key, self.node_id, self.identity.incarnation)
        if self.swarm.is_demo:
            reporter.warn("joining the public DEMO swarm: anyone on this LAN may join it; "
                          "for a real fleet run `p2ptrain init` and join with its token")
        runner = web.AppRunner(build_app(self), access_log=None, handler_cancellation=True,
                               shutdown_timeout=min(5.0, cfg["node.grace_seconds"] / 4))
        await runner.setup()
        self.session: aiohttp.ClientSession | None = None
        discovery = None
        try:
            site = web.TCPSite(runner, cfg["net.bind"], cfg["net.port"], reuse_address=True)
            try:
                await site.start()
            except OSError as exc:
                raise UserError(f"cannot listen on {cfg['net.bind']}:{cfg['net.port']}: "
                                f"{exc.strerror or exc}") from None
            port = runner.addresses[0][1]
            try:
                seeds = [p for p in cfg["net.peers"].split(",") if p.strip()]
                toward = parse_peer(seeds[0])[0] if seeds else None
                host, adv_port = parse_peer(cfg["net.advertise"] or guess_address(
                    cfg["net.bind"], toward), port)
            except ValueError as exc:
                raise UserError(f"--advertise: {exc}") from None
            addr = format_peer(host, adv_port)
            self.me = self._member_info(hw, addr)
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=4),
                auto_decompress=False)
            self.control_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=8),
                auto_decompress=False)
            self.outbox = Outbox(self.session, self.control_session, self.signer, self.bucket,
                                 self.on_frames, reporter)
            self.joining = joinflow.JoinFlow(self, cfg["node.join_timeout"])
            self.node = self._make_node()
            self.node.hold = True  # until the join flow is done
            self.phase = "running"
            reporter.info(f"node {self.node_id[:12]} listening on {cfg['net.bind']}:{port}, "
                          f"advertised as {addr}, swarm {self.swarm.name!r} "
                          f"(id {self.swarm.swarm_id})", event="listening", addr=addr,
                          port=port, swarm_id=self.swarm.swarm_id, node_id=self.node_id)
            for s in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(s, self._on_signal, s)
            discovery = await joinflow.start_discovery(self, port, host)
            self.handle(Tick())
            tasks = [self.loop.create_task(joinflow.seed_loop(self)),
                     self.loop.create_task(joinflow.every_second(self.check_reachability)),
                     self.loop.create_task(joinflow.progress_loop(self)),
                     self.loop.create_task(self.joining.run())]
            await self._stop.wait()
            for task in [*tasks, self.joining.task]:
                if task is not None:
                    task.cancel()
            await self._shutdown()
        finally:
            for s in (signal.SIGINT, signal.SIGTERM):
                self.loop.remove_signal_handler(s)
            if self._timer is not None:
                self._timer.cancel()
            if discovery is not None:
                await discovery.close()
            if self.session is not None:
                await self.outbox.close()
                await self.session.close()
                await self.control_session.close()
            await runner.cleanup()
            self.step_pool.shutdown(wait=False, cancel_futures=True)  # a step in flight is
            self.io_pool.shutdown(wait=True)  # waited for above; a checkpoint write must end
        reporter.info(f"stopped: {self.stop_reason}; {self.learner.step} steps, "
                      f"{human_count(self.learner.samples)} samples", event="stopped",
                      reason=self.stop_reason, step=self.learner.step, eval_loss=self.eval_loss)
        return self.exit_code

    async def _shutdown(self) -> None:
        self.phase = "stopping"
        started = self.now()
        grace = self.cfg["node.grace_seconds"]
        if self._step_future is not None:
            await asyncio.wait([self._step_future], timeout=grace / 2)
            await asyncio.sleep(0)  # let its done-callback hand the step to the node
        self.handle(Leave())
        await self.outbox.drain(min(2.0, grace / 4))
        await self.saver.wait(grace / 2)
        left = grace - (self.now() - started)
        if self.learner.step > self.first_step:
            if left > 2 * self.saver.seconds + 1:
                self.saver.save(self.node.control.term, final=True, reason="stopping")
                await self.saver.wait(left)
            else:
                self.reporter.warn("no time left in the grace period; keeping the last "
                                   "checkpoint")
