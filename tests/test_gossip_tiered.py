"""Subset exchanges by pair (`gossip.subset_fraction_slow`): two of the swarm's fastest
members average `subset_fraction` of the coordinates, any other pair the slow share; the
initiator marks the seed, the responder follows it. Two trainers wired in memory, virtual
time, rates given."""

from __future__ import annotations

from p2ptrain.proto.gossip.averaging import read_snapshot
from p2ptrain.proto.gossip.peers import fast_pair
from p2ptrain.proto.gossip.plan import FAST_PAIR
from tests.proto_samples import A, B, C
from tests.test_gossip_longex import exchange_round, take_step, trainer

TIERED = dict(averaging="subset", subset_fraction=0.5, subset_fraction_slow=0.05)
RATES = {A: 6.0, B: 5.0, C: 2.0}  # samples/s: A and B fast, C under half of the fastest


def test_fast_pair_needs_both_rates_at_half_the_fastest_observed():
    assert fast_pair(6.0, 5.0, [2.0, None])
    assert not fast_pair(6.0, 2.0, [5.0])
    assert not fast_pair(3.0, 2.9, [6.1])  # both slow: the fastest is elsewhere
    assert fast_pair(3.0, 3.0, [5.9]) and not fast_pair(3.0, 3.0, [6.1])
    assert not fast_pair(None, 5.0, []) and not fast_pair(5.0, 0.0, [])
    assert not fast_pair(float("nan"), 5.0, [])
    assert fast_pair(6.0, 5.0, [float("nan"), -1.0, 0.0])  # nonsense rates are not the top


def test_one_inflated_rate_cannot_make_every_pair_of_a_fleet_slow():
    slow = [1.0] * 10  # A (6) and B (5) among ten slow members
    assert fast_pair(6.0, 5.0, slow) and not fast_pair(1.0, 1.0, [6.0, 5.0, *slow[2:]])
    liar = [*slow, 1e12]  # counted at 4x the fleet's upper quartile, not at its claim
    assert fast_pair(6.0, 5.0, liar) and not fast_pair(1.0, 6.0, [5.0, *slow[1:], 1e12])
    assert not fast_pair(6.0, 5.0, [1.0, 1.0, 1e12])  # a handful: the quartile is near the top


def test_two_fast_members_average_the_wide_share_and_a_slow_partner_the_narrow_one():
    a, b = trainer(A, **TIERED), trainer(B, **TIERED)
    a.rate_of = b.rate_of = RATES.get
    plan = a.plan
    assert plan.slow_fraction == 0.05 and plan.k_for(FAST_PAIR) > 5 * plan.k_for(0)
    [request] = take_step(a, 0.0)  # the partner is B
    seed = a.exchange.seed
    assert seed & FAST_PAIR  # A and B: both at least half of the fastest (6)
    assert read_snapshot(request.body.chunks).length == plan.covered(seed)
    before = b.learner.params.copy()
    exchange_round(a, b, request, 1.0)
    assert a.stats["average_applied"] == 1 and b.stats["average_answered"] == 1
    assert int((b.learner.params != before).sum()) == plan.covered(seed)

    slow = trainer(A, **TIERED)
    slow.rate_of = RATES.get
    [request] = take_step(slow, 0.0, ((C, "10.0.0.3:7100"),))
    assert not slow.exchange.seed & FAST_PAIR
    assert read_snapshot(request.body.chunks).length == plan.covered(slow.exchange.seed)
    assert plan.covered(slow.exchange.seed) < plan.covered(seed) / 5

    blind = trainer(A, **TIERED)  # no rates observed at all: the narrow share
    [request] = take_step(blind, 0.0)
    assert not blind.exchange.seed & FAST_PAIR
