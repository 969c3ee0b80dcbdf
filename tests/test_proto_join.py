"""Joining in the sans-IO node (issue 13, items 1 and 4): a node adopts the leader's newer
checkpoint before its first step, nothing it hears before that moves its counters, failed
fetches are retried with back-off from whoever leads then, and a leader without a checkpoint
is not asked again. In the in-memory training cluster, virtual time."""

from __future__ import annotations

import numpy as np

from p2ptrain.proto import GossipConfig, NodeConfig
from p2ptrain.proto.events import AdoptCheckpoint, CheckpointFetched, FetchCheckpoint, Joined
from p2ptrain.proto.joining import (
    ALONE_HEAD_START,
    LISTING_GRACE,
    Join,
    preferred,
    sources,
    swarm_choice,
)
from p2ptrain.proto.membership.holdings import Holdings
from p2ptrain.proto.records import Holding
from tests.cluster.training import TrainingCluster
from tests.test_node import learner


def _join(now, own_samples, timeout, attempts, backoff, backoff_max) -> Join:
    return Join(now=now, own_samples=own_samples, timeout=timeout, attempts=attempts,
                backoff=backoff, backoff_max=backoff_max, loss_tolerance=0.25)


GOSSIP = GossipConfig(fanout=0, average_every=2, averaging="full")
JOINING = NodeConfig(gossip=GOSSIP, min_peers=0, join_timeout=3.0, fetch_backoff=0.5,
                     fetch_backoff_max=4.0)


def trained_cluster(n: int = 3, seed: int = 5, until: float = 8.0) -> TrainingCluster:
    c = TrainingCluster(n, seed, lambda i, node_id: learner(node_id), node_config=JOINING,
                        step_seconds=0.1)
    c.run_until(until)
    assert len(c.leaders()) == 1 and c.stored, "the swarm should lead and checkpoint"
    return c


def test_the_first_nodes_find_no_checkpoint_and_train_without_asking_again():
    """A swarm that starts together: its nodes train while they elect a leader, and the
    followers then fetch nothing -- the leader holds no checkpoint yet, or only its own start."""
    c = trained_cluster()
    leader = c.leaders()[0]
    for i in range(3):
        join = c.training_node(i).join
        assert join.done and join.attempt == 0 and c.training_node(i).join_steps > 0
        if i == leader:
            assert join.reason.startswith("this node leads")
        else:
            assert "no fetch" in join.reason, join.reason
    assert all(c.training_node(i).learner.step > 0 for i in range(3))


def test_a_fresh_node_adopts_the_leaders_checkpoint_before_its_first_step():
    c = trained_cluster()
    leader = c.leaders()[0]
    joiner = next(i for i in range(3) if i != leader)
    c.crash(joiner)
    c.run_for(3.0)
    c.restart(joiner)  # a new incarnation from the initial weights (no local checkpoint)
    node = c.training_node(joiner)
    before = node.learner.count.total
    assert before == 0 and node.phase == "joining"
    while not node.join.done:
        c.run_for(0.05)
        assert node.learner.step == 0  # no step before the join is over
        if not node.join.done:  # averaging requests and headers move nothing
            assert node.learner.count.total == before
    path = [p for p in c.stored if p.startswith(f"ckpt/{leader}/")][-1]
    assert node.join.reason.startswith("weights from the leader's checkpoint")
    _, params, counts = c.stored[path]
    assert node.learner.count.total >= sum(counts.values()) > 0
    c.run_for(1.0)
    assert node.learner.step > 0


def test_a_joiner_paused_past_its_join_timeout_still_asks_the_leader():
    """A review paused a fresh joiner for 25 s just after its start (join_timeout 10 s): on
    waking it found its wait over -- "no leader answered within 10s" -- and trained from its
    random weights. A pause now starts the wait again."""
    c = trained_cluster()
    leader = c.leaders()[0]
    joiner = next(i for i in range(3) if i != leader)
    c.crash(joiner)
    c.run_for(3.0)
    c.restart(joiner)
    c.pause(joiner, 2 * JOINING.join_timeout)  # before it has heard of the leader
    c.run_for(2 * JOINING.join_timeout + 0.05)
    node = c.training_node(joiner)
    assert node.control.resumes == 1
    while not node.join.done:
        c.run_for(0.05)
    assert node.join.reason.startswith("weights from the leader's checkpoint"), node.join.reason


def test_a_node_with_an_older_replica_adopts_but_a_newer_one_keeps_its_own():
    assert _join(0, 100, 1, 3, 1, 4)
    for own, adopt in ((100, True), (10_000, False)):
        join = _join(0.0, own, 5, 3, 1, 4)
        actions = join.advance(0.0, "me", "leader", lambda _i: ("10.0.0.1:7100",))
        assert [type(a) for a in actions] == [FetchCheckpoint]
        actions = join.fetched(0.5, CheckpointFetched("ck", swarm_samples=5_000))
        names = [type(a).__name__ for a in actions]
        assert names == (["AdoptCheckpoint", "Joined"] if adopt else ["Joined"])
        assert join.done


def test_failed_fetches_back_off_and_follow_the_leader_of_the_moment():
    join = _join(0.0, 0, 5, 4, 1.0, 3.0)
    addrs = {"L1": "10.0.0.1:7100", "L2": "10.0.0.2:7100"}
    t, sent = 0.0, []
    leader = "L1"
    for attempt in range(1, 5):
        actions = join.advance(t, "me", leader, lambda i: (addrs[i],) if i in addrs else ())
        assert [type(a) for a in actions] == [FetchCheckpoint], (attempt, actions)
        sent.append((t, actions[0]))
        actions = join.fetched(t + 0.1, CheckpointFetched(None, reason="refused", retry=True))
        if attempt == 4:
            assert [type(a) for a in actions] == [Joined] and "after 4 attempts" in \
                actions[0].reason
            break
        assert actions == [] and join.state == "backoff"
        assert join.advance(join.retry_at - 0.01, "me", leader, lambda i: (addrs[i],)) == []
        t = join.next_deadline()
        leader = "L2"  # the leader died meanwhile: the next attempt asks the new one
    gaps = [round(b[0] - a[0] - 0.1, 6) for a, b in zip(sent, sent[1:], strict=False)]
    assert gaps == [1.0, 2.0, 3.0]  # doubling, capped at fetch_backoff_max
    assert [a.sources for _, a in sent][1:] == [(addrs["L2"],)] * 3


def test_a_leader_without_a_checkpoint_is_not_asked_again():
    join = _join(0.0, 0, 5, 6, 1, 4)
    join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",))
    actions = join.fetched(0.2, CheckpointFetched(None, reason="no checkpoint", retry=False))
    assert [type(a) for a in actions] == [Joined] and join.attempt == 1


def test_no_leader_at_all_ends_the_join_after_the_timeout():
    join = _join(0.0, 0, 3, 6, 1, 4)
    assert join.advance(2.9, "me", None, lambda _i: ()) == []
    assert join.next_deadline() == 3.0
    actions = join.advance(3.0, "me", None, lambda _i: ())
    assert [type(a) for a in actions] == [Joined] and "within 3s" in actions[0].reason


def test_a_restarted_node_retries_through_a_broken_link_then_adopts():
    c = trained_cluster(seed=7)
    leader = c.leaders()[0]
    joiner = next(i for i in range(3) if i != leader)
    c.crash(joiner)
    c.fetch_fails.add(joiner)
    c.restart(joiner)
    c.run_for(2.5)
    node = c.training_node(joiner)
    assert not node.join.done and node.join.attempt >= 2 and node.learner.step == 0
    c.fetch_fails.clear()
    c.run_for(6.0)
    assert node.join.done and node.join.reason.startswith("weights from")
    assert node.learner.step > 0
    times = [t for t, i, _ in c.fetches if i == joiner]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert np.isfinite(node.learner.params).all()


def test_a_wrecked_or_far_worse_checkpoint_is_refused():
    """Issue 13, item 13: a hostile leader cannot hand its joiners wrecked weights."""
    def offer(event, reference=None):
        join = _join(0.0, 0, 5, 3, 1, 4)
        join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",))
        return join, join.fetched(0.5, event, reference)

    inf = float("inf")
    for event, reference, adopted in [
        (CheckpointFetched("ck", 900, loss=inf, own_loss=5.5), None, False),  # not finite
        (CheckpointFetched("ck", 900, loss=9.0, own_loss=5.5), None, False),  # worse than ours
        (CheckpointFetched("ck", 900, loss=4.0, own_loss=5.5), 2.1, True),  # beats our own
        (CheckpointFetched("ck", 900, loss=4.0, own_loss=2.0), 2.1, False),  # worse than both
        (CheckpointFetched("ck", 900, loss=2.2, own_loss=5.5), 2.1, True),
        (CheckpointFetched("ck", 900, loss=2.0, own_loss=5.5), None, True),
        (CheckpointFetched("ck", 900), None, True),  # not judged (no loss measured)
    ]:
        join, actions = offer(event, reference)
        names = [type(a).__name__ for a in actions]
        assert join.done and names == (["AdoptCheckpoint", "Joined"] if adopted
                                       else ["Joined"]), (event, names)
        assert (join.refused == "L") == (not adopted)
        if not adopted:
            assert actions[0].reason.startswith("refused the leader's checkpoint")


def test_a_fresh_node_does_not_adopt_weights_no_better_than_its_own_random_ones():
    """Weights that predict uniformly (a hostile leader's all-65,504, say) score a fresh
    replica's loss: a node that starts fresh keeps its own, whatever loss the leader reports,
    and names no one (an honest swarm that has not learned yet looks the same); a clearly
    better checkpoint is adopted; a node with samples of its own judges as before."""
    for own_samples, loss, swarm_loss, adopted in [
        (0, 5.545, 9.0, False),  # as good as random; the leader reports a high loss
        (0, 5.545, None, False),
        (0, 5.50, 5.4, False),  # within the margin of fresh weights
        (0, 5.40, 5.4, True),  # clearly better than fresh
        (50, 5.545, 9.0, True),  # not fresh: within tolerance of what the swarm reports
    ]:
        join = _join(0.0, own_samples, 5, 3, 1, 4)
        join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",), swarm_loss=swarm_loss)
        actions = join.fetched(0.5, CheckpointFetched("ck", 900, loss=loss, own_loss=5.546))
        names = [type(a).__name__ for a in actions]
        assert join.done and join.refused is None, (own_samples, loss, join.reason)
        assert names == (["AdoptCheckpoint", "Joined"] if adopted else ["Joined"]), names
        if not adopted:
            assert join.reason.startswith("the leader's checkpoint is no better than fresh")


def test_a_node_that_trained_while_joining_keeps_its_replica_unless_clearly_beaten():
    """A fresh node that took steps while no leader was known judges the leader's checkpoint
    against the replica it trained: one no better -- an honest leader's checkpoint may be
    older than those steps -- is not adopted and no one is named; a clearly better one is
    adopted; weights that are not finite are refused and their leader named, as always."""
    for loss, adopted, named in [(3.198, False, False), (2.45, False, False),
                                 (2.40, True, False), (float("inf"), False, True)]:
        join = _join(0.0, 0, 5, 3, 1, 4)
        join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",))
        actions = join.fetched(0.5, CheckpointFetched("ck", 900, loss=loss, own_loss=2.483),
                               trained_alone=True)
        names = [type(a).__name__ for a in actions]
        assert join.done and (join.refused == "L") is named, (loss, join.reason)
        assert names == (["AdoptCheckpoint", "Joined"] if adopted else ["Joined"]), names
        if not adopted and not named:
            assert "trained while joining" in join.reason
        # the same checkpoint judged by a node that did not train meanwhile
        join = _join(0.0, 0, 5, 3, 1, 4)
        join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",))
        join.fetched(0.5, CheckpointFetched("ck", 900, loss=loss, own_loss=2.483))
        assert "trained while joining" not in join.reason


def test_a_node_that_trained_while_joining_fetches_only_a_checkpoint_far_ahead_of_it():
    """Steps taken alone while no leader was known (a swarm starting together): the leader's
    checkpoint is fetched only when it holds more than ALONE_HEAD_START times the samples
    trained meanwhile -- a swarm's start is not worth a fetch's wait; one far ahead is."""
    addr = lambda _i: ("10.0.0.1:7100",)  # noqa: E731
    for held, fetches in [(None, False), (Holding(1, 9, 100, "d"), False),
                          (Holding(1, 9, ALONE_HEAD_START * 100, "d"), False),
                          (Holding(1, 9, ALONE_HEAD_START * 100 + 1, "d"), True)]:
        join = _join(0.0, 0, 5, 3, 1, 4)
        actions = join.advance(0.0, "me", "L", addr, alone=100, held_of=lambda _lead, h=held: h)
        names = [type(a).__name__ for a in actions]
        assert names == (["FetchCheckpoint"] if fetches else ["Joined"]), (held, names)
        assert join.done is not fetches and join.refused is None
        # a node that took no step alone fetches whatever the leader holds
        join = _join(0.0, 0, 5, 3, 1, 4)
        actions = join.advance(0.0, "me", "L", addr, held_of=lambda _lead, h=held: h)
        assert [type(a).__name__ for a in actions] == ["FetchCheckpoint"]


def test_a_joiner_fetches_from_the_leader_and_every_member_holding_the_same_checkpoint():
    """Issue 14: members gossip what they hold; a joiner's FetchCheckpoint names the leader
    first, then each member that holds the leader's checkpoint (here: the one that joined
    just before it and fetched it)."""
    c = trained_cluster(n=4, seed=7)
    leader = c.leaders()[0]
    first, second = [i for i in range(4) if i != leader][:2]
    for joiner in (first, second):
        c.crash(joiner)
    c.run_for(2.0)
    c.restart(first)
    while not c.training_node(first).join.done:
        c.run_for(0.05)
    c.run_for(0.3)  # the first joiner's headers say what it holds now
    c.restart(second)
    while not c.training_node(second).join.done:
        c.run_for(0.05)
    fetch = [a for _, i, a in c.fetches if i == second][-1]
    addrs = {i: c.nodes[i].info.addr for i in range(4)}
    assert fetch.sources[0] == addrs[leader]
    assert fetch.sources[1:] == (addrs[first],), (fetch.sources, addrs)
    holdings = c.training_node(second).control.membership.holdings
    lead_id, first_id = c.nodes[leader].info.node_id, c.nodes[first].info.node_id
    assert holdings.of(lead_id) == holdings.of(first_id) is not None
    assert c.training_node(second).status()["holds"] is not None  # it holds it now, too


def test_a_checkpoint_is_judged_against_the_swarm_as_it_was_when_the_fetch_began():
    """A 4 GB fetch takes minutes; the swarm's loss falls meanwhile. The yardstick is the
    loss reported when the fetch began, not the one reported when it ends. (A node with some
    samples of its own: one that starts fresh also wants the checkpoint better than fresh
    weights.)"""
    join = _join(0.0, 50, 10.0, 3, 1.0, 4.0)
    join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",), swarm_loss=2.6)
    done = join.fetched(600.0, CheckpointFetched("ck", 900, loss=2.58, own_loss=2.0),
                        reference=1.8)  # the swarm trained on for ten minutes
    assert any(type(a) is AdoptCheckpoint for a in done) and join.refused is None
    join = _join(0.0, 50, 10.0, 3, 1.0, 4.0)
    join.advance(0.0, "me", "L", lambda _i: ("10.0.0.1:7100",), swarm_loss=1.8)
    join.fetched(600.0, CheckpointFetched("ck", 900, loss=2.58, own_loss=2.0), reference=2.6)
    assert join.refused == "L"  # far worse than the swarm was and than our own: refused


def _holding(step: int, term: int = 2) -> Holding:
    return Holding(term, step, step * 8, f"{term:04x}{step:012x}")


def test_a_join_storm_keeps_to_the_checkpoint_the_most_members_hold():
    """The leader wrote C after two joiners began fetching B: a third joiner takes B (the two
    fetchers serve what they verified, and the leader still has it) rather than C (the leader
    alone), and asks the leader for B by name. A newer holding than the
    leader's, another term's and an unreachable member's do not count; on a tie the newest
    wins, and alone the leader's own is taken."""
    b, c = _holding(20), _holding(30)
    holdings = Holdings("me")
    members = ["L", "j1", "j2", "far", "odd", "old"]
    holdings.heard("L", c, members)
    for node, held in (("j1", b), ("j2", b), ("far", b), ("odd", _holding(40)),
                       ("old", _holding(10, term=1))):
        holdings.heard(node, held, members)
    addr_of = {"L": "l:1", "j1": "a:1", "j2": "b:1", "odd": "o:1", "old": "d:1"}.get
    assert swarm_choice("L", addr_of, holdings, members) == b
    assert preferred("L", addr_of, holdings, members) == b  # older: asked for by name
    assert sources("L", None, addr_of, holdings, members, 8) == ("l:1", "a:1", "b:1")
    assert sources("L", b.digest, addr_of, holdings, members, 8) == ("l:1", "a:1", "b:1")
    holdings.heard("j2", c, members)  # now one each beside the leader: the newest
    assert swarm_choice("L", addr_of, holdings, members) == c
    assert preferred("L", addr_of, holdings, members) is None  # the leader's: its newest
    alone = Holdings("me")
    alone.heard("L", c, ["L"])
    assert swarm_choice("L", addr_of, alone, ["L"]) == c
    assert swarm_choice("L", addr_of, Holdings("me"), members) is None
    join = _join(0.0, 0, 5.0, 3, 1.0, 4.0)
    (fetch,) = join.advance(0.1, "me", "L", lambda lead: ("l:1", "a:1"), None,
                            lambda lead: b)
    assert fetch == FetchCheckpoint("L", ("l:1", "a:1"), 1, (2, 20))
    join = _join(0.0, 0, 5.0, 3, 1.0, 4.0)
    assert join.advance(0.1, "me", "L", lambda lead: ("l:1",))[0].prefer is None


def test_a_joiner_waits_a_little_for_its_first_member_list_before_choosing():
    """It hears of the leader (a header) before it hears who else is fetching what (a member
    list): it waits for the first list, LISTING_GRACE at most, then chooses with what it
    knows; the wait never leaves a deadline in the past."""
    to = lambda lead: ("l:1",)  # noqa: E731
    join = _join(0.0, 0, 30.0, 3, 1.0, 4.0)
    assert join.advance(1.0, "me", "L", to, None, None, 0) == []
    assert join.next_deadline() == 1.0 + LISTING_GRACE
    (fetch,) = join.advance(2.0, "me", "L", to, None, None, 1)  # the list came
    assert type(fetch) is FetchCheckpoint and join.next_deadline() is None
    late = _join(0.0, 0, 30.0, 3, 1.0, 4.0)
    assert late.advance(1.0, "me", "L", to, None, None, 0) == []
    assert late.advance(1.0 + LISTING_GRACE / 2, "me", "L", to, None, None, 0) == []
    assert type(late.advance(1.0 + LISTING_GRACE, "me", "L", to, None, None, 0)[0]) is \
        FetchCheckpoint  # no list in time: the newest, as before
    gone = _join(0.0, 0, 30.0, 3, 1.0, 4.0)
    assert gone.advance(1.0, "me", "L", to, None, None, 0) == []
    assert gone.advance(1.0 + LISTING_GRACE, "me", "L", lambda lead: (), None, None, 0) == []
    assert gone.next_deadline() == 30.0  # the leader went away: back to the join timeout
    # a join whose own wait ends inside the grace: at its end it fetches with what it knows
    # (it used to return nothing with that deadline left in the past: woken again at once,
    # for ever -- the simulator's churn runs at 1B-LoRA spun on it)
    short = _join(0.0, 0, 3.0, 3, 1.0, 4.0)
    assert short.advance(1.0, "me", "L", to, None, None, 0) == []
    assert short.next_deadline() == 3.0 < 1.0 + LISTING_GRACE
    (fetch,) = short.advance(3.0, "me", "L", to, None, None, 0)
    assert type(fetch) is FetchCheckpoint and short.next_deadline() is None


def _led_during_join(c: TrainingCluster, i: int, deadline: float) -> bool:
    """Run until node i's join is over (at most `deadline`): whether it led meanwhile."""
    node, led = c.training_node(i), False
    while not node.join.done:
        assert c.now < deadline, f"node {i}'s join did not end: {node.join.state}"
        c.run_for(0.05)
        led = led or node.is_leader
    return led


def test_a_joiner_claims_no_leadership_while_it_fetches(monkeypatch):
    """The leader dies while a restarted node that outranks the other follower fetches its
    checkpoint (a slow fetch): the follower that trained takes over; the joiner, whose
    replica is behind, claims nothing until its join is over, then adopts the new leader's
    checkpoint and follows. With the rule off, the same joiner claims at the lapse."""
    for rule in (True, False):
        c = trained_cluster(seed=3)
        leader = c.leaders()[0]
        follower, joiner = sorted((i for i in range(3) if i != leader),
                                  key=lambda i: c.control(i).me.priority_key())
        c.crash(joiner)
        c.run_for(3.0)
        c.fetch_seconds = 20.0
        c.restart(joiner)
        node = c.training_node(joiner)
        if not rule:
            monkeypatch.setattr(node.control, "hold_claims", lambda held: None)
        while node.join.state != "fetching":
            assert c.now < 40.0
            c.run_for(0.05)
        c.crash(leader)
        assert _led_during_join(c, joiner, c.now + 60.0) is not rule
        if rule:
            assert c.leaders() == [follower]
            assert node.join.reason.startswith("weights from the leader's checkpoint")
            c.run_for(2.0)
            assert c.leaders() == [follower] and node.learner.step > 0


def test_the_judged_leader_cannot_set_the_swarm_loss_its_checkpoint_is_judged_by(monkeypatch):
    """With gradient pushes on, members report their training losses, and their median is the
    yardstick a joiner holds the leader's checkpoint to. In a swarm of three the median of
    two reports is the higher: a leader that reports a huge loss (say, to make its wrecked
    checkpoint look acceptable) set it. Now its reports are left out: the yardstick is the
    other member's loss. (With them counted, the same run fails.)"""
    pushing = NodeConfig(gossip=GossipConfig(fanout=1, average_every=2, averaging="full"),
                         min_peers=0, join_timeout=3.0, fetch_backoff=0.5, fetch_backoff_max=1.0,
                         fetch_attempts=50)
    c = TrainingCluster(3, 5, lambda i, node_id: learner(node_id), node_config=pushing,
                        step_seconds=0.1)
    c.run_until(8.0)
    leader = c.leaders()[0]
    follower, joiner = [i for i in range(3) if i != leader]
    hostile = c.training_node(leader).trainer
    honest_step = hostile.step
    monkeypatch.setattr(hostile, "step", lambda now, loss, *rest: honest_step(now, 9.0, *rest))
    c.crash(joiner)
    c.run_for(2.0)
    c.fetch_fails.add(joiner)  # its fetches fail until it has heard both members' losses
    c.restart(joiner)
    node = c.training_node(joiner)
    heard = node.trainer.peer_progress
    lead_id, follower_id = c.nodes[leader].info.node_id, c.nodes[follower].info.node_id
    while heard.get(lead_id, (0, None))[1] != 9.0 or heard.get(follower_id, (0, None))[1] is None:
        assert c.now < 30.0 and not node.join.done
        c.run_for(0.05)
    c.fetch_fails.clear()
    tried = node.join.attempt
    while node.join.state != "fetching" or node.join.attempt == tried:
        assert c.now < 40.0 and not node.join.done
        c.run_for(0.05)
    assert heard[lead_id][1] == 9.0  # the leader's reports are still the highest
    assert node.join.reference is not None and node.join.reference < 9.0, heard


def test_a_swarm_that_starts_together_trains_while_it_elects_a_leader():
    """Fresh nodes that hear peers but no leader (a swarm starting together waits a lease
    before anyone claims) take steps alone meanwhile -- no averaging, no pushes -- and keep
    them when the join ends without a checkpoint to adopt."""
    c = TrainingCluster(3, 11, lambda i, node_id: learner(node_id), node_config=JOINING,
                        step_seconds=0.1)
    nodes = [c.training_node(i) for i in range(3)]
    while not c.leaders():
        assert c.now < 10.0, "no leader was elected"
        c.run_for(0.05)
        for node in nodes:
            if not node.join.done:
                assert node.trainer.stats["average_started"] == 0
                assert node.learner.count.total == node.learner.samples  # its own alone
    assert all(node.learner.step > 0 and node.join_steps > 0 for node in nodes)
    before = [node.learner.step for node in nodes]
    while not all(node.join.done for node in nodes):
        assert c.now < 20.0
        c.run_for(0.05)
    c.run_for(2.0)
    for node, steps in zip(nodes, before, strict=True):
        assert node.learner.step > steps  # kept, and training goes on from there
        assert node.status()["join"]["steps"] == node.join_steps > 0
    assert sum(node.trainer.stats["average_started"] for node in nodes) > 0


def test_a_checkpoint_fetched_during_a_step_taken_while_joining_is_adopted_after_it():
    """The leader elected in a swarm that trained while electing it holds a checkpoint (of an
    earlier run, say): its followers' fetches land while their steps run; each is taken up at
    the step's end -- the driver loads weights only between steps -- and the steps taken
    alone go with the weights (the optimiser's moments start again)."""
    c = TrainingCluster(3, 12, lambda i, node_id: learner(node_id), node_config=JOINING,
                        step_seconds=0.5)
    earlier = learner("earlier").params + np.float32(0.01)
    for i in range(3):  # whoever is elected serves this one, and says so from the start
        c.stored[f"ckpt/{i}/0/1"] = (i, earlier.copy(), {c.nodes[i].info.node_id: 5_000})
        c._tell_holding(c.nodes[i], f"ckpt/{i}/0/1")
    nodes = [c.training_node(i) for i in range(3)]
    held = set()
    while not all(node.join.done for node in nodes):
        assert c.now < 20.0, [node.join.state for node in nodes]
        c.run_for(0.01)
        for i, node in enumerate(nodes):
            if node._fetched_late is not None:
                assert node.outstanding is not None and node.join.state == "fetching"
                held.add(i)
    followers = [i for i in range(3) if not nodes[i].is_leader]
    assert held and held <= set(followers)
    for i in held:
        node = nodes[i]
        assert node.join.reason.startswith("weights from the leader's checkpoint")
        assert node.join_steps > 0
        assert node.learner.opt.t <= 1  # reset at the adoption (one step since, at most)
        assert node.learner.count.total > node.learner.samples  # the leader's entry merged


def test_only_this_swarms_members_naming_a_leader_stop_a_joiner_training_alone():
    """A message of another swarm (same key, another configuration) naming its leader used
    to count as "a leader is known": the joiner waited out the join timeout untrained."""
    from p2ptrain.proto.messages import PROTOCOL_VERSION, Envelope, Header, Notify
    from p2ptrain.proto.records import LeaderView

    c = TrainingCluster(3, 11, lambda i, node_id: learner(node_id), node_config=JOINING,
                        step_seconds=0.1)
    c.run_for(0.2)
    node, other = c.training_node(0), c.nodes[1].info
    view = LeaderView(1, other.node_id, other.priority, other.capability, 0)
    for fingerprint, heard in (("another swarm's", False), (other.fingerprint, True)):
        header = Header(PROTOCOL_VERSION, other.node_id, 1, other.addr, fingerprint, 1, 1, 1,
                        view, ())
        c.inject(0, Envelope(header, Notify()), other.addr)
        assert node.leader_heard is heard
