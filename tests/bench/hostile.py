"""A hostile member of a swarm for the chaos soak (issue 13): it holds the swarm key, joins like
any member, and then abuses what the key lets it say (issue 13 items 8-10 and 13).

    python -m tests.bench.hostile --config swarm.toml --state-dir DIR --port P \\
        --peer HOST:PORT ... --seed N          (the swarm token in P2PTRAIN_TOKEN)

It is built from the project's own parts, so every message it sends is well formed and
authenticated exactly as an honest node's: `prepare` (identity, learner, the member info and
fingerprint of the swarm's configuration), the sans-IO `Control` (membership: it answers
probes and member-list exchanges, so the others keep it alive), the node's HTTP server
(`server.build_app`: hello, MAC checks, the checkpoint routes), the `Outbox` (hello, `Signer`,
`wire.encode`) and the `ParameterAverager` (averaging snapshots that match the swarm's plan).
Only the *content* is hostile:

- always on: every averaging request an honest node sends it is answered with a snapshot of
  all 65,504 (the largest finite fp16) -- an AverageReply (item 10); its checkpoint route
  serves a "wrecked" checkpoint signed by its own identity: all weights 65,504, term 2^52 and
  half of `train.total_samples` as its swarm count, so a joiner that fetches it from the
  leader of the moment adopts it (item 13);
- at random times (a `random.Random(seed)` picks the attack, its target and its length; the
  times are seconds after it first saw a live member), one of:
    claim      claim leadership at term 2^52 and heartbeat it for 5-15 s, then fall silent
               (items 8 and 13: while it reigns, joiners fetch the wrecked checkpoint)
    relay      a relayed leader view naming an honest member as leader at term 2^52 (item 8)
    left       a forged `left` update for an honest member at incarnation 2^52 (item 8)
    samples    a forged sample count of 2^53 or exactly train.total_samples, in a header and
               in the G-counter of a member-list exchange (item 9)
    average    an AverageRequest whose snapshot is all 65,504 (item 10)
  Each attack is one JSON line on stdout (`{"event": "attack", ...}`).

It never trains. Its own control plane never claims: its Claim/Heartbeat/Resign/Yield bodies
are dropped, and outside a reign its headers relay no leader view. SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from p2ptrain import checkpoint
from p2ptrain.codecs import DEFAULT_CHUNK
from p2ptrain.config import resolve, settings_of
from p2ptrain.net.auth import Life, ServerAuth, Signer, derive_mac_key
from p2ptrain.net.outbox import Outbox
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.server import Served, build_app, listen
from p2ptrain.proto import wire
from p2ptrain.proto.control import Control
from p2ptrain.proto.events import Deliver, Discovered, Received, RemoteError, Send, Tick
from p2ptrain.proto.gossip.averaging import ParameterAverager, read_snapshot
from p2ptrain.proto.gossip.config import flops_per_coordinate
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.gossip.seeds import Seeds
from p2ptrain.proto.messages import (
    Claim,
    Envelope,
    Heartbeat,
    Notify,
    Resign,
    SyncRequest,
    Yield,
)
from p2ptrain.proto.records import ALIVE, LEFT, MAX_EPOCH, MAX_TERM, LeaderView, Update
from p2ptrain.report import Reporter
from p2ptrain.startup import member_info, prepare
from p2ptrain.swarm import parse_token

FP16_MAX = 65504.0
ATTACKS = ("claim", "relay", "left", "samples", "average")
ELECTION_BODIES = (Claim, Heartbeat, Resign, Yield)


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": round(time.time(), 3), **fields}), flush=True)


class Hostile:
    """The hostile member: a `server.Host` (deliver, status, ...) and its attack loop."""

    def __init__(self, config: str, state_dir: Path, port: int, seeds: list[str], seed: int,
                 first_delay: float, gap: tuple[float, float]):
        self.swarm = parse_token(os.environ["P2PTRAIN_TOKEN"])
        cfg = resolve(config, {}, {"node.state_dir": str(state_dir), "net.port": port,
                                   "net.bind": "127.0.0.1", "net.mdns": False,
                                   "log.format": "json"})
        self.settings = settings_of(cfg)
        self.seeds, self.port = seeds, port
        self.rng = random.Random(seed)
        self.first_delay, self.gap = first_delay, gap
        self.reporter = Reporter("json", out=sys.stdout, err=sys.stdout)
        ready = prepare(self.settings, self.reporter, alone=False)
        self.identity, self.learner, self.hw = ready.identity, ready.learner, ready.hw
        self.ckroot = ready.ckroot
        self.total = self.learner.total_samples
        self.stats: dict[str, int] = {}
        self.attacks: list[dict[str, Any]] = []
        self.reign: LeaderView | None = None
        self.reign_until = 0.0
        # the poisoned replica: every value the largest finite fp16
        self.poison = np.full_like(self.learner.params, FP16_MAX)
        n = int(self.poison.shape[0])
        plan = self.settings.gossip.averaging_plan(n, flops_per_coordinate(self.learner.model,
                                                                           n))
        self.averager = ParameterAverager(plan, self.settings.node.chunk_elems or DEFAULT_CHUNK)
        self.plan = plan
        self.chains = Seeds(self.node_id, os.urandom(32))  # its side of the pairs' seed chains
        self._write_wrecked_checkpoint()

    # -- the wrecked checkpoint (item 13) ---------------------------------------------------------

    def _write_wrecked_checkpoint(self) -> None:
        learner = self.learner
        np.copyto(learner.params, self.poison)
        learner.count.merge({self.identity.node_id: self.total // 2})
        snap = learner.snapshot(MAX_EPOCH)
        path = checkpoint.save(self.ckroot, snap, self.identity, keep=1)
        say("wrecked_checkpoint", path=str(path), term=MAX_EPOCH,
            swarm_samples=learner.count.total, value=FP16_MAX)

    # -- server.Host ------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def now(self) -> float:
        return self.loop.time() - self.t0

    def health(self) -> dict[str, Any]:
        return {"ok": True, "phase": "hostile", "node_id": self.node_id}

    def swarm_config(self) -> dict[str, Any]:
        return {"swarm": self.swarm.name, "options": {}}

    def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "hostile": True, "stats": self.stats,
                "attacks": len(self.attacks), "reigning": self.reign is not None,
                "members": [{"node_id": i, "state": s}
                            for i, (s, _, _) in self.ctl.members().items()]}

    def deliver(self, envelope: Envelope, remote: str, sender: str, size: int
                ) -> tuple[int, list[bytes], str]:
        addr = envelope.header.addr or remote
        status, reason, replies = 200, "", []
        for action in self._handle(Received(addr, envelope)):
            if type(action) is Send and action.reply and action.to == sender:
                replies.append(wire.encode(self._forge(action).envelope))
            elif type(action) is Send:
                self._post(action)
            elif type(action) is Deliver:
                reply = self._gossip(action, sender)
                if reply is not None:
                    replies.append(wire.encode(reply.envelope))
            elif type(action) is RemoteError and action.sender in (sender, None):
                status, reason = 400, action.reason
        return status, replies, reason

    # -- protocol plumbing ------------------------------------------------------------------------

    def _handle(self, event) -> list:
        try:
            return self.ctl.handle(self.now(), event)
        except Exception as exc:  # noqa: BLE001 -- a hostile member keeps going
            self.count("control_errors")
            say("control_error", error=repr(exc))
            return []

    def _run(self, event) -> None:
        for action in self._handle(event):
            if type(action) is Send:
                self._post(action)

    def on_frames(self, addr: str, frames: list[bytes]) -> None:
        for frame in frames:
            self._run(Received(addr, frame))

    def _forge(self, send: Send) -> Send:
        """What this member really sends: its reign's view (or none) in every header."""
        header = send.envelope.header
        view = self.reign
        if view is None and header.view is not None and header.view.leader != self.node_id:
            view = header.view  # relaying the honest leader's view is harmless
        return dataclasses.replace(send, envelope=Envelope(
            dataclasses.replace(header, view=view), send.envelope.body))

    def _post(self, send: Send) -> None:
        if isinstance(send.envelope.body, ELECTION_BODIES):
            self.count("own_election_dropped")
            return
        self.outbox.send(self._forge(send))

    def _send(self, to: str, addr: str, body, **header: Any) -> None:
        """Send `body` to one member with header fields replaced (the forgery)."""
        send = self._forge(self.ctl.wrap(to, addr, body))
        envelope = Envelope(dataclasses.replace(send.envelope.header, **header), body)
        self.outbox.send(dataclasses.replace(send, envelope=envelope))

    def _gossip(self, action: Deliver, sender: str) -> Send | None:
        """Averaging requests are answered with the poisoned snapshot (item 10)."""
        body = action.envelope.body
        if isinstance(body, AverageReply) and body.part == 0:  # follow the seed chains, so
            self.chains.answered(sender, body.seed, body.grant, body.reseed)  # its requests
            return None  # reach the distance guard
        if not isinstance(body, AverageRequest):
            self.count(f"ignored_{type(body).__name__}")
            return None
        try:
            snap = read_snapshot(body.chunks)
            self.averager.begin(self.poison.copy(), body.seed, body.part)
            chunks = tuple(bytes(c) for c in self.averager.messages(
                bytes.fromhex(self.node_id), snap.swarm_samples))
        except Exception as exc:  # noqa: BLE001
            self.averager.abort()
            self.count("average_reply_failed")
            say("average_reply_failed", error=repr(exc))
            return None
        self.averager.abort()
        self.count("poisoned_average_replies")
        reply = AverageReply(body.seed, body.step, self.ctl.sample_counts(), chunks,
                             body.part, body.parts)
        return self._forge(self.ctl.wrap(sender, action.addr, reply, reply=True))

    def honest(self) -> list[tuple[str, Any]]:
        """Live members (id, info) that accept connections."""
        return sorted(((i, info) for i, (state, _, info) in self.ctl.members().items()
                       if state in ("alive", "suspect") and not info.outbound_only),
                      key=lambda x: x[0])

    # -- attacks ----------------------------------------------------------------------------------

    def _record(self, kind: str, **fields: Any) -> None:
        entry = {"kind": kind, "at": round(self.now(), 2), **fields}
        self.attacks.append(entry)
        self.count(f"attack_{kind}")
        say("attack", **entry)

    def attack(self, kind: str, members: list[tuple[str, Any]]) -> float:
        """Run one attack; the seconds it occupies (a reign lasts)."""
        rng, me = self.rng, self.ctl.me
        victim_id, victim = members[rng.randrange(len(members))]
        if kind == "claim":
            length = rng.uniform(5.0, 15.0)
            self.reign = LeaderView(MAX_EPOCH, me.node_id, me.priority, me.capability, 0)
            self.reign_until = self.now() + length
            self._record(kind, term=MAX_EPOCH, seconds=round(length, 2))
            for i, info in members:
                self._send(i, info.addr, Claim())
            return length
        if kind == "relay":
            view = LeaderView(MAX_EPOCH, victim_id, victim.priority, victim.capability, 1)
            self._record(kind, term=MAX_EPOCH, named_leader=victim_id)
            for i, info in members:
                self._send(i, info.addr, Notify(), view=view)
        elif kind == "left":
            reporter = victim_id if rng.random() < 0.5 else me.node_id
            update = Update(LEFT, victim_id, MAX_EPOCH, reporter)
            self._record(kind, victim=victim_id, incarnation=MAX_EPOCH, reporter=reporter)
            for i, info in members:
                if i != victim_id:
                    self._send(i, info.addr, Notify(), updates=(update,))
        elif kind == "samples":
            value = MAX_TERM if rng.random() < 0.5 else self.total
            forged_for = victim_id if rng.random() < 0.5 else me.node_id
            counts = {**self.ctl.sample_counts(), forged_for: value}
            self._record(kind, value=value, forged_for=forged_for)
            listing = SyncRequest((Update(ALIVE, me.node_id, self.ctl.incarnation, me.node_id,
                                          me),), counts)
            for i, info in members:
                self._send(i, info.addr, Notify(), samples=value)
                self._send(i, info.addr, listing, samples=value)
        elif kind == "average":
            seed, reveal, commit = self.chains.opening(victim_id, rng.getrandbits(52))
            parts = self.plan.parts(seed)
            self.averager.begin(self.poison.copy(), seed, 0)
            chunks = tuple(bytes(c) for c in self.averager.messages(
                bytes.fromhex(self.node_id), self.ctl.sample_counts().get(self.node_id, 0)))
            self.averager.abort()
            self._record(kind, target=victim_id, value=FP16_MAX, parts=parts)
            self._send(victim_id, victim.addr, AverageRequest(
                seed, 0, self.ctl.sample_counts(), chunks, 0, parts, None, reveal, commit))
        return 0.0

    async def heartbeats(self) -> None:
        """While reigning, renew the forged lease like a leader (every heartbeat interval)."""
        interval = self.settings.proto().heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            if self.reign is None:
                continue
            if self.now() >= self.reign_until:
                say("reign_over", term=self.reign.term, seq=self.reign.seq)
                self.reign = None
                continue
            self.reign = dataclasses.replace(self.reign, seq=self.reign.seq + 1)
            for i, info in self.honest():
                self._send(i, info.addr, Heartbeat())

    async def attacks_loop(self) -> None:
        while not self.honest():
            await asyncio.sleep(0.2)
        say("joined", members=[i for i, _ in self.honest()])
        await asyncio.sleep(self.first_delay)
        while True:
            members = self.honest()
            if members:
                kind = self.rng.choice(ATTACKS)
                busy = self.attack(kind, members)
            else:
                busy = 0.0
            await asyncio.sleep(busy + self.rng.uniform(*self.gap))

    async def ticks(self) -> None:
        while True:
            deadline = self.ctl.next_deadline()
            if deadline is not None and deadline <= self.now():
                self._run(Tick())
            await asyncio.sleep(0.02)

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        mac_key = derive_mac_key(self.swarm.key)
        life = Life(self.identity)
        auth, signer = ServerAuth(mac_key, life), Signer(mac_key, life)
        bucket = TokenBucket.mbps(self.settings.net.max_upload_mbps)
        app = build_app(Served(self, auth, bucket, True), lambda: self.ckroot)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        port = await listen(runner, "127.0.0.1", self.port)
        addr = f"127.0.0.1:{port}"
        me = member_info(self.learner, self.hw, addr, self.settings.host.priority, False,
                         self.settings.gossip)
        self.ctl = Control(self.settings.proto(), me, incarnation=self.identity.incarnation,
                           now=self.now(), rng=random.Random(self.rng.getrandbits(64)))
        self.outbox = Outbox.open(signer, bucket, self.on_frames, self.reporter,
                                  self.settings.node)
        say("listening", addr=addr, node_id=self.node_id)
        stop = asyncio.Event()
        for s in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(s, stop.set)
        for seed in self.seeds:
            self._run(Discovered(seed))
        tasks = [self.loop.create_task(c) for c in (self.ticks(), self.attacks_loop(),
                                                    self.heartbeats())]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            say("stopped", attacks=len(self.attacks), stats=self.stats)
            await self.outbox.close()
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--peer", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-delay", type=float, default=2.0,
                    help="seconds after joining before the first attack")
    ap.add_argument("--gap", type=float, nargs=2, default=(2.0, 5.0),
                    help="seconds between attacks (uniform in [a, b])")
    args = ap.parse_args(argv)
    hostile = Hostile(args.config, args.state_dir, args.port, args.peer, args.seed,
                      args.first_delay, tuple(args.gap))
    asyncio.run(hostile.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
