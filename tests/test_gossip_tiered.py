"""Exchanges by pair: two of the swarm's fastest members average `subset_fraction` of the
coordinates, any other pair the slow share (`gossip.subset_fraction_slow`; the initiator
marks the seed, the responder follows it), and they may average among themselves more often
(`gossip.average_every_fast`) while they are a fast core (`gossip.average_fast_share`).
Trainers wired in memory, virtual time, rates given."""

from __future__ import annotations

import pytest

from p2ptrain.proto import GossipConfig
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



def opened_over(t, steps: int, partners) -> list[str | None]:
    """Whom `t` opens an exchange with after each of `steps` steps (None: nobody); each is
    forgotten at once, as if answered, so the next may open."""
    opened = []
    for i in range(steps):
        out = take_step(t, float(i), partners)
        opened.append(out[0].to if out else None)
        if t.exchange is not None:
            t.exchange = None
            t.initiator.abort()
    return opened


def test_the_fastest_average_among_themselves_between_the_exchanges_with_anyone():
    """`average_every_fast = 1` beside `average_every = 5`: a fast member opens an exchange
    after every step, with another fast member unless the every-5 one is due (any partner
    then); a slow member keeps to every 5; without rates nothing is fast."""
    partners = ((B, "10.0.0.2:7100"), (C, "10.0.0.3:7100"))
    core = dict(average_every=5, average_every_fast=1, average_fast_share=1.0)  # 2 of 3 fast
    fast = trainer(A, **core)
    fast.rate_of = RATES.get
    opened = opened_over(fast, 20, partners)
    assert None not in opened
    assert {to for i, to in enumerate(opened) if (i + 1) % 5} == {B}  # C is slow
    slow = trainer(C, **core)
    slow.rate_of = RATES.get
    others = ((A, "10.0.0.1:7100"), (B, "10.0.0.2:7100"))
    assert [to is not None for to in opened_over(slow, 10, others)] == [False] * 4 + [True] \
        + [False] * 4 + [True]
    blind = trainer(A, **core)  # no rates observed
    assert [to is not None for to in opened_over(blind, 5, partners)] == [False] * 4 + [True]
    off = trainer(A, average_every=5, average_every_fast=0)
    off.rate_of = RATES.get
    assert [to is not None for to in opened_over(off, 5, partners)] == [False] * 4 + [True]
    never = trainer(A, **(core | {"average_every": 0}))  # averaging off: all of it
    never.rate_of = RATES.get
    assert opened_over(never, 5, partners) == [None] * 5


def test_only_a_fast_core_averages_among_itself_between_the_exchanges_with_anyone():
    """By default (`average_every_fast = 1`, `average_fast_share = 0.5`) the fastest average
    after every step only while they, this node too, are at most half the members it knows:
    a wired core in a mixed fleet does, a LAN of similar machines keeps to every 5 steps."""
    assert GossipConfig().average_every_fast == 1 and GossipConfig().average_fast_share == 0.5
    d, e = "d" * 32, "e" * 32
    mixed = ((B, "10.0.0.2:7100"), (C, "10.0.0.3:7100"), (d, "10.0.0.4:7100"),
             (e, "10.0.0.5:7100"))
    rates = RATES | {d: 1.0, e: 1.5}  # A and B fast: 2 of 5
    core = trainer(A, average_every=5)  # the helper's own default is every step
    core.rate_of = rates.get
    opened = opened_over(core, 10, mixed)
    assert None not in opened and {to for i, to in enumerate(opened) if (i + 1) % 5} == {B}
    similar = {A: 6.0, B: 5.0, C: 5.5}  # all of them fast: 3 of 3
    lan = trainer(A, average_every=5)
    lan.rate_of = similar.get
    partners = ((B, "10.0.0.2:7100"), (C, "10.0.0.3:7100"))
    assert [to is not None for to in opened_over(lan, 10, partners)] == [False] * 4 + [True] \
        + [False] * 4 + [True]
    assert lan.stats["average_fast_not_core"] == 8
    anyway = trainer(A, average_every=5, average_fast_share=1.0)  # LoRA mode: any share
    anyway.rate_of = similar.get
    assert None not in opened_over(anyway, 10, partners)
    with pytest.raises(ValueError, match="average_fast_share"):
        GossipConfig(average_fast_share=0.0)
