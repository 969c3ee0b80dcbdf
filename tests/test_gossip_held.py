"""The memory bounds of gossip training (issue 15): averaging half steps that finish while a
step runs are held sparse and bounded (a responder declines past the bound, an initiator's
next part waits for the step boundary); a driver's read of the learner (`Reading`, a
checkpoint written from the live buffers) holds every write; no error-feedback residual
without gradient pushes. Tiny mlp replicas in the in-memory cluster, as in test_node.py."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.proto.errors import LocalProtocolError
from p2ptrain.proto.events import Reading, Send, StepDone
from p2ptrain.proto.gossip.averaging import HELD_PULL, HeldDeltas, ParameterAverager
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.exchange import HELD_FLOOR, held_capacity
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.gossip.plan import AveragingPlan
from tests.test_node import MODEL, chained, cluster, envelope_from


def snapshot_of(c, i: int, shift: float = 0.0, part: int = 0):
    """Node i's replica (+ shift) as an averaging snapshot, for a seed."""
    def chunks(seed: int) -> tuple[bytes, ...]:
        peer = c.training_node(i)
        peer.trainer.initiator.begin(peer.learner.params + np.float32(shift), seed, part)
        out = tuple(bytes(m) for m in peer.trainer.initiator.messages(
            bytes.fromhex(peer.node_id), 0))
        peer.trainer.initiator.abort()
        return out
    return chunks


def request_from(c, i: int, to: int, seed: int, shift: float = 0.0, part: int = 0, parts=1):
    """An averaging request of node i's replica (+ shift) for node `to` (not following a
    pair's seed chain: the first of the pair, or a later part)."""
    chunks = snapshot_of(c, i, shift, part)(seed)
    return envelope_from(c, i, to, AverageRequest(seed, 0, {}, chunks, part, parts))


def replies(actions) -> list[AverageReply]:
    return [a.envelope.body for a in actions
            if type(a) is Send and type(a.envelope.body) is AverageReply]


def test_held_half_steps_add_up_to_the_direct_update():
    plan = AveragingPlan(1000, fraction=0.3, block=16, part=64)
    rng = np.random.default_rng(0)
    params = rng.normal(size=1000).astype(np.float32)
    peer = params + rng.normal(size=1000).astype(np.float32)
    direct, held_params = params.copy(), params.copy()
    held = HeldDeltas(plan, 10**6)
    mine, theirs = ParameterAverager(plan), ParameterAverager(plan)
    for part in range(plan.parts(7)):
        for target, hold in ((direct, None), (held_params, held)):
            theirs.begin(peer, 7, part)
            reply = list(theirs.messages(b"\1" * 16, 0))
            theirs.abort()
            mine.begin(target, 7, part)
            mine.finish(target, reply, hold)
    np.testing.assert_array_equal(held_params, params)  # nothing applied yet
    assert held.size == plan.covered(7) and held
    held.apply(held_params)
    np.testing.assert_array_equal(held_params, direct)
    assert not held and held.size == 0


def test_the_bound_is_an_eighth_of_the_model_or_64_mib():
    assert held_capacity(1000) == HELD_FLOOR == 1 << 24
    assert held_capacity(10**9) == 10**9 // 8


def test_no_error_feedback_residual_without_gradient_pushes():
    quiet = cluster(2, gossip=GossipConfig(fanout=0, codec="topk", error_feedback=True))
    assert all(quiet.training_node(i).trainer.encoder is None for i in range(2))
    pushing = cluster(2, gossip=GossipConfig(fanout=1, codec="topk", error_feedback=True))
    residual = pushing.training_node(0).trainer.encoder.residual
    assert residual.shape == (MODEL.space.size,)


def test_a_responder_declines_what_it_cannot_hold():
    c = cluster(2, step_seconds=10.0)
    c.run_until(3.0)
    node = c.training_node(0)
    n = MODEL.space.size
    node.trainer.held.capacity = n + n // 2  # room for one whole exchange, not two
    before = node.learner.params.copy()
    first = replies(c.inject(0, request_from(c, 1, 0, 11, 0.5), c.nodes[1].info.addr))
    second = replies(c.inject(0, request_from(c, 1, 0, 12, 0.5), c.nodes[1].info.addr))
    assert first[0].chunks and not second[0].chunks  # answered, then declined
    assert node.trainer.stats["average_declined_held_full"] == 1
    assert node.trainer.held.size == n
    np.testing.assert_array_equal(before, node.learner.params)  # held: a step runs
    c.run_until(12.0)  # the step ends: the one held half step is applied
    assert not node.trainer.dirty and float(np.mean(node.learner.params - before)) > 0.2


def test_a_read_holds_every_write_and_stepdone_waits():
    c = cluster(2, step_seconds=10.0)
    c.run_until(3.0)
    node = c.training_node(0)
    step = node.outstanding
    node.handle(c.now, Reading(True))
    with pytest.raises(LocalProtocolError):
        node.handle(c.now, StepDone(step, 1.0))
    assert node.outstanding == step  # the refused StepDone changed nothing
    before = node.learner.params.copy()
    assert replies(c.inject(0, request_from(c, 1, 0, 21, 0.5), c.nodes[1].info.addr))[0].chunks
    node.handle(c.now, Reading(False))  # the step still runs: still held
    np.testing.assert_array_equal(before, node.learner.params)
    assert node.trainer.dirty
    c.run_until(12.0)
    assert not node.trainer.dirty and node.learner.step >= 1


def test_a_read_between_steps_holds_and_its_end_applies():
    c = cluster(2, step_seconds=0.5, total_samples=64)  # finishes: no step outstanding then
    c.run_until(10.0)
    node = c.training_node(0)
    assert node.phase == "finished" and node.outstanding is None
    before = node.learner.params.copy()
    node.handle(c.now, Reading(True))
    shift = 0.01  # small: the distance guard knows how close the replicas have been
    assert replies(c.inject(0, request_from(c, 1, 0, 31, shift), c.nodes[1].info.addr))[0].chunks
    np.testing.assert_array_equal(before, node.learner.params)  # a write reads them
    node.handle(c.now, Reading(False))
    assert not node.trainer.dirty and float(np.mean(node.learner.params - before)) > shift / 4


def test_an_initiator_sends_a_part_it_cannot_hold_at_the_step_boundary():
    """Parts of 1024 coordinates, room for one held part: every exchange still runs all its
    parts, the held half steps never exceed the bound by more than one part."""
    part = 1024
    c = cluster(3, step_seconds=0.3, gossip=GossipConfig(average_every=2, fanout=0,
                                                         averaging="full", average_part=part))
    for i in range(3):
        c.training_node(i).trainer.held.capacity = part
    worst = []
    for k in range(1, 121):
        c.run_until(0.1 * k)
        worst.append(max(c.training_node(i).trainer.held.size for i in range(3)))
    assert max(worst) <= 2 * part
    parts = -(-MODEL.space.n_params // part)
    for i in range(3):
        stats = c.training_node(i).trainer.stats
        assert stats["average_started"] >= 1, stats
        assert stats["average_applied"] - stats["average_answered"] >= parts, (parts, stats)


def test_half_steps_held_during_a_step_never_move_a_replica_past_the_peers():
    """Each held half step is taken against the same frozen replica, so they add up: 40
    requests toward one point (each within the distance guard) used to move the replica 20
    times as far as the point was. The pulls held sum to at most HELD_PULL: the boundary's
    replica is a convex combination of the frozen one and the peers' snapshots."""
    c = cluster(2, step_seconds=10.0)
    c.run_until(3.0)  # node 0 is inside a 10 s step
    node = c.training_node(0)
    before = node.learner.params.copy()
    answered = [bool(replies(chained(c, 1, 0, snapshot_of(c, 1, 0.05), 100 + k)[1])[0].chunks)
                for k in range(40)]
    target = c.training_node(1).learner.params + np.float32(0.05)
    assert all(answered)  # answered (the peer's half), but only two half steps are held
    assert [p for _, _, p in node.trainer.held.pulls] == [HELD_PULL / 2] * 2
    c.run_until(12.0)  # the step ends
    moved = node.learner.params - before
    # at most as far as the peer's snapshot (as it travelled, rounded), and there
    assert np.abs(moved).max() <= 1.01 * np.abs(target - before).max()
    dist = np.sqrt(np.mean(np.square(node.learner.params - target)))
    assert dist < 0.02 * np.sqrt(np.mean(np.square(target - before)))


def test_the_pull_budget_is_kept_per_span():
    held = HeldDeltas(AveragingPlan(1000, part=100), 10**6)
    assert held.take(0.7, 0, 100) == 0.7
    assert held.take(0.5, 100, 200) == 0.5  # another part's span: its own budget
    assert held.take(0.5, 50, 150) == 0.0  # overlaps both: 1.2 spent there
    assert held.take(0.5, 0, 100) == pytest.approx(0.3)
    held.clear()
    assert held.take(0.5, 0, 100) == 0.5
