"""Issue 13, item 10: averaging snapshots far from our replica are refused, as gradients are.
One message of all-65,504 values (finite fp16; 3e38 in int8) must change nothing and be refused
visibly; honest replicas that drifted apart must still average again. Tiny mlp replicas,
virtual time."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.proto.events import RemoteError, Send
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.guard import MIN_DISTANCES, DistanceGuard
from p2ptrain.proto.gossip.messages import AverageReply
from p2ptrain.proto.node import NodeConfig
from tests.cluster.harness import Network
from tests.cluster.training import TrainingCluster
from tests.test_node import MODEL, assert_same, chained, envelope_from, learner, state

FP16_MAX = 65504.0


def _cluster(n: int = 3, averaging: str = "subset_fp16", **node) -> TrainingCluster:
    gossip = GossipConfig(fanout=0, average_every=2, averaging=averaging)
    config = NodeConfig(gossip=gossip, min_peers=n - 1, join_timeout=5.0, **node)
    return TrainingCluster(n, 3, lambda i, node_id: learner(node_id), node_config=config,
                           step_seconds=0.5, network=Network(bandwidth=2e5))


def _snapshot(c: TrainingCluster, i: int, values: np.ndarray, seed: int, part: int = 0):
    """Node i's averager snapshot of `values` for exchange `seed`, as chunk bytes."""
    av = c.training_node(i).trainer.responder
    av.begin(values, seed, part)
    chunks = tuple(bytes(m) for m in av.messages(bytes.fromhex(c.nodes[i].info.node_id), 0))
    av.abort()
    return chunks


@pytest.mark.parametrize(("averaging", "value"), [("subset_fp16", FP16_MAX),
                                                  ("subset_int8", 3e38)])  # int8: any float
def test_an_averaging_request_of_huge_values_is_refused_and_changes_nothing(averaging, value):
    c = _cluster(averaging=averaging)
    c.run_until(6.0)
    node = c.training_node(0)
    assert node.phase == "training" and node.trainer.stats["average_applied"] >= 1
    before = state(node)
    seed, actions = chained(c, 1, 0, lambda s: _snapshot(
        c, 1, np.full(MODEL.space.size, value, np.float32), s), 4242, step=3)
    parts = node.trainer.plan.parts(seed)
    # refused with the reason, and declined in a reply at once: the initiator does not wait
    # out its averaging timeout (an honest node far behind tries again, see the fallback)
    assert [type(a) for a in actions] == [RemoteError, Send]
    assert "too far" in actions[0].reason and actions[0].sender == c.nodes[1].info.node_id
    decline = actions[1].envelope.body
    assert actions[1].reply and type(decline) is AverageReply and decline.chunks == ()
    assert (decline.seed, decline.part, decline.parts) == (seed, 0, parts)
    assert_same(before, state(node))
    status = node.status()
    assert status["gossip"]["average_refused"] == 1
    row = next(m for m in status["members"] if m["node_id"] == c.nodes[1].info.node_id)
    assert row["averages_refused"] == 1
    step = node.learner.step
    c.run_for(4.0)  # and it trains and averages on
    assert node.learner.step > step
    assert float(np.abs(node.learner.params).max()) < 100.0


def test_a_reply_of_all_65504_to_our_exchange_is_refused():
    c = _cluster()
    c.run_until(6.0)
    node = c.training_node(0)
    while node.trainer.exchange is None:  # wait for node 0 to open an exchange
        c.run_for(0.01)
    ex = node.trainer.exchange
    peer = c.ids[ex.peer]
    chunks = _snapshot(c, peer, np.full(MODEL.space.size, FP16_MAX, np.float32), ex.seed,
                       ex.part)
    env = envelope_from(c, peer, 0, AverageReply(ex.seed, 3, {}, chunks, ex.part, ex.parts))
    before = state(node)
    applied = node.trainer.stats["average_applied"]
    actions = c.inject(0, env, c.nodes[peer].info.addr)
    assert [type(a) for a in actions] == [RemoteError]
    assert node.trainer.exchange is None  # the exchange is over; nothing else moved
    assert_same(before[:9] + (False,) + before[10:], state(node))
    assert node.trainer.stats["average_applied"] == applied
    assert node.trainer.guard.refused[ex.peer] == 1


def test_replicas_that_drifted_apart_average_again():
    c = _cluster(2, averaging="fp16", average_timeout=1.0)
    c.run_until(8.0)
    a, b = c.training_node(0), c.training_node(1)
    assert len(a.trainer.guard.distances) >= MIN_DISTANCES
    b.learner.params += np.float32(0.2)  # far above the median, under the absolute bound
    c.run_for(30.0)
    refused = a.trainer.stats["average_refused"] + b.trainer.stats["average_refused"]
    assert refused >= 1  # judged by the median at first ...
    gap = float(np.sqrt(np.mean((a.learner.params - b.learner.params) ** 2)))
    assert gap < 0.02  # ... then by the absolute bound: averaged back together


def test_the_guard_judges_by_the_median_then_falls_back_to_the_absolute_bound():
    guard = DistanceGuard(multiple=10.0, window=8, max_distance=1.0, patience=3)
    assert guard.judge("p", 0.9) is None and guard.fallbacks == 1  # no median yet
    assert guard.judge("p", 1.5) is not None  # the absolute bound always holds
    assert guard.judge("p", float("nan")) is not None
    for d in (0.01, 0.012, 0.011):
        guard.applied("q", d)
    guard.applied("p", 0.011)
    assert guard.limit("p") == (pytest.approx(0.11), False)
    fallbacks = guard.fallbacks
    assert guard.judge("p", 0.5) is not None  # 45 x the median
    assert guard.judge("r", 0.05) is None  # within 10 x
    guard.applied("r", 0.05)
    assert guard.judge("p", 0.5) is not None
    assert guard.judge("p", 0.5) is not None  # third in a row for p: p is judged ...
    assert guard.fallbacks == fallbacks
    assert guard.limit("p") == (1.0, True) and guard.limit("r")[1] is False
    assert guard.judge("p", 0.5) is None and guard.fallbacks == fallbacks + 1  # ... absolutely
    guard.applied("p", 0.5)
    assert guard.peer_runs == {} and guard.refused["p"] == 2 + 3
    for peer in ("x", "y", "z"):  # every recent exchange refused: the absolute bound for all
        assert guard.judge(peer, 0.9) is not None
    assert guard.limit("w") == (1.0, True)


def test_a_zero_median_is_no_median():
    guard = DistanceGuard(multiple=10.0, window=8, max_distance=1.0, patience=3)
    for _ in range(3):
        guard.applied("q", 0.0)  # identical replicas
    assert guard.limit("p") == (1.0, True) and guard.judge("p", 1e-4) is None


def test_a_refused_request_is_answered_only_by_a_decline_to_its_member():
    c = _cluster()
    c.run_until(6.0)
    _, actions = chained(c, 1, 0, lambda s: _snapshot(
        c, 1, np.full(MODEL.space.size, FP16_MAX, np.float32), s), 7, step=3)
    sends = [a for a in actions if type(a) is Send]
    assert len(sends) == 1 and sends[0].to == c.nodes[1].info.node_id and sends[0].reply
    assert type(sends[0].envelope.body) is AverageReply and sends[0].envelope.body.chunks == ()


def test_a_gradient_in_another_codec_is_refused_before_it_is_decoded():
    """A node pushing top-k 1% admitted a random-k chunk at fraction 1 (any codec a header
    names): checking it cost ~20x its bytes in temporaries, and it was decoded twice."""
    from p2ptrain.codecs import encode_vector, make_codec
    from p2ptrain.proto.gossip.messages import GradientPush
    from tests.test_node import cluster

    c = cluster(2, step_seconds=1.0, gossip=GossipConfig(fanout=1, codec="topk", fraction=0.01,
                                                         average_every=0))
    c.run_until(20.5)
    node, other = c.training_node(0), c.training_node(1)
    x = np.random.default_rng(0).normal(size=node.learner.params.size).astype(np.float32)
    for codec, refused in ((make_codec("randomk", fraction=1.0, values="fp16"), True),
                           (make_codec("topk", fraction=0.01), False)):
        chunk = bytes(next(encode_vector(codec, x * 1e-3, sender_id=bytes.fromhex(
            other.node_id), swarm_samples=node.learner.count.total + 1, weight=8.0, seed=9)))
        before = node.trainer.mixer.pending
        actions = c.inject(0, envelope_from(c, 1, 0, GradientPush(1, 1.0, chunk)),
                           c.nodes[1].info.addr)
        assert any(type(a) is RemoteError for a in actions) is refused
        assert node.trainer.mixer.pending == before + (not refused)


def test_a_refused_reply_ends_the_exchange_it_answers():
    """The reply came, too far to apply: the exchange used to stay open until its give-up
    time (90 s here), the node's one averaging slot idle."""
    from tests.test_node import cluster

    c = cluster(2, step_seconds=1.0, gossip=GossipConfig(fanout=0, average_every=1000,
                                                         averaging="full"))
    c.run_until(10.2)
    node, other = c.training_node(0), c.training_node(1)
    node.trainer.rate_of = None  # draw by link alone
    node.trainer._begin_average(c.now, [(other.node_id, c.nodes[1].info.addr)], [])
    ex = node.trainer.exchange
    other.trainer.responder.begin(node.learner.params + np.float32(5.0), ex.seed, 0)
    chunks = tuple(bytes(m) for m in other.trainer.responder.messages(
        bytes.fromhex(other.node_id), 0))
    other.trainer.responder.abort()
    actions = c.inject(0, envelope_from(c, 1, 0, AverageReply(ex.seed, 0, {}, chunks, 0, 1)),
                       c.nodes[1].info.addr)
    assert any(type(a) is RemoteError for a in actions)
    assert node.trainer.exchange is None and not node.trainer.initiator.is_open
    assert node.trainer.stats["average_timeout"] == 0
