"""Crossing exchanges: two nodes that open averaging exchanges with each other at once (each
request sent before the other arrived). Each side's half step is taken from the two snapshots,
so answering both would move each node all the way to the other's snapshot -- the replicas
swap and stay as far apart as before. The node with the smaller id declines the crossing
request; the other answers it, and both land on the mean. And a node does not open an
exchange with a peer whose request it answered since its last step (they have just averaged).
Two trainers wired together in memory, in virtual time."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.gossip.trainer import GossipTrainer
from p2ptrain.proto.messages import Out
from tests.proto_samples import A, B, C
from tests.test_node import learner

ADDR = {A: "10.0.0.1:7100", B: "10.0.0.2:7100", C: "10.0.0.3:7100"}


def trainer(node_id: str, seed: int, **gossip) -> GossipTrainer:
    config = GossipConfig(**({"average_every": 1, "averaging": "full"} | gossip))
    t = GossipTrainer(config, learner(node_id), np.random.default_rng(seed),
                      average_timeout=90.0, chunk_elems=1 << 20)
    noise = np.random.default_rng(seed).normal(0.0, 0.05, t.n).astype(np.float32)
    t.learner.params += noise  # replicas apart, as after local steps
    return t


def open_exchange(t: GossipTrainer, now: float, peers: tuple[str, ...]) -> Out:
    out: list[Out] = []
    t.step(now, t.learner.compute_gradient(), (), [(p, ADDR[p]) for p in peers], out)
    [request] = out
    assert isinstance(request.body, AverageRequest)
    return request


def deliver(to: GossipTrainer, sender: str, body, now: float) -> list[Out]:
    out: list[Out] = []
    to.on_body(now, sender, ADDR[sender], body, to.parse(sender, body), busy=False,
               outbound_sender=False, out=out)
    return out


def rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)))


@pytest.mark.parametrize("reply_first", [False, True])
def test_crossing_exchanges_land_both_nodes_on_the_mean(reply_first):
    a, b = trainer(A, 1), trainer(B, 2)
    to_b = open_exchange(a, 10.0, (B,))
    to_a = open_exchange(b, 10.0, (A,))
    assert to_b.to == B and to_a.to == A and A < B
    xa, xb = a.learner.params.copy(), b.learner.params.copy()  # the snapshots
    apart = rms(xa, xb)
    assert apart > 0.01
    # a (the smaller id) declines b's request: its own exchange goes on
    [declined] = deliver(a, B, to_a.body, 10.1)
    assert isinstance(declined.body, AverageReply) and not declined.body.chunks
    assert a.exchange is not None and a.stats["average_declined_crossing"] == 1
    np.testing.assert_array_equal(a.learner.params, xa)
    # b answers a's request (its own will be declined) and moves halfway
    [answer] = deliver(b, A, to_b.body, 10.1)
    assert isinstance(answer.body, AverageReply) and answer.body.chunks
    assert b.stats["average_answered"] == 1
    mean = (xa.astype(np.float64) + xb) / 2
    assert rms(b.learner.params, mean) < 1e-3 * apart
    replies = [(a, B, answer.body), (b, A, declined.body)]
    for to, sender, body in (reversed(replies) if reply_first else replies):
        assert deliver(to, sender, body, 10.2) == []
    assert a.exchange is None and b.exchange is None
    assert b.stats["average_declined"] == 1 and a.stats["average_applied"] == 1
    assert rms(a.learner.params, mean) < 1e-3 * apart
    assert rms(a.learner.params, b.learner.params) < 1e-3 * apart  # not swapped


def test_a_request_from_another_peer_is_answered_while_an_exchange_is_open():
    a, b, c = trainer(A, 1), trainer(B, 2), trainer(C, 3)
    open_exchange(a, 10.0, (B,))
    to_a = open_exchange(c, 10.0, (A,))
    [answer] = deliver(a, C, to_a.body, 10.1)
    assert answer.body.chunks and a.stats["average_answered"] == 1
    assert a.stats["average_declined_crossing"] == 0
    assert b.exchange is None


def test_no_exchange_is_opened_with_a_peer_just_answered():
    a, b = trainer(A, 1), trainer(B, 2)
    for now in (10.0, 11.0):
        to_a = open_exchange(b, now, (A,))
        [answer] = deliver(a, B, to_a.body, now + 0.1)
        assert answer.body.chunks
        assert deliver(b, A, answer.body, now + 0.2) == [] and b.exchange is None
        if now == 10.0:  # a's step: its only partner is b, whose request it just answered
            out: list[Out] = []
            a.step(now + 0.5, a.learner.compute_gradient(), (), [(B, ADDR[B])], out)
            assert out == [] and a.exchange is None
            assert a.stats["average_partners_resting"] == 1
        else:  # with another partner it opens with that one
            assert open_exchange(a, now + 0.5, (B, C)).to == C
            a.close()
    # a answered nothing since its last step: b is a partner again
    assert open_exchange(a, 12.0, (B,)).to == B


def test_a_peer_is_no_partner_while_the_reply_to_it_may_be_on_its_way():
    """On a slow link the reply to b's request can take longer than a's steps; an exchange
    a opened meanwhile would find b's still open, and b (the larger id) would answer it:
    both moved twice, half a swap (distance 0.071 -> 0.036 where ~0 was due). a waits the
    give-up's margin over the reply's expected time."""
    a, b = trainer(A, 1), trainer(B, 2)
    a.peers.observe_transfer(B, 100_000, 100_000, 2.0, 0.0)  # 100 kB/s both ways together
    a.peers.observe_rtt(B, 0.05, 0.0)
    to_a = open_exchange(b, 10.0, (A,))
    [answer] = deliver(a, B, to_a.body, 10.0)
    size = sum(len(c) for c in answer.body.chunks)
    until = 10.0 + a.config.average_timeout_margin * (0.05 + size / 100_000)
    assert until > 11.0  # several of a's steps
    for now in (10.5, 11.0, until - 0.01):
        out: list[Out] = []
        a.step(now, a.learner.compute_gradient(), (), [(B, ADDR[B])], out)
        assert out == [] and a.exchange is None
    assert open_exchange(a, until + 0.01, (B,)).to == B
