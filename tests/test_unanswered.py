"""An averaging request whose reply cannot come any more ends its exchange at once (the
`Unanswered` event), instead of holding the node's one exchange slot until its give-up (90 s
or more). The reply of an averaging part travels in the response to its request; the
runtime's outbox reports each request's end -- failed, refused, timed out or answered -- after
the response's frames were handled, and the trainer ends the exchange if it still waits on
that part. A partner that restarted (connection refused) or refused the request unread (not a
member yet, an offender) used to leave the exchange waiting.

The trainer in memory (virtual time), and the outbox against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from p2ptrain.codecs import encode_vector, make_codec
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.outbox import Outbox
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.server import Served, build_app, listen
from p2ptrain.net.session import Life
from p2ptrain.proto import Send, Unanswered, wire
from p2ptrain.proto.gossip.answer import MAX_REST, UNANSWERED_REST
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.messages import PROTOCOL_VERSION, Envelope, Header
from p2ptrain.proto.node import NodeConfig
from p2ptrain.report import Reporter
from tests.proto_samples import A, B, C
from tests.test_gossip_crossing import deliver, open_exchange, trainer
from tests.test_pacing import RecordingHost, until

KEY = derive_mac_key(bytes(range(32)))


# -- the trainer ------------------------------------------------------------------------------


def test_an_unanswered_part_ends_its_exchange_and_nothing_else():
    t = trainer(A, 1)
    request = open_exchange(t, 10.0, (B,))
    ex = t.exchange
    seed, part = request.body.seed, request.body.part
    for other in ((C, seed, part), (B, seed + 1, part), (B, seed, part + 1)):
        t.unanswered(11.0, *other, False)  # another exchange's request: not ours
        assert t.exchange is ex
    bandwidth = t.peers.get(B).bandwidth
    t.unanswered(11.0, B, seed, part, False)
    assert t.exchange is None and not t.initiator.is_open
    assert t.stats["average_unanswered"] == 1 and t.stats["average_timeout"] == 0
    assert t.peers.get(B).bandwidth == bandwidth  # a refused connection says nothing of it
    t.unanswered(12.0, B, seed, part, False)  # once over, a repeat changes nothing
    assert t.stats["average_unanswered"] == 1
    # the next due step opens another exchange at once (it waited 90 s for the give-up),
    # with another partner: b is benched UNANSWERED_REST s (gone, restarting or slow)
    to_c = open_exchange(t, 12.0, (B, C))
    assert to_c.to == C
    declined = AverageReply(to_c.body.seed, 1, {}, (), 0, 1)
    assert deliver(t, C, declined, 12.1) == [] and t.exchange is None
    again = open_exchange(t, 11.0 + UNANSWERED_REST - 0.1, (B, C))
    assert again.to == C  # (c declined: no strike)
    t.exchange = None
    t.initiator.abort()
    # benched, but the only partner: drawn (a pair whose link came back after an outage
    # averaged not at all for as long as each benched the other -- a review)
    assert open_exchange(t, 11.0 + UNANSWERED_REST - 0.05, (B,)).to == B
    t.exchange = None
    t.initiator.abort()
    draws = set()
    for i in range(8):
        draws.add(open_exchange(t, 11.0 + UNANSWERED_REST + 0.1 + i, (B, C)).to)
        t.exchange = None
        t.initiator.abort()
    assert B in draws  # benched no more


def test_a_partner_that_never_answers_is_benched_as_long_as_it_held_the_slot_and_longer():
    """A member holding the key that never answers held a node's one exchange slot for the
    give-up (90 s and more) and was drawn again at the next due step: six nodes with one such
    member started 90 exchanges in 400 s instead of 1,985 (953 now, review script)."""
    t = trainer(A, 1)
    held_from, rests = 10.0, []
    for _ in range(4):
        request = open_exchange(t, held_from, (B,))
        deadline = t.exchange.deadline
        assert request.to == B and deadline - held_from >= 1.0
        t.tick(deadline)  # given up: no reply came
        assert t.exchange is None
        benched_until = t.benched[B][1]
        rests.append((benched_until - deadline, deadline - held_from))
        for when in (deadline + 0.1, benched_until - 0.1):  # c is drawn until then, not b
            assert open_exchange(t, when, (B, C)).to == C
            t.exchange = None
            t.initiator.abort()
        held_from = benched_until + 0.1
    # as long as it held the slot (its give-up grows: the link looks slower each time),
    # doubled each time, an hour at most
    assert [rest for rest, _ in rests] == pytest.approx(
        [min(held * 2**i, MAX_REST) for i, (_, held) in enumerate(rests)])
    assert rests[-1][0] == pytest.approx(MAX_REST) and MAX_REST == 3600.0
    assert t.benched[B][0] == 4
    # its own request, answered and applied, proves nothing of ours: still benched
    benched = t.benched[B]
    ask = open_exchange(trainer(B, 2), 10.0, (A,))
    assert deliver(t, B, ask.body, held_from - 0.1) and t.stats["average_answered"] == 1
    assert t.benched[B] == benched and t.stats["average_applied"] == 1
    later = held_from + 1000.0  # (a partner again once our reply to it has surely arrived,
    t.step(later, t.learner.compute_gradient(), (), [(B, "x")], [])  # and a step since)
    request = open_exchange(t, later + 1.0, (B,))  # it answers at last: strikes gone
    [reply] = deliver(trainer(B, 2), A, request.body, later + 1.05)
    deliver(t, B, reply.body, later + 1.1)
    assert t.stats["average_applied"] == 2 and B not in t.benched


def test_a_request_that_timed_out_says_the_link_is_slower_than_measured():
    t = trainer(A, 1)
    t.peers.observe_transfer(B, 10_000_000, 10_000_000, 1.0, 0.0)  # 20 MB/s measured
    request = open_exchange(t, 10.0, (B,))
    t.unanswered(10.0 + 80.0, B, request.body.seed, request.body.part, True)
    assert t.exchange is None
    assert t.peers.get(B).bandwidth == pytest.approx(2 * t.stats["average_bytes_sent"] / 80.0)


def test_a_node_hands_the_event_to_its_trainer():
    from tests.test_node import with_an_open_exchange

    c, node, ex = with_an_open_exchange()
    node.handle(c.now, Unanswered(ex.peer, ex.seed, ex.part + 1))  # another part: not it
    assert node.trainer.exchange is ex
    node.handle(c.now, Unanswered(ex.peer, ex.seed, ex.part))
    assert node.trainer.exchange is None
    assert node.status()["gossip"]["average_unanswered"] == 1


# -- the outbox, over HTTP ----------------------------------------------------------------------


class Host(RecordingHost):
    """The receiving side's host: answers averaging requests as `mode` says."""

    def __init__(self, mode: str):
        super().__init__()
        self.node_id, self.mode = B, mode

    def deliver(self, envelope, remote, sender, size):
        if self.mode == "slow":
            time.sleep(2.0)  # past the request's time limit (0.9 s): the client gives up
        if self.mode == "refuse":
            return 400, [], "not a member"
        body = envelope.body
        reply = Envelope(Header(PROTOCOL_VERSION, B, 1, "127.0.0.1:9", "0" * 16, 0, 1, 2, None,
                                ()), AverageReply(body.seed, 1, {}, (), body.part, body.parts))
        return 200, [wire.encode(reply)], ""


# the network part: real lives (the transport binds a sender to its identity key)
LIFE_A, LIFE_B = Life.throwaway(1), Life.throwaway(1)
NA, NB = LIFE_A.node_id, LIFE_B.node_id


class ServerThread:
    """NA real server in a thread of its own (its host may block, as a busy node's can)."""

    def __init__(self, host: Host, tmp: Path):
        self.host, self.tmp, self.port = host, tmp, None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        served = Served(self.host, ServerAuth(KEY, LIFE_B), TokenBucket(0), True)
        self.runner = web.AppRunner(build_app(served, lambda: self.tmp), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.port = self.loop.run_until_complete(listen(self.runner, "127.0.0.1", 0))
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(30), "the server did not start"
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def request(seed: int, part: int) -> Envelope:
    values = np.full(256, 1e-3, np.float32)
    (chunk,) = encode_vector(make_codec("fp16"), values, sender_id=bytes.fromhex(NA),
                             swarm_samples=1, weight=1.0, seed=seed)
    return Envelope(Header(PROTOCOL_VERSION, NA, 1, "127.0.0.1:9", "0" * 16, 0, seed, 2, None,
                           ()), AverageRequest(seed, 1, {}, (bytes(chunk),), part, 3))


async def post_one(addr: str, seed: int, part: int) -> list[tuple]:
    """Post one averaging request through a real outbox; what it reported, in order."""
    events: list[tuple] = []
    config = NodeConfig(average_timeout=1.0, gossip=GossipConfig(average_timeout_max=1.0))
    outbox = Outbox.open(Signer(KEY, LIFE_A), TokenBucket(0),
                         lambda a, frames: events.append(("frames", len(frames))),
                         Reporter("json", out=io.StringIO(), err=io.StringIO()), config)
    outbox.on_unanswered = lambda *ask: events.append(("unanswered", *ask))
    try:
        outbox.send(Send(NB, addr, request(seed, part)))
        await until("the request's end", lambda: any(e[0] == "unanswered" for e in events), 30)
    finally:
        await outbox.close()
    return events


@pytest.mark.parametrize("mode", ["reply", "refuse", "slow"])
def test_the_outbox_reports_every_averaging_requests_end_after_its_frames(tmp_path, mode):
    with ServerThread(Host(mode), tmp_path) as addr:
        events = asyncio.run(post_one(addr, 77, 1))
    end = ("unanswered", NB, 77, 1, mode == "slow")
    assert events == ([("frames", 1), end] if mode == "reply" else [end])


def test_the_outbox_reports_a_request_to_a_closed_port(tmp_path):
    with ServerThread(Host("reply"), tmp_path) as addr:
        pass  # the server is gone: connection refused
    assert asyncio.run(post_one(addr, 5, 0)) == [("unanswered", NB, 5, 0, False)]


def test_the_outbox_reports_a_request_too_large_to_send(monkeypatch, tmp_path):
    from p2ptrain.proto import wire as wire_module

    monkeypatch.setattr(wire_module, "MAX_BLOB", 16)  # every averaging request too large
    with ServerThread(Host("reply"), tmp_path) as addr:
        assert asyncio.run(post_one(addr, 9, 2)) == [("unanswered", NB, 9, 2, False)]


# -- what the outbox reads of a response ----------------------------------------------------------


class BigReplies(Host):
    """Answers every message, authentically, with one 2 MiB averaging reply: what an
    averaging request may get back, not a ping (a key holder's way to make a node hold
    72 MiB a connection before the MAC is checked, 12 connections to one peer)."""

    def deliver(self, envelope, remote, sender, size):
        (chunk,) = encode_vector(make_codec("fp16"), np.zeros(1 << 20, np.float32),
                                 sender_id=bytes.fromhex(NB), swarm_samples=1, weight=1.0,
                                 seed=1, chunk_elems=1 << 20)
        reply = Envelope(Header(PROTOCOL_VERSION, NB, 1, "127.0.0.1:9", "0" * 16, 0, 1, 2, None,
                                ()), AverageReply(1, 1, {}, (bytes(chunk),), 0, 1))
        return 200, [wire.encode(reply)], ""


async def post_both(addr: str, first: Envelope, second: Envelope
                    ) -> list[tuple[list[int], dict[str, str]]]:
    """Post two messages, one after the other, through one real outbox: for each, the sizes
    of the frames handed on from its response and the outbox's failures by address."""
    seen: list[int] = []
    outbox = Outbox.open(Signer(KEY, LIFE_A), TokenBucket(0),
                         lambda a, fs: seen.extend(len(f) for f in fs),
                         Reporter("json", out=io.StringIO(), err=io.StringIO()), NodeConfig())
    results = []
    try:
        for envelope in (first, second):
            ended = sum(outbox.stats.values())
            outbox.send(Send(NB, addr, envelope))
            await until("the post's end", lambda n=ended: sum(outbox.stats.values()) > n, 30)
            results.append((list(seen), dict(outbox.last_error)))
            seen.clear()
            outbox.last_error.clear()
    finally:
        await outbox.close()
    return results


def test_a_response_is_read_only_as_far_as_its_route_can_answer(tmp_path):
    from p2ptrain.proto.messages import Ping

    ping = Envelope(Header(PROTOCOL_VERSION, NA, 1, "127.0.0.1:9", "0" * 16, 0, 3, 2, None, ()),
                    Ping(1, NB))
    with ServerThread(BigReplies("reply"), tmp_path) as addr:
        (to_ping, ping_errors), (to_request, request_errors) = asyncio.run(
            post_both(addr, ping, request(7, 0)))
    assert to_ping == [] and "response body too large" in ping_errors[addr]
    assert request_errors == {} and len(to_request) == 1 and to_request[0] > 2 << 20
