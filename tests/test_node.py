"""The training Node (issue 4): the RunStep/StepDone hand-off, requests answered while a step
runs, push targets, malformed gossip refused with nothing changed, outbound-only members,
the swarm sample G-counter, status. Tiny mlp replicas in the in-memory cluster: fast."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from p2ptrain.codecs import HEADER_SIZE, encode_vector
from p2ptrain.data import load_corpus
from p2ptrain.learner import Learner
from p2ptrain.models import build_model
from p2ptrain.models.mlp import MLPConfig
from p2ptrain.proto import wire
from p2ptrain.proto.config import LOCAL
from p2ptrain.proto.errors import LocalProtocolError
from p2ptrain.proto.events import (
    Evaluated,
    Finished,
    Progress,
    RemoteError,
    RunStep,
    Send,
    StepDone,
    Tick,
)
from p2ptrain.proto.gossip.averaging import consensus_distance
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.messages import (
    AverageReply,
    AverageRequest,
    GradientPush,
    GradientReply,
)
from p2ptrain.proto.gossip.trainer import Exchange
from p2ptrain.proto.messages import TYPE_IDS, Ack, Envelope, Ping
from p2ptrain.proto.node import Node, NodeConfig
from p2ptrain.proto.records import DEAD, Update
from p2ptrain.settings import TrainConfig
from tests.cluster.harness import Network
from tests.cluster.training import TrainingCluster
from tests.proto_samples import A, info
from tests.test_gossip_mixer import reseal

MODEL = build_model("mlp", MLPConfig(n_hidden=32, n_embd=8, ctx_len=16))
CORPUS = load_corpus(None, 0.1, 20)
BATCH = 8


def learner(node_id: str, total_samples: int = 100_000) -> Learner:
    train = TrainConfig(warmup_samples=64, total_samples=total_samples)
    return Learner(MODEL, node_id, train, CORPUS, batch=BATCH, accum=1, eval_count=16)


def cluster(n: int = 4, *, step_seconds=0.5, total_samples: int = 100_000, seed: int = 3,
            **kwargs) -> TrainingCluster:
    gossip = kwargs.pop("gossip", GossipConfig(fanout=2, average_every=2, averaging="full"))
    config = NodeConfig(gossip=gossip, min_peers=n - 1, join_timeout=5.0, join_fetch=False)
    return TrainingCluster(n, seed, lambda i, node_id: learner(node_id, total_samples),
                           node_config=config, step_seconds=step_seconds, **kwargs)


ALONE = NodeConfig(min_peers=0, join_fetch=False)  # trains at once, fetches nothing


def state(node: Node):
    """Everything a refused message must leave as it was."""
    lr = node.learner
    return (lr.params.copy(), lr.opt.m.copy(), lr.opt.v.copy(), lr.opt.t, lr.step,
            lr.count.as_dict(), node.trainer.mixer.pending, node.trainer.mixer.pending_bytes,
            node.control.snapshot(), node.trainer.initiator.is_open,
            node.trainer.responder.is_open, node.outstanding)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def envelope_from(c: TrainingCluster, i: int, to: int, body) -> Envelope:
    target = c.nodes[to].info
    return c.training_node(i).control.wrap(target.node_id, target.addr, body).envelope


def chained(c: TrainingCluster, i: int, to: int, chunks_of, fresh: int = 777, step: int = 0,
            parts: int | None = None) -> tuple[int, list]:
    """Inject into node `to` node i's averaging request whose seed follows the pair's chain
    (seeds.py; `fresh` while none is open), the snapshot `chunks_of(seed)`; node i's chain
    takes the answer. Returns (the seed, the injection's actions)."""
    t, target = c.training_node(i).trainer, c.nodes[to].info.node_id
    seed, reveal, commit = t.seeds.opening(target, fresh)
    parts = t.plan.parts(seed) if parts is None else parts
    body = AverageRequest(seed, step, {}, chunks_of(seed), 0, parts, None, reveal, commit)
    actions = c.inject(to, envelope_from(c, i, to, body), c.nodes[i].info.addr)
    for a in actions:
        if type(a) is Send and type(a.envelope.body) is AverageReply:
            reply = a.envelope.body
            t.seeds.answered(target, reply.seed, reply.grant, reply.reseed)
    return seed, actions


def gradient_chunk(sender: str, x: np.ndarray, weight: float = BATCH, codec=None) -> bytes:
    """A gradient chunk in `codec` (default: the swarm's, as `cluster` configures it)."""
    codec = GossipConfig().make_codec() if codec is None else codec
    return bytes(next(encode_vector(codec, x, sender_id=bytes.fromhex(sender),
                                    swarm_samples=10, weight=weight, seed=1)))


# -- the step hand-off -------------------------------------------------------------------------


def test_run_step_and_step_done_cycle():
    lr = learner(A)
    node = Node(LOCAL, info(A), lr, ALONE, incarnation=1, now=0.0, rng=random.Random(1))
    actions = node.handle(0.0, Tick())
    runs = [a for a in actions if type(a) is RunStep]
    assert runs == [RunStep(1)] and node.outstanding == 1
    assert not any(type(a) is RunStep for a in node.handle(0.1, Tick()))  # one at a time
    before = lr.params.copy()
    loss = lr.compute_gradient()
    actions = node.handle(0.2, StepDone(1, loss))
    assert [a for a in actions if type(a) is RunStep] == [RunStep(2)]
    assert lr.step == 1 and lr.samples == BATCH and lr.count.total == BATCH
    assert not np.array_equal(before, lr.params) and node.loss == loss
    assert node.control.snapshot()["progress"] == (1, BATCH, BATCH)
    with pytest.raises(LocalProtocolError):
        node.handle(0.3, StepDone(1, loss))  # answers no outstanding RunStep
    with pytest.raises(LocalProtocolError):
        node.handle(0.3, Progress(1, 8, 8))  # the node reports its own progress
    with pytest.raises(LocalProtocolError):
        node.handle(0.1, Tick())  # time went backwards
    node.handle(0.4, StepDone(2, math.nan))  # a diverged step is discarded, not applied
    assert lr.step == 1 and node.skipped == 1 and node.outstanding == 2  # step 2 again
    node.handle(0.5, Evaluated(2.5))
    assert node.status()["eval_loss"] == 2.5


def test_training_ends_at_the_swarm_total():
    lr = learner(A, total_samples=3 * BATCH)
    node = Node(LOCAL, info(A), lr, ALONE, incarnation=1, now=0.0, rng=random.Random(1))
    actions, t = node.handle(0.0, Tick()), 0.0
    while True:
        step = [a for a in actions if type(a) is RunStep]
        if not step:
            break
        t += 0.1
        actions = node.handle(t, StepDone(step[0].step, lr.compute_gradient()))
    assert lr.step == 3 and node.phase == "finished"
    assert Finished(3, 3 * BATCH) in actions
    assert node.control.snapshot()["election"]["swarm_samples"] == 3 * BATCH


def test_requests_are_answered_while_a_step_is_outstanding():
    c = cluster(3, step_seconds=10.0)  # a slow Pi: one step takes 10 s
    c.run_until(3.0)
    node = c.training_node(0)
    assert node.outstanding == 1 and node.learner.step == 0  # still on its first step
    # Probes were sent and answered meanwhile: the others hold it alive.
    assert all(c.control(j).member_state(c.nodes[0].info.node_id) == "alive" for j in (1, 2))
    ping = envelope_from(c, 1, 0, Ping(77, c.nodes[0].info.node_id))
    actions = c.inject(0, ping, c.nodes[1].info.addr)
    acks = [a for a in actions if type(a) is Send and type(a.envelope.body) is Ack]
    assert acks and acks[0].envelope.body.seq == 77
    # A gradient arriving now is queued, not applied.
    before = node.learner.params.copy()
    x = np.ones(MODEL.space.size, np.float32) * 0.01
    sender = c.nodes[1].info.node_id
    push = envelope_from(c, 1, 0, GradientPush(4, 2.0, gradient_chunk(sender, x)))
    assert not [a for a in c.inject(0, push, c.nodes[1].info.addr) if type(a) is RemoteError]
    assert node.trainer.mixer.pending == 1
    np.testing.assert_array_equal(before, node.learner.params)


def test_averaging_answered_during_a_step_is_applied_when_it_ends():
    c = cluster(2, step_seconds=10.0)
    c.run_until(3.0)
    node, peer = c.training_node(0), c.training_node(1)
    peer.learner.params += 0.5  # make the replicas differ
    before = node.learner.params.copy()

    def snapshot(seed):
        peer.trainer.initiator.begin(peer.learner.params, seed)
        chunks = tuple(bytes(m) for m in peer.trainer.initiator.messages(
            bytes.fromhex(peer.node_id), 0))
        peer.trainer.initiator.abort()
        return chunks

    for fresh in (12345, 777):  # two requests in one step: both answered at once
        _, actions = chained(c, 1, 0, snapshot, fresh)
        replies = [a for a in actions if type(a) is Send
                   and type(a.envelope.body) is AverageReply]
        assert len(replies) == 1 and replies[0].reply and replies[0].envelope.body.chunks
        np.testing.assert_array_equal(before, node.learner.params)  # held: a step runs
    c.run_until(12.0)  # the step ends: both held half steps are applied
    assert node.learner.step >= 1 and not node.trainer.dirty
    assert node.trainer.distance == pytest.approx(0.5, rel=1e-3)
    assert float(np.mean(node.learner.params - before)) > 0.4  # two half steps toward +0.5


def test_a_joining_node_declines_to_average():
    # 3 nodes: it stays joining
    config = NodeConfig(min_peers=5, join_timeout=100.0, join_fetch=False)
    c = TrainingCluster(3, 3, lambda i, node_id: learner(node_id), node_config=config)
    c.run_until(2.0)
    node, peer = c.training_node(0), c.training_node(1)
    assert node.phase == "joining" and node.learner.step == 0
    peer.trainer.initiator.begin(peer.learner.params + 1.0, 5)
    chunks = tuple(bytes(m) for m in peer.trainer.initiator.messages(
        bytes.fromhex(peer.node_id), 0))
    before = node.learner.params.copy()
    actions = c.inject(0, envelope_from(c, 1, 0, AverageRequest(5, 0, {}, chunks)),
                       c.nodes[1].info.addr)
    replies = [a for a in actions if type(a) is Send and type(a.envelope.body) is AverageReply]
    assert len(replies) == 1 and replies[0].reply and replies[0].envelope.body.chunks == ()
    np.testing.assert_array_equal(before, node.learner.params)
    peer.trainer.exchange = Exchange(node.node_id, 5, c.now, c.now + 5, 1)  # its own
    c.inject(1, envelope_from(c, 0, 1, replies[0].envelope.body), c.nodes[0].info.addr)
    assert peer.trainer.exchange is None and not peer.trainer.initiator.is_open
    assert peer.trainer.stats["average_declined"] == 1


# -- targets ---------------------------------------------------------------------------------


def test_gradients_are_pushed_only_to_alive_peers_that_accept_connections():
    c = cluster(6, step_seconds=1.0, outbound_only=[5])
    c.run_until(2.5)
    node = c.training_node(0)
    ids = [n.info.node_id for n in c.nodes]
    table = node.control.membership.table
    assert all(node.control.member_state(i) == "alive" for i in ids[1:])
    table.suspect(ids[3], c.now)
    m4 = table.members[ids[4]]
    table.apply(Update(DEAD, ids[4], m4.incarnation, ids[1]), c.now, [])
    assert [i for i, _ in node.alive_peers()] == sorted(ids[1:3])
    targets = set()
    for _ in range(6):
        loss = node.learner.compute_gradient()
        actions = node.handle(c.now, StepDone(node.outstanding, loss))
        targets |= {a.to for a in actions
                    if type(a) is Send and type(a.envelope.body) is GradientPush}
        starts = [a.to for a in actions
                  if type(a) is Send and type(a.envelope.body) is AverageRequest]
        assert set(starts) <= {ids[1], ids[2]}
    assert targets == {ids[1], ids[2]}


# -- malformed gossip ------------------------------------------------------------------------


def _malformed_bodies(c: TrainingCluster):
    sender = c.nodes[1].info.node_id
    n = MODEL.space.size
    good = gradient_chunk(sender, np.ones(n, np.float32))
    nan = bytearray(good)
    nan[HEADER_SIZE + 28 : HEADER_SIZE + 32] = np.float32(np.nan).tobytes()
    flipped = bytearray(good)
    flipped[120] ^= 0xFF  # checksum no longer matches
    return {
        "wrong length": GradientPush(1, 2.0, gradient_chunk(sender, np.ones(n - 16, np.float32))),
        "non-finite": GradientPush(1, 2.0, reseal(nan)),
        "checksum": GradientPush(1, 2.0, bytes(flipped)),
        "forged sender": GradientPush(1, 2.0, gradient_chunk(c.nodes[2].info.node_id,
                                                             np.ones(n, np.float32))),
        "zero weight": GradientPush(1, 2.0, gradient_chunk(sender, np.ones(n, np.float32), 0)),
        "garbage": GradientReply(1, 2.0, b"not a chunk"),
        "short snapshot": AverageRequest(5, 1, {}, (gradient_chunk(sender, np.ones(
            n - 16, np.float32)),)),
        "snapshot garbage": AverageRequest(5, 1, {}, (b"\x00" * 200,)),
    }


@pytest.mark.parametrize("case", ["wrong length", "non-finite", "checksum", "forged sender",
                                  "zero weight", "garbage", "short snapshot",
                                  "snapshot garbage"])
def test_malformed_gossip_is_refused_and_changes_nothing(case):
    c = cluster(3, step_seconds=0.5)
    c.run_until(3.2)
    node = c.training_node(0)
    assert node.learner.step >= 2 and node.outstanding is not None
    body = _malformed_bodies(c)[case]
    envelope = envelope_from(c, 1, 0, body)
    for message in (envelope, wire.encode(envelope)):
        before = state(node)
        actions = c.inject(0, message, c.nodes[1].info.addr)
        # a refused averaging request is also declined at once, in a reply without values
        expected = [RemoteError, Send] if type(body) is AverageRequest else [RemoteError]
        assert [type(a) for a in actions] == expected, case
        assert actions[0].sender == c.nodes[1].info.node_id
        assert_same(before, state(node))
    # ... and the node trains on afterwards.
    step = node.learner.step
    c.run_for(2.0)
    assert node.learner.step > step


def test_an_absurd_gradient_norm_is_refused_by_the_mixer():
    c = cluster(3, step_seconds=0.5)
    c.run_until(3.2)
    node = c.training_node(0)
    sender = c.nodes[1].info.node_id
    huge = np.full(MODEL.space.size, 1e5, np.float32)  # norm ~1e7: above max_norm
    envelope = envelope_from(c, 1, 0, GradientPush(1, 2.0, gradient_chunk(sender, huge)))
    before = state(node)
    actions = c.inject(0, envelope, c.nodes[1].info.addr)
    assert [a for a in actions if type(a) is RemoteError]
    assert not [a for a in actions if type(a) is Send and type(a.envelope.body) is GradientReply]
    after = state(node)
    assert_same(before[:8], after[:8])  # learner, optimiser and queue as they were


def test_gossip_bodies_round_trip_the_wire():
    assert {TYPE_IDS[b] for b in (GradientPush, GradientReply, AverageRequest,
                                  AverageReply)} == {32, 33, 34, 35}
    c = cluster(2)
    for body in (GradientPush(3, 1.5, b"abc"), GradientReply(0, 0.0, b""),
                 AverageRequest(9, 2, {A: 4}, (b"x", b"yz")), AverageReply(9, 2, {}, ()),
                 AverageRequest(9, 2, {}, (b"x",), 0, 1, 2.5), AverageReply(9, 2, {}, (), 0, 1,
                                                                            0.0)):
        env = envelope_from(c, 0, 1, body)
        data = wire.encode(env)
        assert wire.decode(data) == env and wire.size(env) == len(data)
    for bad in (-1.0, float("nan"), float("inf")):  # a loss no honest sender has
        for body in (AverageRequest(9, 2, {}, (b"x",), 0, 1, bad),
                     AverageReply(9, 2, {}, (), 0, 1, bad)):
            with pytest.raises(ValueError, match="loss"):
                body.check()


# -- outbound-only, the G-counter, status ----------------------------------------------------


class Recorder:
    def __init__(self, c: TrainingCluster):
        self.c = c
        self.counts: dict[int, list[tuple[int, dict[str, int]]]] = {}
        self.sends_to: list[Send] = []

    def on_actions(self, cluster, i, event, actions):
        machine = cluster.nodes[i].machine
        if machine is not None:
            lr = machine.learner
            self.counts.setdefault(i, []).append((lr.count.total, lr.count.as_dict()))
        self.sends_to += [a for a in actions if type(a) is Send
                          and a.addr == cluster.nodes[0].info.addr]


def test_outbound_only_node_pushes_pulls_and_is_never_called():
    c = cluster(4, step_seconds=0.3, outbound_only=[0], network=Network(bandwidth=1e6))
    rec = Recorder(c)
    c.observe(rec)
    c.run_until(12.0)
    node = c.training_node(0)
    stats = node.trainer.stats
    assert stats["average_started"] >= 3 and stats["average_applied"] >= 3
    assert stats["gradient_pushes"] > 10
    assert len(node.trainer.mixer.used) >= 2  # gradients came back in replies
    gossip = [s for s in rec.sends_to if type(s.envelope.body) in (
        GradientPush, GradientReply, AverageRequest, AverageReply)]
    assert gossip and all(s.reply for s in gossip)
    assert {type(s.envelope.body) for s in gossip} == {GradientReply, AverageReply}
    for j in (1, 2, 3):  # nobody opened an exchange with it
        assert c.training_node(j).trainer.stats["average_started"] > 0
    peers = {m["node_id"]: m for m in node.status()["members"]}
    timed = [m for m in peers.values() if m["rtt_ms"] is not None]  # the ones it averaged with
    assert timed and all(m["rtt_ms"] > 0 and m["bandwidth"] > 0 for m in timed)


def test_swarm_count_is_merged_and_never_decreases():
    c = cluster(4, step_seconds=[0.2, 0.3, 0.5, 0.7])
    rec = Recorder(c)
    c.observe(rec)
    c.run_until(10.0)
    for i, seen in rec.counts.items():
        totals = [t for t, _ in seen]
        assert totals == sorted(totals), i
        for (_, a), (_, b) in zip(seen, seen[1:], strict=False):
            assert all(b.get(k, 0) >= v for k, v in a.items()), i
    samples = sum(n.machine.learner.samples for n in c.nodes)
    for n in c.nodes:  # every node follows the whole swarm, within a few steps of lag
        count = n.machine.learner.count
        assert len(count.as_dict()) == 4 and samples - 12 * BATCH <= count.total <= samples
    # A stale counter (lower entries) changes nothing.
    node = c.training_node(1)
    before = node.learner.count.as_dict()
    stale = {k: v // 2 for k, v in before.items()}
    node.learner.count.merge(stale)
    assert node.learner.count.as_dict() == before


def test_status_document():
    c = cluster(3, step_seconds=0.25)
    c.run_until(6.0)
    st = c.training_node(0).status()
    for key in ("node_id", "phase", "step", "loss", "eval_loss", "samples", "swarm_samples",
                "leader", "term", "bytes_in", "bytes_out", "members"):
        assert key in st
    assert st["phase"] == "training" and st["step"] > 5 and st["bytes_in"] > 0
    assert st["leader"] is not None and len(st["members"]) == 2
    for m in st["members"]:
        assert {"node_id", "addr", "state", "step", "loss", "samples", "bytes_in", "bytes_out",
                "rtt_ms"} <= set(m)
        assert m["bytes_in"] > 0 and m["bytes_out"] > 0 and m["step"] is not None
    assert consensus_distance([lr.params for lr in c.learners()]) < 0.05


def test_averaging_alone_tells_each_member_its_peers_losses():
    """With no gradient pushes (the default: averaging only) every averaging body carries
    its sender's latest training loss, so the status has its peers' losses -- and the swarm's
    loss a joiner judges a checkpoint by is known."""
    c = cluster(3, step_seconds=0.25, gossip=GossipConfig(fanout=0, average_every=2,
                                                          averaging="full"))
    c.run_until(6.0)
    for i in range(3):
        node = c.training_node(i)
        assert node.trainer.stats["gradient_pushes"] == 0
        assert node.trainer.stats["average_applied"] > 0
        for m in node.status()["members"]:
            peer = next(n for n in c.nodes if n.info.node_id == m["node_id"])
            loss = c.training_node(c.nodes.index(peer)).trainer.loss
            assert m["loss"] is not None and m["step"] is not None, m
            assert 0 < m["loss"] < 10 and loss is not None
        assert node._swarm_loss(None) is not None


def test_training_goes_on_when_a_node_dies_and_comes_back():
    c = cluster(4, step_seconds=0.25)
    c.run_until(3.0)
    c.crash(2)
    dead = c.nodes[2].info.node_id
    steps = [c.training_node(i).learner.step for i in (0, 1, 3)]
    c.run_until(3.0 + c.config.detection_bound(4) + 1.0)
    for j, i in enumerate((0, 1, 3)):
        node = c.training_node(i)
        assert node.learner.step > steps[j] + 20
        assert node.control.member_state(dead) == "dead"
        assert dead not in dict(node.alive_peers())
    c.restart(2)  # a fresh learner (the runtime would fetch the leader's checkpoint first)
    c.run_for(5.0)
    node = c.training_node(2)
    assert node.phase == "training" and node.learner.step > 5
    assert node.learner.count.total > 4 * node.learner.samples  # it adopted the swarm count


def test_averaging_in_parts_runs_every_part_through_the_nodes():
    """A small `average_part` splits each exchange into many messages (as a big model's
    would): every part is requested, answered and applied, also for an outbound-only
    initiator (its parts come back in responses), and the replicas draw together."""
    part = 1024
    n = MODEL.space.n_params
    c = cluster(3, step_seconds=0.3, outbound_only=[0], network=Network(bandwidth=1e6),
                gossip=GossipConfig(average_every=2, fanout=0, averaging="full",
                                    average_part=part))
    c.run_until(12.0)
    parts = -(-n // part)
    whole = 0
    for i in range(3):
        stats = c.training_node(i).trainer.stats
        assert stats["average_started"] >= 2, stats
        # every exchange it started that was not declined (two nodes opening exchanges with
        # each other at once: the larger id's is), but the last (maybe still in flight), ran
        # all its parts
        ran = stats["average_started"] - stats["average_declined"]
        as_initiator = stats["average_applied"] - stats["average_answered"]
        assert as_initiator >= parts * (ran - 1), (parts, stats)
        whole += as_initiator // parts
    assert whole >= 6
    sizes = {len(c.training_node(i).trainer.initiator._snap) for i in range(3)}
    assert sizes == {part}  # one part of snapshot, never the whole model


def with_an_open_exchange() -> tuple[TrainingCluster, Node, Exchange]:
    """Three nodes averaging whole vectors every 2 steps, run until node 0 has one open."""
    c = cluster(3, step_seconds=0.25, gossip=GossipConfig(
        fanout=0, average_every=2, averaging="full", average_every_fast=0))
    c.run_until(4.0)
    node = c.training_node(0)
    while node.trainer.exchange is None:
        c.run_until(c.now + 0.001)
    return c, node, node.trainer.exchange


def test_an_exchange_whose_partner_died_ends_at_once():
    """No reply comes from a partner that died: the exchange ends once the membership finds
    it dead (seconds), not at its give-up (90 s or more), which blocked every averaging
    exchange of the node meanwhile."""
    c, node, ex = with_an_open_exchange()
    partner = next(k for k in range(3) if c.nodes[k].info.node_id == ex.peer)
    c.crash(partner)
    c.run_until(c.now + c.config.detection_bound(3) + 1.0)
    assert node.trainer.exchange is not ex and c.now < ex.deadline
    assert node.trainer.stats["average_partner_gone"] == 1
    started = node.trainer.stats["average_started"]
    c.run_until(c.now + 3.0)  # and averaging goes on with whoever lives
    assert node.trainer.stats["average_started"] > started


def test_joined_says_when_the_first_step_waits_for_min_peers():
    """A node that joined ('this node leads') then sat at step 0 for the join timeout while
    it waited for node.min_peers, saying nothing: the start line now says so."""
    from p2ptrain.proto.events import Joined

    joined: list[str] = []

    class Watch:
        def on_actions(self, cluster, i, event, actions):
            joined.extend(a.reason for a in actions if type(a) is Joined and i == 0)

    config = NodeConfig(min_peers=5, join_timeout=30.0)
    c = TrainingCluster(1, 3, lambda i, node_id: learner(node_id), node_config=config)
    c.observe(Watch())
    c.run_until(40.0)
    assert len(joined) == 1 and "training waits up to" in joined[0], joined
    assert "node.min_peers (5)" in joined[0] and c.training_node(0).learner.step > 0
