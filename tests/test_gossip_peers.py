"""Link statistics and the choice of gossip targets; the gossip modules stay pure."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from p2ptrain.proto.gossip.peers import (
    DEFAULT_RTT,
    MIN_BANDWIDTH_BYTES,
    RATE_BIAS_CAP,
    PeerStats,
    PeerTable,
    choose_peers,
    delivery_seconds,
    upper_quartile,
)


def test_rtt_ewma():
    s = PeerStats().with_rtt(0.1, now=5.0, alpha=0.25)
    assert s.rtt == 0.1 and s.last_seen == 5.0  # the first sample sets it
    s = s.with_rtt(0.2, now=6.0, alpha=0.25)
    assert s.rtt == pytest.approx(0.125) and s.last_seen == 6.0
    s = s.with_rtt(0.0, now=4.0, alpha=0.25)  # a late report never moves last_seen back
    assert s.rtt == pytest.approx(0.09375) and s.last_seen == 6.0
    with pytest.raises(ValueError):
        s.with_rtt(float("nan"), 7.0, 0.25)


def test_bandwidth_ewma_from_transfers():
    s = PeerStats().with_transfer(1_000_000, 0, 2.0, now=1.0, alpha=0.5)
    assert s.bandwidth == pytest.approx(500_000) and s.bytes_out == 1_000_000
    s = s.with_rtt(0.5, now=2.0, alpha=0.5)
    s = s.with_transfer(0, 1_500_000, 1.5, now=3.0, alpha=0.5)  # 1 s left after one RTT
    assert s.bandwidth == pytest.approx(0.5 * 500_000 + 0.5 * 1_500_000)
    assert (s.bytes_in, s.bytes_out, s.last_seen) == (1_500_000, 1_000_000, 3.0)
    small = s.with_transfer(100, 100, 1.0, now=4.0, alpha=0.5)  # RTT-dominated: bytes only
    assert small.bandwidth == s.bandwidth and small.bytes_in == s.bytes_in + 100
    noisy = PeerStats(rtt=10.0).with_transfer(MIN_BANDWIDTH_BYTES, 0, 1.0, 0.0, 0.5)
    assert noisy.bandwidth == pytest.approx(4 * MIN_BANDWIDTH_BYTES)  # a quarter at least


def test_table_records_and_forgets():
    table = PeerTable(alpha=0.5)
    table.observe_rtt("a", 0.02, 1.0)
    table.observe_transfer("a", 1 << 20, 0, 0.1, 2.0)
    table.seen("b", 3.0)
    assert "a" in table and len(table) == 2
    assert table.get("a").bytes_out == 1 << 20 and table.get("b").last_seen == 3.0
    table.forget("a")
    assert "a" not in table and table.get("a") == PeerStats()


def fleet() -> PeerTable:
    table = PeerTable()
    for i in range(3):  # fast, near: 100 MB/s, 1 ms
        table.observe_rtt(f"fast{i}", 0.001, 0.0)
        table.observe_transfer(f"fast{i}", 10 << 20, 0, 0.1, 0.0)
    for i in range(3):  # slow, far: 1 MB/s, 100 ms
        table.observe_rtt(f"slow{i}", 0.1, 0.0)
        table.observe_transfer(f"slow{i}", 1 << 20, 0, 1.1, 0.0)
    return table


def test_choice_respects_eligibility_and_fanout():
    table = fleet()
    table.observe_rtt("suspect", 0.0001, 0.0)  # the fastest of all, but not eligible
    eligible = ["slow0", "fast1", "slow2", "unknown"]
    rng = np.random.default_rng(1)
    for fanout in (0, 1, 2, 3, 4, 9):
        for _ in range(50):
            picks = table.choose(eligible, fanout, rng, 1 << 20)
            assert len(picks) == min(fanout, len(eligible)) == len(set(picks))
            assert set(picks) <= set(eligible)
    assert table.choose([], 2, rng, 100) == ()


def test_choice_prefers_fast_links_but_keeps_exploring():
    table = fleet()
    names = [n for n, _ in table.items()]
    rng = np.random.default_rng(2024)
    counts = Counter(p for _ in range(3000) for p in table.choose(names, 1, rng, 1 << 20))
    fast = sum(counts[f"fast{i}"] for i in range(3))
    slow = sum(counts[f"slow{i}"] for i in range(3))
    assert fast > 0.85 * 3000  # 100x faster delivery
    assert slow > 0.02 * 3000  # the exploration floor keeps slow links sampled
    # fanout 2 among two fast and two slow peers: the fast pair is by far the likeliest.
    pairs = Counter(frozenset(table.choose(["fast0", "fast1", "slow0", "slow1"], 2, rng,
                                           1 << 20)) for _ in range(2000))
    assert pairs.most_common(1)[0][0] == {"fast0", "fast1"}


def test_averaging_partners_weighted_by_sample_rate_within_a_cap():
    """Equal links: with rates given, a peer is drawn in proportion to its sample rate (an
    unknown one as the median), and an inflated rate counts at most RATE_BIAS_CAP x the
    upper quartile -- it cannot take every draw."""
    stats = {p: PeerStats(rtt=0.01, bandwidth=1e8) for p in ("pi", "laptop", "server", "liar")}
    rates = {"pi": 0.1, "laptop": 1.0, "server": 3.0, "liar": 1e9}
    rng = np.random.default_rng(7)
    draws = Counter(choose_peers(["pi", "laptop", "server"], stats, 1, rng, 4096,
                                 rates=rates)[0] for _ in range(4000))
    assert draws["server"] > 2.2 * draws["laptop"] > 2.2 * 2.5 * draws["pi"] > 0
    unknown = Counter(choose_peers(["pi", "laptop", "server"], stats, 1, rng, 4096,
                                   rates={"pi": 0.1, "server": 3.0})[0] for _ in range(4000))
    assert unknown["server"] > unknown["laptop"] > unknown["pi"]  # laptop: the median (1.55)
    capped = Counter(choose_peers(list(rates), stats, 1, rng, 4096, rates=rates)[0]
                     for _ in range(4000))
    top = 3.0  # the upper quartile of the four, by the lower rank: sorted[int(0.75 * 3)]
    weights = [RATE_BIAS_CAP * top, 0.1, 1.0, 3.0]
    weights[1] = max(0.1, 0.1 * sum(weights) / 4)  # the exploration floor lifts the pi
    share = weights[0] / sum(weights)
    assert capped["liar"] / 4000 == pytest.approx(share, abs=0.03) and capped["server"] > 0


def test_rates_weigh_to_a_power_and_the_cap_holds_before_it():
    """At power 3 a peer at a third of another's rate weighs 1/27 of it; an inflated rate
    is capped at RATE_BIAS_CAP x the upper quartile before the power; at 1 the weights are
    the rates' own; rates 60 orders of magnitude apart still draw at power 16."""
    stats = {p: PeerStats(rtt=0.01, bandwidth=1e8) for p in ("a", "b", "liar")}
    rates = {"a": 3.0, "b": 1.0, "liar": 1e9}
    rng = np.random.default_rng(3)
    draws = Counter(choose_peers(["a", "b"], stats, 1, rng, 4096, explore=0.0, rates=rates,
                                 power=3.0)[0] for _ in range(5600))
    assert draws["b"] / 5600 == pytest.approx(1 / 28, abs=0.012)
    capped = Counter(choose_peers(list(rates), stats, 1, rng, 4096, explore=0.0, rates=rates,
                                  power=3.0)[0] for _ in range(4000))
    top = 3.0  # the upper quartile of the three rates (the lower rank: the middle one)
    weights = {"liar": (RATE_BIAS_CAP * top) ** 3, "a": 3.0**3, "b": 1.0}
    assert capped["liar"] / 4000 == pytest.approx(weights["liar"] / sum(weights.values()),
                                                  abs=0.02)
    linear = Counter(choose_peers(["a", "b"], stats, 1, rng, 4096, explore=0.0, rates=rates,
                                  power=1.0)[0] for _ in range(4000))
    assert linear["b"] / 4000 == pytest.approx(1 / 4, abs=0.03)
    # two partners 60 orders apart: the median (their mean) is far above the cap (4x the
    # slower one); weighed against the median both would underflow to 0 at power 16
    spread = {"a": 1e-30, "b": 1e30}
    assert choose_peers(list(spread), {}, 1, rng, 4096, explore=0.0, rates=spread,
                        power=16.0) in (("a",), ("b",))
    with pytest.raises(ValueError):
        choose_peers(["a"], stats, 1, np.random.default_rng(0), 10, power=0.5)


def test_the_cap_is_the_upper_quartile_so_a_fleet_of_pis_does_not_flatten_servers():
    fleet = {f"pi{i}": 0.2 for i in range(20)} | {f"lap{i}": 1.3 for i in range(8)} | {
        f"desk{i}": 2.3 for i in range(10)} | {"srv0": 7.3, "srv1": 7.3}
    assert upper_quartile(list(fleet.values())) == 2.3  # 4x: 9.2, above a server's 7.3
    assert upper_quartile([1.0, 1e9]) == 1.0 and upper_quartile([5.0]) == 5.0
    stats = {p: PeerStats(rtt=0.01, bandwidth=1e8) for p in fleet}
    rng = np.random.default_rng(6)
    draws = Counter(choose_peers(list(fleet), stats, 1, rng, 4096, explore=0.0, rates=fleet,
                                 power=3.0)[0][:3] for _ in range(3000))
    assert draws["srv"] > 0.6 * 3000  # 2 x 7.3^3 against 10 x 2.3^3 + 8 x 1.3^3: 0.84


def test_choice_is_seeded_and_ignores_the_order_of_ids():
    table = fleet()
    names = [n for n, _ in table.items()]
    first = [table.choose(names, 2, np.random.default_rng(9), 4096) for _ in range(5)]
    second = [table.choose(names[::-1], 2, np.random.default_rng(9), 4096) for _ in range(5)]
    assert first == second


def test_unmeasured_peers_get_the_median_of_the_measured():
    table = fleet()
    times = delivery_seconds(dict(table.items()), ["fast0", "slow0", "fast1", "new"], 1 << 20)
    assert min(times["fast0"], times["slow0"]) <= times["new"] <= max(times["fast0"],
                                                                       times["slow0"])
    alone = delivery_seconds({}, ["new"], 0)
    assert alone["new"] == DEFAULT_RTT
    with pytest.raises(ValueError):
        choose_peers(["a"], {}, -1, np.random.default_rng(0), 10)


@pytest.mark.processes
def test_gossip_modules_import_no_io_stack():
    code = ("import sys\nimport p2ptrain.proto.gossip.mixer, p2ptrain.proto.gossip.averaging, "
            "p2ptrain.proto.gossip.peers\n"
            "print(','.join(m for m in ('asyncio', 'aiohttp', 'zeroconf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
