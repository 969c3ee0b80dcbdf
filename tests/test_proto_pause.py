"""A process stopped (SIGSTOP) and resumed: it first learns whether the leader lives before it
claims, and a paused leader writes no checkpoint in its old term after waking (issue 13,
item 2). In the in-memory harness, with virtual time: a paused node handles nothing until it
resumes, then its late timers and the messages that waited for it."""

from __future__ import annotations

import pytest

from p2ptrain.proto import GossipConfig, NodeConfig
from p2ptrain.proto.config import LOCAL
from tests.cluster.harness import Cluster, Network
from tests.cluster.training import TrainingCluster
from tests.test_node import learner

PAUSES = [3.0, 5.0, 12.0]  # seconds; the lease is LOCAL.lease (1 s)


def _leader(cluster: Cluster) -> int:
    leaders = cluster.leaders()
    assert len(leaders) == 1, leaders
    return leaders[0]


@pytest.mark.parametrize("pause", PAUSES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_follower_back_from_a_pause_does_not_take_the_lease(seed, pause):
    cluster = Cluster(5, seed=seed, priorities=[5, 0, 0, 0, 0])
    cluster.run_until(6.0)
    leader = _leader(cluster)
    assert leader == 0
    term = cluster.control(0).term
    follower = 3
    cluster.pause(follower, pause)
    woke = cluster.now + pause
    cluster.run_until(woke)
    claims = []  # (time, term) of every claim the paused node makes after waking
    cluster.observe(type("Watch", (), {"on_actions": staticmethod(
        lambda c, i, _e, actions: claims.extend(
            (c.now, a.term) for a in actions
            if i == follower and type(a).__name__ == "LeaderChanged"
            and a.leader == c.nodes[follower].info.node_id))})())
    cluster.run_until(woke + 5 * LOCAL.lease)
    assert claims == []
    assert _leader(cluster) == 0 and cluster.control(0).term == term
    assert cluster.control(follower).leader == cluster.nodes[0].info.node_id


@pytest.mark.parametrize("pause", [0.8, 1.0, 1.2])  # in leases: too short to count as a resume
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_best_follower_stalled_for_about_a_lease_does_not_take_the_lead(seed, pause):
    """It woke past its lease and claimed in the tick that noticed, before the renewals that
    waited for it were read: 10 seeds of 10 changed leaders at 0.8-1.0 lease (a review's
    harness), 6 at 1.2. Now a follower run late by more than a heartbeat reads first."""
    cluster = Cluster(5, seed=seed, priorities=[5, 4, 0, 0, 0])
    cluster.run_until(6.0)
    assert _leader(cluster) == 0
    term = cluster.control(0).term
    cluster.pause(1, pause * LOCAL.lease)
    cluster.run_until(cluster.now + pause * LOCAL.lease + 5 * LOCAL.lease)
    assert _leader(cluster) == 0 and cluster.control(0).term == term
    assert all(cluster.control(i).term == term for i in cluster.up())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_paused_leader_writes_nothing_in_its_old_term_after_waking(seed):
    cluster = Cluster(5, seed=seed, priorities=[5, 4, 0, 0, 0])
    cluster.run_until(6.0)
    assert _leader(cluster) == 0
    old_term = cluster.control(0).term
    pause = 6 * LOCAL.lease
    cluster.pause(0, pause)
    woke = cluster.now + pause
    cluster.run_until(woke - 0.01)
    moved_on = [i for i in cluster.leaders() if i != 0]  # node 0 has not run since
    assert moved_on == [1]  # the others elected the next best without it
    cluster.run_until(woke + 5 * LOCAL.lease)
    late = [(t, a.term) for t, i, a in cluster.checkpoints if i == 0 and t >= woke]
    assert all(term > old_term for _, term in late), late
    # one leader in the end, in a term above the old one
    final = _leader(cluster)
    assert cluster.control(final).term > old_term


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_lease_stretches_on_a_slow_link_and_the_leader_holds(seed):
    """Heartbeats that arrive up to 1.5 s late (a busy WiFi, a Starlink uplink) against a
    1 s lease: once the followers have heard a few renewals the leader holds; with the lease
    fixed (lease_max_mult 1) the same link keeps changing leaders (issue 13, item 3)."""
    slow = Network(delay=(0.0, 1.5))
    changes = {}
    for name, config in (("adaptive", LOCAL), ("fixed", LOCAL.with_(lease_max_mult=1.0))):
        cluster = Cluster(4, seed=seed, config=config, network=slow)
        cluster.run_until(20.0)
        settled = max(cluster.control(i).term for i in cluster.up())
        cluster.run_until(80.0)
        changes[name] = max(cluster.control(i).term for i in cluster.up()) - settled
    assert changes["adaptive"] == 0, changes
    assert changes["fixed"] > 0, changes  # the link is slow enough to matter


def _averaging_cluster(seed: int) -> TrainingCluster:
    """Three training nodes averaging after every step, 6 s in."""
    config = NodeConfig(gossip=GossipConfig(fanout=0, average_every=1, averaging="full"),
                        min_peers=0, join_fetch=False, average_timeout=1.0)
    c = TrainingCluster(3, seed, lambda i, node_id: learner(node_id), node_config=config,
                        step_seconds=0.1)
    c.run_until(6.0)
    return c


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_node_paused_with_an_exchange_open_does_not_blame_its_partner(seed):
    """The pause ran past the exchange's give-up: on waking, the overdue tick ended it as
    timed out, benched the partner for as long as the pause (up to an hour) and measured its
    link as slow as the pause. The exchange's clocks now move by the pause: the reply that
    waited in the socket completes it."""
    c = _averaging_cluster(seed)
    deadline = c.now + 30.0
    while not any(c.training_node(i).trainer.exchange for i in range(3)):
        assert c.now < deadline, "no exchange opened"
        c.run_for(0.001)
    i = next(i for i in range(3) if c.training_node(i).trainer.exchange)
    trainer = c.training_node(i).trainer
    peer, before = trainer.exchange.peer, dict(trainer.stats)
    c.pause(i, 10.0)
    c.run_for(10.5)
    assert c.control(i).resumes == 1
    assert trainer.stats["average_timeout"] == before.get("average_timeout", 0)
    assert peer not in trainer.benched
    assert trainer.stats["average_applied"] > before.get("average_applied", 0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_step_that_ends_first_after_a_pause_opens_an_exchange_that_is_not_postponed(seed):
    """A review's case: the first event after the pause was the step's end, which opened a
    new exchange before Control noticed the pause; the exchange was then moved 10 s into the
    future and its reply, measured over a negative time, stopped the node (a ValueError)."""
    c = _averaging_cluster(seed)
    deadline = c.now + 30.0

    def stepping_without_exchange() -> list[int]:
        return [i for i in range(3) if c.training_node(i).outstanding is not None
                and c.training_node(i).trainer.exchange is None]

    while not stepping_without_exchange():
        assert c.now < deadline, "no node stepping without an exchange"
        c.run_for(0.001)
    i = stepping_without_exchange()[0]
    node = c.training_node(i)
    c.pause(i, 10.0)
    c.run_until(c.now + 10.0)
    assert c.control(i).resumes == 1
    ex = node.trainer.exchange
    assert ex is None or ex.started <= c.now
    c.run_for(1.0)  # its reply is taken (a ValueError here before)
    assert node.trainer.stats["average_applied"] > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_follower_that_stalls_while_waiting_to_claim_does_not_spin(seed):
    """`stalled` moved the lease and not the claim due before it: the node asked to be woken
    at a time already past, over and over (the harness's virtual time stood still)."""
    cluster = Cluster(5, seed=seed, priorities=[5, 4, 0, 0, 0])
    cluster.run_until(6.0)
    cluster.crash(0)
    deadline = cluster.now + 10.0

    def waiting() -> list[int]:
        return [i for i in (2, 3, 4) if cluster.control(i).election.claim_at is not None
                and cluster.control(i).election.claim_at > cluster.now + 0.05]

    while not waiting():
        assert cluster.now < deadline, "no follower waiting to claim"
        cluster.run_for(0.001)
    i = waiting()[0]
    election = cluster.control(i).election
    cluster.pause(i, election.claim_at + 0.6 - cluster.now)  # late by > a heartbeat, < a lease
    events = []

    def count(c, j, _event, _actions) -> None:
        events.extend([j] if j == i else [])
        assert len(events) < 1000, f"node {i} woken {len(events)} times by {c.now:.3f}"

    cluster.observe(type("Count", (), {"on_actions": staticmethod(count)})())
    cluster.run_until(cluster.now + 5.0)  # (it spun at one virtual time for ever before)
    assert len(cluster.leaders()) == 1
