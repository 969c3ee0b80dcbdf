"""Leader election and the checkpoint schedule, in the in-memory cluster harness."""

from __future__ import annotations

import random

from p2ptrain.proto.config import LOCAL
from p2ptrain.proto.control import Control
from p2ptrain.proto.events import LeaderChanged, Leave, Progress, Received, SaveCheckpoint, Tick
from p2ptrain.proto.messages import Claim, Envelope
from p2ptrain.proto.records import LeaderView, Update
from tests.cluster.harness import Cluster, Network
from tests.cluster.monitor import Monitor
from tests.proto_samples import A, B, header, info


def _best(cluster: Cluster, among=None) -> int:
    among = cluster.up() if among is None else among
    inbound = [i for i in among if not cluster.nodes[i].info.outbound_only]
    return max(inbound, key=lambda i: cluster.nodes[i].info.priority_key())


def _agreed_leader(cluster: Cluster, among=None) -> int:
    among = cluster.up() if among is None else among
    leaders = [i for i in cluster.leaders() if i in among]
    assert len(leaders) == 1, leaders
    lid = cluster.nodes[leaders[0]].info.node_id
    assert all(cluster.control(j).leader == lid for j in among)
    return leaders[0]


def _monitored(*args, **kwargs) -> tuple[Cluster, Monitor]:
    monitor = Monitor()
    cluster = Cluster(*args, observers=[monitor], **kwargs)
    return cluster, monitor


def test_the_highest_priority_member_leads_after_start():
    cluster, monitor = _monitored(6, seed=1, priorities=[0, 3, 1, 3, 0, 2])
    cluster.run_until(5.0)
    assert _agreed_leader(cluster) == _best(cluster)
    assert cluster.nodes[_best(cluster)].info.priority == 3
    assert monitor.violations == []


def test_a_crashed_leader_is_replaced_within_two_leases():
    cluster, monitor = _monitored(6, seed=2, network=Network(loss=0.1))
    cluster.run_until(5.0)
    old = _agreed_leader(cluster)
    term = cluster.control(old).term
    cluster.crash(old)
    cluster.run_for(LOCAL.failover_bound(0) + 0.05)
    new = cluster.leaders()
    assert new == [_best(cluster)]
    assert cluster.control(new[0]).term > term
    cluster.run_for(3.0)
    assert _agreed_leader(cluster) == new[0]
    assert monitor.violations == []


def test_the_leader_and_its_two_best_successors_crash_together():
    cluster, monitor = _monitored(8, seed=3, priorities=[0, 1, 2, 3, 4, 5, 6, 7])
    cluster.run_until(5.0)
    assert _agreed_leader(cluster) == 7
    for i in (7, 6, 5):
        cluster.crash(i)
    # Node 4 knows 6 and 5 as live, so its rank is 2: it waits two back-offs.
    cluster.run_for(LOCAL.failover_bound(2) + 0.05)
    assert cluster.leaders() == [4]
    assert monitor.violations == []


def test_a_lapse_not_the_failure_detector_starts_the_claim():
    cluster = Cluster(5, seed=4)
    cluster.run_until(5.0)
    old = _agreed_leader(cluster)
    cluster.crash(old)
    cluster.run_for(LOCAL.failover_bound(0) + 0.05)
    assert cluster.leaders()  # replaced ...
    lid = cluster.nodes[old].info.node_id
    assert all(cluster.control(j).member_state(lid) != "dead" for j in cluster.up())
    # ... long before anyone declared the old leader dead.


def test_leases_renew_by_relay_when_the_leaders_heartbeats_do_not_arrive():
    cluster, monitor = _monitored(5, seed=5)
    cluster.run_until(5.0)
    leader = _agreed_leader(cluster)
    follower = next(j for j in cluster.up() if j != leader)
    cluster.block(leader, follower)
    cluster.run_for(20.0)
    assert _agreed_leader(cluster) == leader  # the follower never lapsed into a claim
    assert len(monitor.claims) == 1


def test_partition_elects_a_leader_per_side_and_the_heal_moves_above_both():
    cluster, monitor = _monitored(7, seed=6, priorities=[0, 0, 0, 0, 0, 0, 0])
    cluster.run_until(5.0)
    leader = _agreed_leader(cluster)
    side = [leader, (leader + 1) % 7, (leader + 2) % 7]
    rest = [i for i in range(7) if i not in side]
    cluster.partition([side])
    cluster.run_for(15.0)
    assert _agreed_leader(cluster, side) == leader
    other = _agreed_leader(cluster, rest)
    terms = (cluster.control(leader).term, cluster.control(other).term)
    before = max((term, step) for _, _, term, step in monitor.checkpoints)
    heal_time = cluster.now
    cluster.heal()
    cluster.run_for(20.0)
    winner = _agreed_leader(cluster)
    assert cluster.control(winner).term > max(terms)
    after = [(term, step) for t, _, term, step in monitor.checkpoints if t > heal_time + 10.0]
    assert after and min(after) > before and after == sorted(after)
    assert monitor.violations == []


def test_two_leaders_of_the_same_term_meet_and_the_winner_moves_up():
    cluster, monitor = _monitored(6, seed=7, start=False)
    cluster.partition([[0, 1, 2]])
    for i in range(6):
        cluster.restart(i)
    cluster.run_until(8.0)
    a, b = _agreed_leader(cluster, [0, 1, 2]), _agreed_leader(cluster, [3, 4, 5])
    assert cluster.control(a).term == cluster.control(b).term == 1  # both claimed term 1
    before = max((term, step) for _, _, term, step in monitor.checkpoints)
    heal_time = cluster.now
    cluster.heal()
    cluster.run_for(15.0)
    winner = _agreed_leader(cluster)
    assert cluster.control(winner).term >= 2
    after = [(term, step) for t, _, term, step in monitor.checkpoints if t > heal_time + 5.0]
    assert after and min(after) > before  # the winner's steps may be behind the loser's
    assert monitor.violations == []


def test_a_leader_that_hears_a_higher_claim_steps_down_at_once():
    ctl = Control(LOCAL, info(A, priority=5), incarnation=1, now=0.0, rng=random.Random(1))
    ctl.handle(0.0, Received("h:2", Envelope(header(B), _sync_of(B))))
    ctl.handle(0.1, Progress(10, 100, 80))
    while not ctl.is_leader:
        ctl.handle(max(ctl.now, ctl.next_deadline()), Tick())
    term = ctl.term
    claim = Envelope(header(B, LeaderView(term + 1, B, 0, 12.5, 0)), Claim())
    actions = ctl.handle(ctl.now, Received("h:2", claim))
    assert not ctl.is_leader
    assert LeaderChanged(term + 1, B) in actions
    t, saved = ctl.now, []
    for step in range(11, 40):  # time passes, training goes on
        t += 0.5
        saved += ctl.handle(t, Progress(step, step * 10, step * 8))
        while (d := ctl.next_deadline()) is not None and d <= t:
            saved += ctl.handle(max(d, ctl.now), Tick())
    saved = [a for a in saved if isinstance(a, SaveCheckpoint)]
    # B never heartbeats, so A's lease lapses and A claims again -- above B's claim.
    assert saved and all(a.term > term + 1 for a in saved)


def _sync_of(node_id):
    from p2ptrain.proto.messages import SyncRequest
    return SyncRequest((Update("alive", node_id, 1, node_id, info(node_id, "h:2")),), {})


def test_outbound_only_members_never_claim():
    cluster, monitor = _monitored(4, seed=8, priorities=[9, 9, 0, 0], outbound_only=(0, 1))
    cluster.run_until(10.0)
    leader = _agreed_leader(cluster)
    assert leader in (2, 3)
    cluster.crash(2)
    cluster.crash(3)
    cluster.run_for(20.0)
    assert cluster.leaders() == []
    assert all(key[3] not in {cluster.nodes[i].info.node_id for i in (0, 1)}
               for key in monitor.claims)


def test_a_member_holding_its_claims_neither_claims_nor_wakes_for_it_until_released():
    """Control.hold_claims (a joiner fetching the swarm's checkpoint): the best successor
    holds while the leader dies, so the next one claims; held, its lapse asks for no wake-up
    (a deadline in the past would wake it for ever); released, it follows -- and, alone,
    claims."""
    cluster, monitor = _monitored(3, seed=4)
    cluster.run_until(5.0)
    old = _agreed_leader(cluster)
    best = _best(cluster, [i for i in cluster.up() if i != old])
    cluster.control(best).hold_claims(True)
    cluster.crash(old)
    cluster.run_for(LOCAL.failover_bound(1) + 1.0)
    nxt = cluster.leaders()
    assert nxt and best not in nxt
    election = cluster.control(best).election
    assert not election.leading and election.claim_at is None
    cluster.control(best).hold_claims(False)
    cluster.run_for(2.0)
    assert cluster.leaders() == nxt and cluster.control(best).leader is not None
    cluster.control(best).hold_claims(True)
    cluster.crash(nxt[0])
    cluster.run_for(LOCAL.failover_bound(0) + 1.0)
    assert cluster.leaders() == [] and election.lapse_reported
    deadline = election.next_deadline()
    assert deadline is None or deadline > cluster.now
    cluster.control(best).hold_claims(False)
    cluster.run_for(LOCAL.failover_bound(0) + 1.0)
    assert cluster.leaders() == [best]
    assert monitor.violations == []


def test_checkpoints_follow_the_leaders_clock_and_carry_term_step_and_samples():
    cluster, monitor = _monitored(4, seed=9, progress_interval=0.5)
    cluster.run_until(30.0)
    leader = _agreed_leader(cluster)
    mine = [(t, a) for t, i, a in cluster.checkpoints if i == leader]
    assert len(mine) >= 10
    times = [t for t, _ in mine]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= LOCAL.checkpoint_interval - 1e-9
    assert max(gaps) <= LOCAL.checkpoint_interval + 1e-9
    steps = [a.step for _, a in mine]
    assert steps == sorted(set(steps))
    last = mine[-1][1]
    assert last.term == cluster.control(leader).term and last.leader == cluster.nodes[
        leader].info.node_id
    assert last.swarm_samples > 0
    assert monitor.violations == []


def test_checkpoint_by_samples_and_the_final_checkpoint():
    cfg = LOCAL.with_(checkpoint_interval=1000.0, checkpoint_samples=500)
    ctl = Control(cfg, info(A), incarnation=1, now=0.0, rng=random.Random(2))
    while not ctl.is_leader:
        ctl.handle(max(ctl.now, ctl.next_deadline()), Tick())
    saved = []
    for step in range(1, 60):
        saved += [a for a in ctl.handle(ctl.now, Progress(step, step * 100, step * 100))
                  if isinstance(a, SaveCheckpoint)]
    assert [a.swarm_samples for a in saved] == list(range(500, 6000, 500))
    final = ctl.handle(ctl.now, Progress(60, 6000, 6000, finished=True))
    assert [a.final for a in final if isinstance(a, SaveCheckpoint)] == [True]


def test_a_leader_that_leaves_resigns_and_another_claims_at_once():
    cluster, monitor = _monitored(5, seed=10)
    cluster.run_until(5.0)
    leader = _agreed_leader(cluster)
    cluster._handle(cluster.nodes[leader], Leave())
    t = cluster.now
    while not cluster.leaders():
        cluster.run_for(0.01)
    assert cluster.now - t < LOCAL.lease / 2  # no lease to wait out: the best claims at once
    assert cluster.leaders() == [_best(cluster, [i for i in cluster.up() if i != leader])]
    assert monitor.violations == []


def test_a_restarted_leader_claims_above_its_previous_terms():
    cluster, monitor = _monitored(3, seed=11)
    cluster.run_until(5.0)
    leader = _agreed_leader(cluster)
    for other in cluster.up():
        if other != leader:
            cluster.crash(other)
    cluster.run_for(1.0)
    term = cluster.control(leader).term
    cluster.crash(leader)
    cluster.restart(leader)  # alone now: it claims again, above what it claimed before
    cluster.run_for(5.0)
    assert cluster.leaders() == [leader] and cluster.control(leader).term > term
    assert monitor.violations == []
