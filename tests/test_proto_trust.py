"""Issue 13, items 8 and 9: one member holding the swarm key must not end the run for everyone.
A term, an incarnation or a sample count a peer sends may only move this node's state by a
bounded step; the swarm carries on after each attack. In-memory cluster, virtual time."""

from __future__ import annotations

from p2ptrain.proto.config import LOCAL
from p2ptrain.proto.events import RemoteError
from p2ptrain.proto.messages import (
    PROTOCOL_VERSION,
    Claim,
    Envelope,
    Header,
    Leave,
    Notify,
    SyncRequest,
    Yield,
)
from p2ptrain.proto.records import LEFT, MAX_EPOCH, LeaderView, Update
from tests.cluster.harness import Cluster

HUGE = 2**52
STEP = LOCAL.max_epoch_step


def _running(n: int = 5, seed: int = 31) -> Cluster:
    c = Cluster(n, seed)
    c.run_until(5.0)
    assert len(c.leaders()) == 1
    return c


def _header(c: Cluster, who: int, view=None, updates=(), incarnation=None) -> Header:
    node, ctl = c.nodes[who], c.control(who)
    inc = ctl.incarnation if incarnation is None else incarnation
    return Header(PROTOCOL_VERSION, node.info.node_id, inc, node.info.addr,
                  node.info.fingerprint, 1, 1, 1, view, tuple(updates))


def _to_all(c: Cluster, sender: int, body, **header) -> list[list]:
    env = Envelope(_header(c, sender, **header), body)
    return [c.inject(j, env, c.nodes[sender].info.addr) for j in c.up() if j != sender]


def _one_leader(c: Cluster) -> int:
    leaders = c.leaders()
    assert len(leaders) == 1, leaders
    lid = c.nodes[leaders[0]].info.node_id
    assert all(c.control(j).leader == lid for j in c.up())
    return leaders[0]


def _epochs_sane(c: Cluster, limit: int) -> None:
    for j in c.up():
        ctl = c.control(j)
        assert ctl.term <= limit and ctl.incarnation <= limit
        assert all(inc <= limit for _, inc, _ in ctl.members().values())


def test_a_claim_at_a_huge_term_is_refused_and_changes_nothing():
    c = _running()
    term = c.control(_one_leader(c)).term
    attacker = next(j for j in c.up() if j not in c.leaders())
    me = c.nodes[attacker].info
    view = LeaderView(HUGE, me.node_id, me.priority, me.capability, 0)
    for j in c.up():
        if j == attacker:
            continue
        before = c.control(j).snapshot()
        actions = c.inject(j, Envelope(_header(c, attacker, view=view), Claim()), me.addr)
        assert [type(a) for a in actions] == [RemoteError]
        assert c.control(j).snapshot() == before
    c.run_for(20.0)
    _one_leader(c)
    _epochs_sane(c, term + 4)


def test_a_relayed_view_at_a_huge_term_moves_the_term_by_a_bounded_step_only():
    c = _running()
    leader = _one_leader(c)
    term = c.control(leader).term
    relay = next(j for j in c.up() if j != leader)
    info = c.nodes[leader].info
    view = LeaderView(HUGE, info.node_id, info.priority, info.capability, 0)
    _to_all(c, relay, Notify(), view=view)
    for j in c.up():
        assert c.control(j).term <= term + STEP
    c.run_for(20.0)
    _one_leader(c)  # the swarm still agrees on one leader, at a term peers accept
    _epochs_sane(c, term + STEP + 4)
    c.crash(_one_leader(c))  # and can still fail over
    c.run_for(LOCAL.failover_bound(0) + 1.0)
    _one_leader(c)


def test_a_view_naming_a_non_member_is_not_followed():
    c = _running()
    leader = _one_leader(c)
    term = c.control(leader).term
    relay = next(j for j in c.up() if j != leader)
    view = LeaderView(term + 1, "f" * 32, 9, 9.0, 0)
    _to_all(c, relay, Notify(), view=view)
    for j in c.up():
        assert c.control(j).leader == c.nodes[leader].info.node_id
        assert c.control(j).term == term


def test_a_yield_at_a_huge_term_is_refused():
    c = _running()
    leader = _one_leader(c)
    other = next(j for j in c.up() if j != leader)
    term = c.control(leader).term
    before = c.control(leader).snapshot()
    env = Envelope(_header(c, other, view=c.control(other).election.view), Yield(HUGE, term))
    actions = c.inject(leader, env, c.nodes[other].info.addr)
    assert [type(a) for a in actions] == [RemoteError]
    assert c.control(leader).snapshot() == before


def test_a_forged_left_at_a_huge_incarnation_does_not_expel_the_member():
    c = _running()
    victim, forger = 1, 2
    vid = c.nodes[victim].info.node_id
    forged = Update(LEFT, vid, HUGE, vid)
    _to_all(c, forger, Notify(), updates=(forged,))
    c.run_for(20.0)
    for j in c.up():
        if j != victim:
            state, inc, _ = c.control(j).member(vid)
            assert state == "alive" and inc < STEP
    _epochs_sane(c, 2 * STEP)


def test_a_forged_left_within_the_step_is_refuted():
    c = _running()
    victim, forger = 1, 2
    vid = c.nodes[victim].info.node_id
    inc = c.control(victim).incarnation
    _to_all(c, forger, Notify(), updates=(Update(LEFT, vid, inc + STEP, vid),))
    c.run_for(20.0)
    for j in c.up():
        if j != victim:
            assert c.control(j).member(vid)[0] == "alive"


def test_a_leave_at_a_huge_incarnation_is_refused():
    c = _running()
    sender = 1
    for actions in _to_all(c, sender, Leave(), incarnation=HUGE):
        assert [type(a) for a in actions] == [RemoteError]
    sid = c.nodes[sender].info.node_id
    assert all(c.control(j).member(sid)[0] == "alive" for j in c.up() if j != sender)


def test_a_sync_listing_a_huge_incarnation_is_merged_without_it():
    c = _running()
    target, sender, victim = 0, 1, 2
    vid = c.nodes[victim].info.node_id
    listing = c.control(sender).membership.table.listing()
    forged = tuple(Update("suspect", u.node_id, HUGE, u.reporter, u.info)
                   if u.node_id == vid else u for u in listing)
    c.inject(target, Envelope(_header(c, sender), SyncRequest(forged, {})),
             c.nodes[sender].info.addr)
    state, inc, _ = c.control(target).member(vid)
    assert state == "alive" and inc < STEP
    assert c.control(target).membership.table.ceiling <= c.control(target).incarnation + STEP
    assert c.control(target).membership.table.skipped == 1
