"""Issue 13, items 8 and 9: one member holding the swarm key must not end the run for everyone.
A term, an incarnation or a sample count a peer sends may only move this node's state by a
bounded step; the swarm carries on after each attack. In-memory cluster, virtual time."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

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
from p2ptrain.proto.records import HEARD, LEFT, LeaderView, Update
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


def test_a_claim_at_a_huge_term_moves_the_term_by_a_bounded_step_and_is_not_followed():
    c = _running()
    leader = _one_leader(c)
    term = c.control(leader).term
    attacker = next(j for j in c.up() if j not in c.leaders())
    me = c.nodes[attacker].info
    view = LeaderView(HUGE, me.node_id, me.priority, me.capability, 0)
    for j in c.up():
        if j == attacker:
            continue
        c.inject(j, Envelope(_header(c, attacker, view=view), Claim()), me.addr)
        assert c.control(j).term == term + STEP  # one step, not followed
        assert c.control(j).leader == c.nodes[leader].info.node_id
    c.run_for(20.0)
    _one_leader(c)
    _epochs_sane(c, term + STEP + 4)


def _split_free(c: Cluster, seconds: float = 60.0) -> None:
    """One leader that every live node follows, now and after that leader crashes."""
    c.run_for(seconds)
    c.crash(_one_leader(c))
    c.run_for(seconds)
    _one_leader(c)


def test_a_node_whose_term_a_member_pushed_far_ahead_still_leads_its_peers():
    """Relays from far ahead move a node's term a step a message without a claim to follow:
    when it claims, peers a few steps behind must catch up, not refuse it as too far ahead
    (they used to refuse all its traffic, declare it dead and elect another: two leaders)."""
    c = _running()
    leader = _one_leader(c)
    info = c.nodes[leader].info
    victim = max((j for j in c.up() if j != leader), key=lambda j: c.nodes[j].info.priority_key())
    attacker = next(j for j in c.up() if j not in (leader, victim))
    for _ in range(3):
        view = LeaderView(c.control(victim).term + STEP + 1, info.node_id, info.priority,
                          info.capability, 0)
        c.inject(victim, Envelope(_header(c, attacker, view=view), Notify()),
                 c.nodes[attacker].info.addr)
    assert c.control(victim).term > c.control(leader).term + 2 * STEP
    c.crash(leader)  # the victim is next in line
    c.run_for(30.0)
    assert _one_leader(c) == victim
    _split_free(c)


def test_yields_from_a_step_ahead_move_the_leader_within_its_peers_reach():
    c = _running()
    leader = _one_leader(c)
    attacker = next(j for j in c.up() if j != leader)
    for _ in range(3):
        term = c.control(leader).term
        env = Envelope(_header(c, attacker, view=c.control(attacker).election.view),
                       Yield(term + STEP, term))
        c.inject(leader, env, c.nodes[attacker].info.addr)
        assert c.control(leader).term == term + STEP
    _split_free(c)


def test_a_flood_of_yields_does_not_postpone_the_leaders_checkpoints():
    c = _running()
    leader = _one_leader(c)
    attacker = next(j for j in c.up() if j != leader)
    start = c.now
    while c.now < start + 3 * LOCAL.checkpoint_interval:
        term = c.control(leader).term
        env = Envelope(_header(c, attacker, view=c.control(attacker).election.view),
                       Yield(term, term))
        c.inject(leader, env, c.nodes[attacker].info.addr)
        c.run_for(LOCAL.checkpoint_interval / 4)
    assert sum(1 for t, i, _ in c.checkpoints if i == leader and t > start) >= 2


def _relay_to_all(c: Cluster, attacker: int, view: LeaderView, seconds: float) -> None:
    end = c.now + seconds
    while c.now < end:
        _to_all(c, attacker, Notify(), view=view)
        view = LeaderView(view.term, view.leader, view.priority, view.capability, view.seq + 1)
        c.run_for(0.5)


def test_relays_naming_a_member_that_cannot_lead_change_nothing():
    """A relayed view naming an outbound-only member with a made-up top priority, renewed
    every half second, used to make the leader step down and everyone follow a member that
    never leads: no leader, no checkpoint for as long as the relays went on."""
    c = Cluster(5, 31, outbound_only=[4])
    c.run_until(5.0)
    leader = _one_leader(c)
    attacker = next(j for j in c.up() if j not in (leader, 4))
    x = c.nodes[4].info
    start = c.now
    _relay_to_all(c, attacker, LeaderView(c.control(attacker).term, x.node_id, 2**31 - 1,
                                          x.capability, 10**6), 60.0)
    assert _one_leader(c) == leader
    assert sum(1 for t, i, _ in c.checkpoints if i == leader and t > start) >= 2


def test_relayed_heartbeats_of_a_crashed_leader_do_not_hold_off_the_failover():
    c = _running()
    leader = _one_leader(c)
    attacker = next(j for j in c.up() if j != leader)
    view = c.control(attacker).election.view
    c.crash(leader)
    _relay_to_all(c, attacker, LeaderView(view.term, view.leader, view.priority,
                                          view.capability, view.seq + 10**6), 40.0)
    assert _one_leader(c) != leader


def test_a_relayed_later_heartbeat_does_not_make_followers_deaf_to_the_leader():
    c = _running()
    leader = _one_leader(c)
    attacker = next(j for j in c.up() if j != leader)
    view = c.control(attacker).election.view
    term = c.control(leader).term
    _to_all(c, attacker, Notify(), view=LeaderView(view.term, view.leader, view.priority,
                                                   view.capability, 10**9))
    c.run_for(30.0)
    assert _one_leader(c) == leader and c.control(leader).term == term


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


# -- item 9: the swarm sample count --------------------------------------------------------------


def _training(n: int = 4, total: int = 100_000, step_seconds=0.25):
    from tests.test_node import cluster

    c = cluster(n, step_seconds=step_seconds, total_samples=total)
    c.run_until(6.0)
    assert all(c.training_node(i).phase == "training" for i in range(n))
    return c


def _forged_counts(c, forger: int, victim: int, value: int):
    """Every way a member can hand node `victim`'s neighbours a sample count of `value`."""
    from p2ptrain.proto.gossip.messages import AverageRequest

    fid, vid = c.nodes[forger].info.node_id, c.nodes[victim].info.node_id
    ctl = c.training_node(forger).control
    listing = ctl.membership.table.listing()
    yield Header(PROTOCOL_VERSION, fid, ctl.incarnation, c.nodes[forger].info.addr,
                 c.nodes[forger].info.fingerprint, value, 1, 1, None, ()), Notify()
    yield _header(c, forger), SyncRequest(listing, {vid: value, fid: value})
    yield _header(c, forger), AverageRequest(5, 1, {vid: value, "e" * 32: value}, (b"x",))


def test_a_member_sending_the_runs_total_does_not_end_the_run():
    total = 100_000
    c = _training(total=total)
    forger = 1
    for i in c.up():
        if i == forger:
            continue
        for header, body in _forged_counts(c, forger, 2, total):
            c.inject(i, Envelope(header, body), c.nodes[forger].info.addr)
    for value in (2**53, total):  # ... nor a larger forged count, nor a second try
        for header, body in _forged_counts(c, forger, 3, value):
            c.inject(0, Envelope(header, body), c.nodes[forger].info.addr)
    c.run_for(10.0)
    for i in c.up():
        node = c.training_node(i)
        assert node.phase == "training" and node.learner.count.total < total // 4, i
        assert "e" * 32 not in node.learner.count.as_dict()  # not a member: no entry
        assert node.control.sample_counts().keys() <= {n.info.node_id for n in c.nodes}
    true = sum(c.training_node(i).learner.samples for i in c.up())
    counts = [c.training_node(i).learner.count.total for i in c.up()]
    assert max(counts) < true + 4 * LOCAL.count_burst  # one burst per entry, at most


def _made_up(template, n: int) -> tuple:
    """`n` members no one runs, as a member may list them (this swarm's fingerprint)."""
    out = []
    for k in range(n):
        node_id = f"{k + 1:032x}"
        info = replace(template, node_id=node_id, addr=f"203.0.113.{k % 250 + 1}:7100")
        out.append(Update("alive", node_id, 1, node_id, info))
    return tuple(out)


def test_made_up_members_with_big_counts_do_not_end_the_run():
    """One listing of 40 made-up members, each counting a burst: each used to get a burst of
    its own (40 x 4096 past a total of 100,000: every node finished)."""
    total = 100_000
    c = _training(total=total)
    forger = 1
    me = c.nodes[forger].info
    fakes = _made_up(me, 40)
    listing = c.training_node(forger).control.membership.table.listing() + fakes
    counts = {u.node_id: LOCAL.count_burst for u in fakes}
    for _ in range(2):
        c.inject(0, Envelope(_header(c, forger), SyncRequest(listing, counts)), me.addr)
    c.run_for(3.0)
    true = sum(c.training_node(i).learner.samples for i in c.up())
    for i in c.up():
        node = c.training_node(i)
        assert node.phase == "training", i
        assert node.learner.count.total < true + 2 * LOCAL.count_burst, i


def test_a_fast_node_and_a_node_back_from_a_long_partition_are_counted_in_full():
    c = _training(step_seconds=[0.02, 0.25, 0.25, 0.25])  # node 0 is 12x faster
    c.partition([[3]])
    c.run_for(90.0)  # node 3 trains alone, far longer than any burst covers
    c.heal()
    c.run_for(60.0)
    true = {c.nodes[i].info.node_id: c.training_node(i).learner.samples for i in c.up()}
    for i in c.up():
        seen = c.training_node(i).learner.count.as_dict()
        for node_id, samples in true.items():
            lag = samples - seen.get(node_id, 0)
            assert lag <= 0.05 * samples + 200, (i, node_id, samples, seen.get(node_id))


def test_the_sample_guard_clamps_growth_to_rate_and_burst():
    from p2ptrain.proto.membership.samples import RATE_WINDOW, SampleGuard

    cfg = LOCAL.with_(count_burst=100, count_burst_seconds=10.0, count_rate_margin=4.0,
                      count_rate_cap=8.0)
    me, a, b = "a" * 32, "b" * 32, "c" * 32
    guard = SampleGuard(cfg, me)
    guard.baseline({a: 1000, "d" * 32: 50}, 0.0)  # a resume checkpoint: taken whole
    members = {a, b}
    assert guard.admit({a: 1000, "d" * 32: 50, "e" * 32: 7}, 0.0, members) == {
        a: 1000, "d" * 32: 50}  # e is no member: no entry
    # No rate observed yet: the bucket holds count_burst + burst_seconds of the fallback rate.
    assert guard.admit({b: 10**9}, 0.0, members) == {b: 100}
    assert guard.admit({b: 10**9}, 0.0, members) == {b: 100}  # spent: repeats add nothing
    for t in range(1, 31):  # this node trains 10 samples/s; b keeps pace
        guard.own(10 * t, float(t))
        guard.admit({b: 100 + 10 * t}, float(t), members)
    assert RATE_WINDOW < 30
    # b's observed rate is 10/s: it may grow 40/s, at most its bucket of 100 + 10 s x 40 at once.
    got = guard.admit({b: 10**9}, 40.0, members)[b] - 400
    assert 10 * 40 <= got <= 100 + 10 * 40
    assert guard.clamped >= 3
    assert guard.admit({b: 5}, 40.0, members) == {b: 5}  # lower values pass as they are


def test_an_observed_rate_is_recent_not_a_lifetime_average():
    """A member that spent five minutes fetching a checkpoint (its entry still), then trains
    at 10 samples/s, is seen at ~10/s a minute later -- it was seen at 1.7/s (the average
    since first seen), slow for many minutes: pulled most of the way to every partner, left
    out of the fast core, its gradients' weight capped. One that stops is seen at its
    lifetime rate, as before (a window without a step of a slow member must not read 0)."""
    from p2ptrain.proto.membership.samples import RATE_SPAN, SampleGuard

    me, b = "a" * 32, "b" * 32
    guard = SampleGuard(LOCAL, me)
    guard.admit({b: 500}, 0.0, {b})
    for t in range(0, 301, 5):  # fetching: no growth
        guard.own(10 * t, float(t))
        guard.admit({b: 500}, float(t), {b})
        assert guard.rate(b, float(t)) in (None, 0.0)
    for t in range(301, 361):
        guard.own(10 * t, float(t))
        guard.admit({b: 500 + 10 * (t - 300)}, float(t), {b})
    assert 2 * RATE_SPAN <= 60
    assert guard.rate(b, 360.0) == pytest.approx(10.0, rel=0.05)
    assert guard.rate(me, 360.0) == pytest.approx(10.0)
    for t in range(361, 426):  # b stops
        guard.admit({b: 500 + 600}, float(t), {b})
    assert guard.rate(b, 425.0) == pytest.approx(600 / 425)


def test_a_long_standing_member_cannot_compound_its_count_fast():
    """The count's bound keeps the lifetime rate: a member honest for an hour that then
    claims 2^53 every second gains a bounded excess in ten minutes (a recent rate in the
    bound let it compound 4x a span, to the cap in ~40 s: 1.5e7 samples, 25 honest hours)."""
    from p2ptrain.proto.membership.samples import SampleGuard

    me, bad = "a" * 32, "f" * 32
    honest = [c * 32 for c in "bcd"]
    members = {*honest, bad}
    guard = SampleGuard(LOCAL, me)
    for t in range(0, 3601):
        guard.own(100 * t, float(t))
        guard.admit({p: 100 * t for p in (*honest, bad)}, float(t), members)
    for t in range(3601, 4201):
        guard.own(100 * t, float(t))
        got = guard.admit({**{p: 100 * t for p in honest}, bad: 2**53}, float(t), members)
    excess = got[bad] - 100 * 4200
    assert 0 < excess < 2_000_000, excess  # ~5.5 honest hours at most, not 25
    assert guard.rate(bad, 4200.0) < 64 * 100 * 4


def test_a_fetched_checkpoint_brings_counts_under_the_same_bound():
    c = _training()
    node = c.training_node(0)
    before = node.learner.count.as_dict()
    forged = {**before, c.nodes[1].info.node_id: 2**53, "e" * 32: 10**6}
    node._adopt_counts(forged)  # what adopting a fetched checkpoint does with its counter
    after = node.learner.count.as_dict()
    assert "e" * 32 not in after
    assert after[c.nodes[1].info.node_id] < before[c.nodes[1].info.node_id] + 4 * LOCAL.count_burst
    assert node.learner.count.total < 100_000 // 4


def test_the_sample_guard_makes_room_by_forgetting_members_the_table_forgot(monkeypatch):
    """Entries used to stay for good: once full (made-up members), a later joiner was never
    counted by this node."""
    from p2ptrain.proto.membership import samples

    monkeypatch.setattr(samples, "MAX_ENTRIES", 4)
    guard = samples.SampleGuard(LOCAL, "me")
    old = {f"old{k}": 0 for k in range(4)}
    assert guard.admit(old, 0.0, old.keys()) == old
    assert guard.admit({"late": 5}, 1.0, {*old, "late"}) == {}  # full, all still members
    assert guard.admit({"late": 5}, 2.0, {"late"}) == {"late": 5}  # the table forgot them
    assert set(guard.entries) == {"late"}


def test_the_member_table_is_bounded(monkeypatch):
    from p2ptrain.proto.membership import table

    monkeypatch.setattr(table, "MAX_MEMBERS", 10)
    c = _running()
    me = c.nodes[1].info
    listing = c.control(1).membership.table.listing() + _made_up(me, 20)
    c.inject(0, Envelope(_header(c, 1), SyncRequest(listing, {})), me.addr)
    members = c.control(0).membership.table
    assert len(members.members) == 10 and members.full == 14
    c.run_for(20.0)
    _one_leader(c)


def test_per_member_figures_stay_bounded_as_made_up_members_come_and_go(monkeypatch):
    """A key holder may list made-up members and speak for them (README); the table forgets
    them, but a node's per-member figures (traffic, progress, refusals, gradients used) kept
    every id ever heard. They are now dropped past a bound, the traffic totals kept whole."""
    from itertools import pairwise

    from p2ptrain.proto import nodestatus
    from p2ptrain.proto.membership import table

    monkeypatch.setattr(table, "MAX_MEMBERS", 10)
    monkeypatch.setattr(nodestatus, "FIGURES_BOUND", 20)
    c = _training()
    forger, victim = 1, 0
    me = c.nodes[forger].info
    node = c.training_node(victim)
    listing = c.training_node(forger).control.membership.table.listing()
    serial, totals = 0, []
    for _ in range(10):
        c.run_for(31.0)  # the table forgets the last batch
        fakes = []
        for _ in range(6):
            serial += 1
            nid = f"{0xabc000 + serial:032x}"
            info = replace(me, node_id=nid, addr=f"203.0.113.{serial % 250 + 1}:7100")
            fakes.append(Update("alive", nid, 1, nid, info))
        c.inject(victim, Envelope(_header(c, forger), SyncRequest(listing + tuple(fakes), {})),
                 me.addr)
        for u in fakes:
            header = Header(PROTOCOL_VERSION, u.node_id, 1, u.info.addr, u.info.fingerprint, 1,
                            1, 1, None, ())
            c.inject(victim, Envelope(header, Notify()), u.info.addr)
        status = node.status()
        totals.append((status["bytes_in"], status["bytes_out"]))
    assert serial == 60 and len(node.control.membership.table.members) <= 10 + 6
    for figure in (node.bytes_in, node.bytes_out, node.trainer.peer_progress,
                   node.trainer.guard.refused, node.trainer.mixer.used, node.trainer.served):
        assert len(figure) <= 20 + 6 + 4, len(figure)  # the bound, a batch, the real members
    assert node.bytes_gone[0] > 0  # forgotten members' traffic: still in the totals,
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in pairwise(totals)), totals  # growing


def test_a_member_claiming_the_next_term_every_few_seconds_does_not_stop_checkpoints():
    """Its own claim at its real rank, one term up, then no heartbeat: every claim unseated
    the leader, and every new claim after the lapse restarted the checkpoint schedule -- no
    checkpoint in 120 s at a 20 s interval (6 without it). A node that led keeps its
    deadline now."""
    cfg = LOCAL.with_(checkpoint_interval=20.0)
    counts = []
    for attack in (False, True):
        c = Cluster(5, 31, cfg)
        c.run_until(5.0)
        attacker = next(j for j in c.up() if not c.control(j).is_leader)
        me = c.nodes[attacker].info
        start, changes, last = c.now, 0, c.leaders()
        while c.now < start + 120.0:
            if attack:
                term = max(c.control(j).term for j in c.up() if j != attacker) + 1
                view = LeaderView(term, me.node_id, me.priority, me.capability, 0)
                _to_all(c, attacker, Claim(), view=view)
            for _ in range(50):
                c.run_for(0.1)
                changes, last = (changes + 1, c.leaders()) if c.leaders() != last else (
                    changes, last)
        counts.append((len([t for t, _, _ in c.checkpoints if t > start]), changes))
    (calm, calm_changes), (attacked, attacked_changes) = counts
    assert calm_changes == 0 and calm == 6
    assert attacked_changes >= 20  # the attack took: the lead changed hands all along
    assert attacked >= 5, counts


def test_a_new_leader_writes_at_once_but_not_again_within_a_checkpoint_interval():
    from p2ptrain.config import resolve, settings_of
    from p2ptrain.housekeeping import Housekeeping

    plan = Housekeeping(settings_of(resolve(None, {}, {})), 0.0, 0)  # checkpoints every 120 s
    assert plan.lead_save(3.0)  # the first lead: a checkpoint of its own at once
    assert not plan.lead_save(8.0) and not plan.lead_save(122.9)  # led again, and again
    assert plan.lead_save(123.0)
    off = Housekeeping(settings_of(resolve(None, {"P2PTRAIN_CHECKPOINT_EVERY_SECONDS": "0"},
                                           {})), 0.0, 0)  # timed checkpoints off: a gap still
    assert off.lead_save(3.0) and not off.lead_save(8.0) and off.lead_save(123.0)


def test_a_relayed_beat_of_2_53_does_not_silence_a_live_outbound_only_member():
    """Beats counted only above the highest heard, the member's own messages too: after one
    relay of 2^53 nothing refreshed it, it was suspected every few seconds and moved up an
    incarnation each time (15 in 60 s), the attacker repeating after each."""
    c = Cluster(5, 31, outbound_only=[4])
    c.run_until(8.0)
    x, attacker, honest = c.nodes[4].info.node_id, 1, (0, 2, 3)
    states, sent = Counter(), 0
    for _ in range(600):
        inc = c.control(attacker).member(x)[1]
        if any(c.control(j).membership.table.members[x].beat < 2**53 for j in honest):
            reporter = c.nodes[attacker].info.node_id
            _to_all(c, attacker, Notify(), updates=(Update(HEARD, x, inc, reporter, beat=2**53),))
            sent += 1
        c.run_for(0.1)
        states.update(c.control(j).member(x)[0] for j in honest)
    assert sent >= 1 and all(c.control(j).membership.table.members[x].beat == 2**53
                             for j in honest)  # the relay was taken ...
    assert states == Counter({"alive": 1800}), states  # ... and the member never suspected
    assert c.control(4).incarnation == 1


def test_a_member_claiming_a_huge_live_count_takes_at_most_every_other_sync():
    """A header's live count above the node's own makes the sender the next sync's partner
    (it knows members we do not): claimed in every header, it took every sync -- SWIM's
    random anti-entropy exchanges stopped for as long as it kept claiming."""
    from p2ptrain.proto.events import Send
    from p2ptrain.proto.messages import SyncRequest
    from tests.cluster.harness import Observer

    class Syncs(Observer):
        def __init__(self):
            self.to: list[str | None] = []

        def on_actions(self, cluster, i, event, actions):
            if i == 0:
                self.to += [a.to for a in actions if type(a) is Send
                            and type(a.envelope.body) is SyncRequest]

    c = Cluster(5, 31)
    c.run_until(8.0)
    syncs, attacker = Syncs(), c.nodes[1].info.node_id
    c.observe(syncs)
    for _ in range(600):
        header = _header(c, 1)
        c.inject(0, Envelope(replace(header, live=2**53), Notify()), c.nodes[1].info.addr)
        c.run_for(0.1)
    others = [to for to in syncs.to if to != attacker]  # every other sync is a random one
    assert len(syncs.to) >= 8 and 4 * len(others) >= len(syncs.to), syncs.to  # (0 before)
    assert len(set(others)) >= 2, others  # (and a random one may draw the attacker)
