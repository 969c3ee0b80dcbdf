"""The asyncio runtime of a networked node: it drives the sans-IO `Node` for real.

One event loop owns the node and calls `node.handle(now, event)` with its monotonic clock.
Actions become I/O: Send -> a POST (outbox.py; an averaging request's, once over, ->
Unanswered) or the response to the request it answers; RunStep -> a step in the step thread
(steps.py) -> StepDone; SaveCheckpoint -> a write in the I/O thread (saving.py);
LeaderChanged -> the led term persisted; FetchCheckpoint -> a fetch (joinflow.py) ->
CheckpointFetched; AdoptCheckpoint -> the weights loaded; Finished -> stop. Around it: the
HTTP server (server.py), mDNS and seeds (discovery.py), the progress line (progress.py), the
alone loop's schedule (housekeeping.py). On SIGINT/SIGTERM: finish the step in flight, resign
and leave, write the resume state if it fits, say the mDNS goodbye, exit 0; a second signal
exits at once. A failed step exits 1 (2: the data is damaged), its resume state written; a
diverged run 1, nothing more written (housekeeping.py). Helpers get narrow callables only."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import os
import random
import signal
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from p2ptrain import checkpoint, proto
from p2ptrain.housekeeping import Housekeeping
from p2ptrain.identity import IdentityError, load_or_create
from p2ptrain.net import stopsignals
from p2ptrain.net.auth import Life, ServerAuth, Signer
from p2ptrain.net.discovery import advertised_address, seed_loop, start_mdns
from p2ptrain.net.joinflow import FETCHED_DIR, JoinFetcher
from p2ptrain.net.outbox import Outbox
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.progress import (
    FirstExchange,
    every_second,
    progress_loop,
    say_leader,
    say_membership,
)
from p2ptrain.net.reachability import Reachability
from p2ptrain.net.rotation import keyring_of
from p2ptrain.net.saving import Saver, read_term, record_term
from p2ptrain.net.server import Limits, Served, bases_of, build_app, listen
from p2ptrain.net.shelf import Shelf, shelved
from p2ptrain.net.steps import Stepper, step_failure
from p2ptrain.net.watch import Watch
from p2ptrain.proto import LeaderChanged, Node, Send
from p2ptrain.report import Reporter
from p2ptrain.settings import Settings
from p2ptrain.startup import env_fault_hook, member_info, prepare
from p2ptrain.swarm import Swarm

TERM_FILE = "term"  # highest term this node led: its term_floor after a restart


class Runtime:
    """One networked node; `await Runtime(...).run()` returns the exit code."""

    def __init__(self, settings: Settings, swarm_options: dict[str, Any], reporter: Reporter,
                 swarm: Swarm):
        self.settings, self.reporter, self.swarm = settings, reporter, swarm
        self.swarm_options = swarm_options  # what GET /v1/config serves
        self.state_dir = Path(settings.host.state_dir).expanduser()
        self.bucket = TokenBucket.mbps(settings.net.max_upload_mbps)
        self.node: Node | None = None
        self.stats: dict[str, int] = {}
        self.stop_reason: str | None = None
        self.exit_code = 0
        # broken: internal error; switch pending: to outbound-only, at the next step boundary
        self._signalled = self._stopping = self.broken = self._switch_pending = False
        self._stop = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._first = FirstExchange(reporter)  # says when the first peer gradient came
        self.outbound_only = settings.net.outbound_only
        self.inbound = 0  # authenticated messages peers sent us (reachability)

    def now(self) -> float:
        return self.loop.time() - self.t0

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def phase(self) -> str:
        if self._stopping or self.node is None:
            return "stopping" if self._stopping else "starting"
        return "fetching" if self.node.join.state == "fetching" else "running"

    def health(self) -> dict[str, Any]:
        return {"ok": True, "phase": self.phase, "node_id": self.node_id}

    def swarm_config(self) -> dict[str, Any]:  # GET /v1/config
        return {"swarm": self.swarm.name, "options": self.swarm_options}

    def status(self) -> dict[str, Any]:  # GET /v1/status, /metrics, the progress line
        doc = self.node.status() if self.node is not None else {"node_id": self.node_id}
        doc.update(swarm=self.swarm.name, swarm_id=self.swarm.swarm_id,
                   addr=self.me.addr if self.node else None, outbound_only=self.outbound_only,
                   upload_bytes=self.bucket.sent, total_samples=self.learner.total_samples,
                   runtime={**self.stats, **(self.outbox.stats if self.node else {})},
                   sent_by_kind=self.outbox.sent.document() if self.node else {},
                   steps=self.steps.stats(), average_eval_loss=self.steps.average_eval)
        if self.phase != "running":
            doc["phase"] = self.phase
        return doc

    def handle(self, event, reply_to: str | None = None) -> tuple[list, list[Send]]:
        """Feed one event to the node and perform its actions; Sends that answer `reply_to`'s
        request are returned instead of posted."""
        node = self.node
        if node is None or self.broken:
            return [], []
        try:
            actions = node.handle(self.now(), event)
        except Exception as exc:  # a bug: stop loudly rather than run on with a broken node
            self.reporter.warn("internal error in the protocol node:\n"
                               + "".join(traceback.format_exception(exc)), event="internal_error")
            self.broken = True
            self.request_stop(f"internal error ({exc!r})", code=1)
            return [], []
        replies: list[Send] = []
        for action in actions:
            kind = type(action)
            if kind is Send:
                if reply_to is not None and action.reply and action.to == reply_to:
                    replies.append(action)
                else:
                    self.outbox.send(action)
            elif kind is proto.RunStep:
                self._start_step(action.step)
            elif kind is proto.SaveCheckpoint:
                self.saver.save(action.term, final=action.final, reason="leader")
            elif kind is LeaderChanged:
                self._leader_changed(action)
            elif kind is proto.Finished:
                self.request_stop("the run reached train.total_samples")
            elif kind is proto.RemoteError:
                self.count("remote_errors")
            elif kind is proto.FetchCheckpoint:
                self.fetcher.start(action)
            elif kind is proto.AdoptCheckpoint:
                self.saver.block_until_written()  # a write may be reading the weights
                self.fetcher.adopt(action.path, self.learner)
            elif kind is proto.Joined:
                self._joined(action.reason)
            elif kind in (proto.MemberUp, proto.MemberDown, proto.Refused, proto.Offender):
                say_membership(self.reporter, action)
        self._arm_timer()
        return actions, replies

    def deliver(self, envelope, remote: str, sender: str, size: int
                ) -> tuple[int, list[bytes], str]:
        """A message that arrived in a request: (HTTP status, reply frames, refusal reason)."""
        self.inbound += 1
        # where the sender accepts requests (the TCP peer address has an ephemeral port)
        addr = envelope.header.addr or remote
        actions, replies = self.handle(proto.Received(addr, envelope), reply_to=sender)
        self._first.check(self.node, self.now())
        status, reason = 200, ""
        for action in actions:
            if type(action) is proto.RemoteError and action.sender in (sender, None):
                status, reason = 400, action.reason
            elif type(action) is proto.Refused and not action.by_peer:
                status, reason = 409, action.reason
        status = 200 if replies and status == 400 else status  # a refusal with an answer (a
        return status, self.outbox.encode_replies(replies), reason  # declined average)

    def on_frames(self, addr: str, frames: list[bytes]) -> None:
        """Frames that came back in a response: each is a message from that peer."""
        for frame in frames:
            self.handle(proto.Received(addr, frame))
        self._first.check(self.node, self.now())

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        deadline = self.node.next_deadline() if self.node is not None else None
        self._timer = None if deadline is None or self._stop.is_set() else self.loop.call_at(
            self.t0 + max(deadline, self.now()), lambda: self.handle(proto.Tick()))

    def _start_step(self, step: int) -> None:
        if self._switch_pending and self._become_outbound_only():  # at a step boundary:
            return  # the new node asks for its own step
        bound = self.plan.stop_reason(self.now(), self.learner.step)  # --steps is exact
        if bound:  # (--duration can run out while joining: no step ends to notice it)
            self.request_stop(bound)
        self.steps.start(step, hold=self._stop.is_set() or bound is not None)

    def _joined(self, why: str) -> None:
        self.fetcher.clean()  # partial downloads, older fetched checkpoints
        self.reporter.info(f"training starts at step {self.learner.step}: {why}",
                           event="training_starts", reason=why)

    def _step_failed(self, exc: BaseException) -> None:  # the final checkpoint is written:
        reason, detail, code = step_failure(exc)  # a failed step never reached the weights
        self.reporter.warn(f"{reason}: {detail}", event="step_failed")
        self.request_stop(reason, code=code)

    def _step_done(self, step: int, loss: float, eval_loss: float | None) -> None:
        skipped = self.node.skipped
        self.handle(proto.StepDone(step, loss))
        learner, now = self.learner, self.now()
        if why := self.plan.diverged(learner.step, self.node.skipped > skipped, eval_loss):
            self.saver.closed = why  # the weights are no use: nothing more is written
            return self.request_stop(why, code=1)
        if eval_loss is not None:
            self.handle(proto.Evaluated(eval_loss))
            self.reporter.evaluated(learner.step, eval_loss, self.steps.average_eval, now)
        if bound := self.plan.stop_reason(now, learner.step):
            self.request_stop(bound)
        if not self.node.is_leader and self.plan.save_due(now, learner.step):
            self.saver.save(self.node.control.term, reason="local")

    def _leader_changed(self, action: LeaderChanged) -> None:
        say_leader(self.reporter, action, self.node_id, self._stopping)
        if action.leader == self.node_id:
            record_term(self.state_dir / TERM_FILE, action.term, self.reporter.warn)
            if self.plan.lead_save(self.now()):
                self.saver.save(action.term, reason="new leader")

    def _make_node(self, joined: bool = False) -> Node:
        seed = int.from_bytes(hashlib.sha256(
            f"{self.node_id}/{self.identity.incarnation}".encode()).digest()[:8], "big")
        return Node(self.settings.proto(), self.me, self.learner, self.settings.node,
                    incarnation=self.identity.incarnation, now=self.now(), secret=os.urandom(32),
                    rng=random.Random(seed), joined=joined, term_floor=max(
                        read_term(self.state_dir / TERM_FILE), self.resumed_term))

    def _check_reachability(self) -> None:
        """Once a second: peers never reach us, we reach them -> outbound-only next step."""
        if self.outbound_only or self._stop.is_set() or not self.reach.unreachable(
                self.now(), self.inbound, self.outbox.stats.get("sent", 0)):
            return
        self._switch_pending = True
        self.reporter.warn(f"no peer has reached this node in {self.reach.window:g}s although "
                           f"it reaches them (NAT or firewall?): switching to outbound-only",
                           event="outbound_only_detected")
        if self.steps.future is None and not self.saver.deferred:  # else at the boundary
            self._become_outbound_only()

    def _become_outbound_only(self) -> bool:
        """Rejoin as an outbound-only member under a new incarnation (a member's info is fixed
        for one), keeping learner and peers; False if it cannot be kept (a read-only disk)."""
        self._switch_pending, old = False, self.node
        try:
            self.identity = load_or_create(self.state_dir)  # bumps the incarnation
        except IdentityError as exc:
            self.reporter.warn(f"cannot go outbound-only: {exc}", event="outbound_only_failed")
            return False
        self.outbound_only = True
        self.signer = Signer(self.signer.keys, Life(self.identity))
        self.outbox.signer = self.signer
        self.me = dataclasses.replace(self.me, outbound_only=True)
        self.steps.parked = None  # the old node's step; the new node asks for its own
        if old.trainer.outer is not None:  # the round's progress and what it owes go along
            self.learner.outer_saved = old.trainer.outer.handover()
        self.node = self._make_node(joined=old.join.done)
        if self.saver.writing:  # the new node must hold its writes too
            self.handle(proto.Reading(True))
        self.fetcher.readvertise()  # the new node knows nothing of what we hold
        for state, _, info in old.control.members().values():
            if state == "alive":
                self.handle(proto.Discovered(info.addr))
        self.handle(proto.Tick())
        self.reporter.info(f"now outbound-only (incarnation {self.identity.incarnation})",
                           event="outbound_only", incarnation=self.identity.incarnation)
        return True

    def request_stop(self, reason: str, code: int = 0) -> None:
        self.exit_code = self.exit_code or code
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

    def _setup(self, reporter: Reporter) -> None:
        """Everything but sockets: the learner, the schedule, the saver, the credentials."""
        ready = prepare(self.settings, reporter, alone=False)
        self.identity, self.learner, self.ckroot, self.hw, self.resumed_term = (
            ready.identity, ready.learner, ready.ckroot, ready.hw, ready.term)
        self.plan = Housekeeping(self.settings, 0.0, self.learner.step)
        self.reach = Reachability(3 * self.settings.proto().sync_interval)
        self.step_pool = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-step")
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-io")
        self.shelf = Shelf(lambda: [self.ckroot, self.state_dir / FETCHED_DIR])
        write = shelved(functools.partial(checkpoint.save, self.ckroot, identity=self.identity,
                                          keep=self.settings.checkpoint.keep), self.shelf)
        self.saver = Saver(self.learner, write, self.io_pool, self.now, reporter, self.count,
                           env_fault_hook(reporter), self.plan,
                           lambda active: self.handle(proto.Reading(active)))
        self.steps = Stepper(self.learner, self.step_pool, self.plan, self.now,
                             self._step_done, self._step_failed, self.saver.after_write)
        keys = keyring_of(self.swarm, self.settings.swarm, self.state_dir, reporter)
        life = Life(self.identity)  # this life's X25519 key: the pair keys' (session.py)
        self.auth, self.signer = ServerAuth(keys, life), Signer(keys, life)

    async def run(self) -> int:
        net, reporter = self.settings.net, self.reporter
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.watch = Watch(reporter, self.now)  # the dashboard's history, from here on
        self._setup(reporter)
        app = build_app(Served(self, self.auth, self.bucket, net.open_routes, Limits.of(net),
                               self.watch.document), self.shelf, bases_of(self.learner.model))
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                               shutdown_timeout=min(5.0, self.settings.host.grace_seconds / 4))
        await runner.setup()
        self.outbox: Outbox | None = None
        discovery, signals = None, {}
        try:
            port = await listen(runner, net.bind, net.port)
            seeds = net.seeds()
            host, addr = advertised_address(net.advertise, net.bind, port, seeds)
            self.me = member_info(self.learner, self.hw, addr, self.settings.host.priority,
                                  self.outbound_only, self.settings.gossip)
            self.outbox = Outbox.open(self.signer, self.bucket, self.on_frames, reporter,
                                      self.settings.node, net.refused_seconds, self.request_stop)
            self.outbox.on_unanswered = lambda *ask: self.handle(proto.Unanswered(*ask))
            self.fetcher = JoinFetcher(self.outbox.session, lambda: self.signer, self.state_dir,
                                       self.learner.fingerprint, self.io_pool, self.handle,
                                       reporter, self.learner.judge_checkpoint, self.steps.idle,
                                       self.shelf, lambda *key: list(self.node.sources_of(*key)),
                                       lambda: self.node.control.leader)
            self.node = self._make_node()
            reporter.info(f"node {self.node_id[:12]} listening on {net.bind}:{port}, "
                          f"advertised as {addr}, swarm {self.swarm.name!r} "
                          f"(id {self.swarm.swarm_id})", event="listening", addr=addr,
                          port=port, swarm_id=self.swarm.swarm_id, node_id=self.node_id)
            signals = stopsignals.catch(self.loop, self._on_signal)
            found = lambda a: self.handle(proto.Discovered(a))  # noqa: E731
            warn = functools.partial(reporter.warn, event="discovery")
            if net.mdns:
                discovery = await start_mdns(self.swarm.swarm_id, self.node_id, port, host,
                                             self.me.device_class, net.bind,
                                             not net.outbound_only, found, warn,
                                             self.signer.keys.accepts_swarm_id)
            self.handle(proto.Tick())
            self.fetcher.advertise_soon()  # what we hold from earlier runs
            tasks = [self.loop.create_task(c) for c in (
                seed_loop(seeds, addr, found, warn, self.outbox.seeds),
                every_second(self._check_reachability), self.watch.sample_loop(self.status),
                progress_loop(self.settings.log.every_seconds, self.status, self.now, reporter))]
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            self.fetcher.cancel()
            await self._shutdown()
        finally:
            stopsignals.release(self.loop, signals)
            if self._timer is not None:
                self._timer.cancel()
            if discovery is not None:
                await discovery.close()
            if self.outbox is not None:
                await self.outbox.close()
            await runner.cleanup()
            self.watch.close()
            self.step_pool.shutdown(wait=False, cancel_futures=True)  # a step in flight is
            self.io_pool.shutdown(wait=True)  # waited for above; a checkpoint write must end
        reporter.stopped(self.stop_reason, self.learner.step, self.learner.samples,
                         self.node.eval_loss if self.node else None)
        return self.saver.lost_final(self.learner.step, self.exit_code)

    async def _shutdown(self) -> None:
        self._stopping = True
        started = self.now()
        grace = self.settings.host.grace_seconds
        if self.steps.future is not None:  # and the write that would hold back its result
            await asyncio.wait([f for f in (self.steps.future, self.saver.future) if f],
                               timeout=grace / 2)
            await asyncio.sleep(0)  # let the done-callbacks hand the step to the node
        self.handle(proto.Leave())
        await self.outbox.drain(min(2.0, grace / 4))
        await self.saver.wait(grace / 2)
        if self.plan.final_save_fits(self.now(), started, self.learner.step):
            self.saver.save(self.node.control.term, final=True, reason="stopping")
            await self.saver.wait(self.plan.grace_left(self.now(), started))
        elif self.learner.step > self.plan.first_step:
            self.reporter.warn("no time left in the grace period; keeping the last checkpoint")

