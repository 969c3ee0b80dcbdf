"""Long exchanges (issue 17): an averaging part's give-up grows with its bytes over the
bandwidth measured to the peer, between node.average_timeout and gossip.average_timeout_max;
the staleness bound of peer gradients is set in seconds of the swarm's sample rate. Pure
formulas, and two trainers wired together in memory, in virtual time: no sleeps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from p2ptrain.config import resolve, settings_of
from p2ptrain.models.lora import LoRAConfig, lora_sizes
from p2ptrain.models.presets import PRESETS
from p2ptrain.models.rwkv import RWKVConfig
from p2ptrain.proto.gossip.config import AUTO, AUTO_FULL_FLOPS, GossipConfig, flops_per_coordinate
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.gossip.mixer import STEP_FLOOR, GradientMixer
from p2ptrain.proto.gossip.peers import MIN_BANDWIDTH_BYTES, PeerStats, PeerTable, give_up_seconds
from p2ptrain.proto.gossip.swarmrate import SwarmRate
from p2ptrain.proto.gossip.trainer import GossipTrainer
from p2ptrain.proto.messages import Out
from sims import run
from sims.scenario import parse
from tests.proto_samples import A, B, C
from tests.test_gossip_mixer import LOOSE, N, grad, msgs, send
from tests.test_node import learner

FLOOR, MARGIN, CEILING = 90.0, 4.0, 600.0
MB = 1_000_000


def table(**bandwidths: float) -> PeerTable:
    """Peers measured at these bandwidths (bytes/s, both ways together), RTT 50 ms."""
    t = PeerTable()
    for peer, bw in bandwidths.items():
        t.observe_transfer(peer, 10 * MB, 0, 10 * MB / bw, 0.0)  # before any RTT: exact
        t.observe_rtt(peer, 0.05, 0.0)
    return t


def bound(t: PeerTable, peer: str, nbytes: int) -> float:
    return t.give_up(peer, nbytes, floor=FLOOR, margin=MARGIN, ceiling=CEILING)


# -- the give-up formula ----------------------------------------------------------------------


def test_the_give_up_is_the_floor_until_a_bandwidth_is_measured():
    assert bound(PeerTable(), B, 400 * MB) == FLOOR
    rtt_only = PeerTable()
    rtt_only.observe_rtt(B, 0.3, 0.0)
    assert bound(rtt_only, B, 400 * MB) == FLOOR


def test_a_1b_exchange_over_a_measured_link_waits_its_bytes_over_the_bandwidth():
    # the default's 200 MB snapshot each way at 1B parameters, over 10 MB/s (both ways)
    t = table(p=10 * MB)
    assert bound(t, "p", 400 * MB) == pytest.approx(MARGIN * (0.05 + 40.0))  # 160 s, not 90
    assert bound(t, "p", 4 * MB) == FLOOR  # a part of a few MB: the floor
    # a peer never measured is given the median of the measured ones
    t = table(a=2 * MB, b=10 * MB, c=20 * MB)
    assert bound(t, "new", 400 * MB) == pytest.approx(bound(t, "b", 400 * MB))


def test_the_give_up_is_bounded_whatever_the_measurements():
    # a hostile or broken peer that crawls: the ceiling, never longer
    t = table(slow=1.0)
    assert bound(t, "slow", 400 * MB) == CEILING
    for bw in (MIN_BANDWIDTH_BYTES / 1e9, 1e-300):
        stats = {"x": PeerStats(bandwidth=bw, rtt=1e300)}
        assert give_up_seconds(stats, "x", 10**18, floor=FLOOR, margin=MARGIN,
                               ceiling=CEILING) == CEILING
    # a ceiling below the floor leaves the fixed floor
    assert give_up_seconds({"x": PeerStats(bandwidth=1.0)}, "x", MB, floor=FLOOR,
                           margin=MARGIN, ceiling=10.0) == FLOOR
    for bad in (dict(floor=math.nan), dict(margin=0.5), dict(ceiling=math.inf),
                dict(floor=0.0)):
        kwargs = dict(floor=FLOOR, margin=MARGIN, ceiling=CEILING) | bad
        with pytest.raises(ValueError):
            give_up_seconds({}, "x", MB, **kwargs)


def test_a_shortfall_lowers_the_bandwidth_to_what_it_proves():
    s = PeerStats(bandwidth=10 * MB, last_seen=3.0)
    lowered = s.with_shortfall(400 * MB, 160.0)  # 400 MB not through in 160 s
    assert lowered.bandwidth == pytest.approx(2.5 * MB) and lowered.last_seen == 3.0
    assert lowered.with_shortfall(400 * MB, 10.0) == lowered  # proves less than known
    assert s.with_shortfall(100, 50.0) == s  # too small to say anything
    assert PeerStats().with_shortfall(MB, 100.0).bandwidth == pytest.approx(1e4)
    with pytest.raises(ValueError):
        s.with_shortfall(MB, math.nan)


# -- the trainer, in virtual time --------------------------------------------------------------


def trainer(node_id: str, **gossip) -> GossipTrainer:
    config = GossipConfig(**({"average_every": 1, "averaging": "full"} | gossip))
    return GossipTrainer(config, learner(node_id), np.random.default_rng(1),
                         average_timeout=FLOOR, chunk_elems=1 << 20)


def take_step(t: GossipTrainer, now: float, partners=((B, "10.0.0.2:7100"),)) -> list[Out]:
    out: list[Out] = []
    loss = t.learner.compute_gradient()
    t.step(now, loss, (), list(partners), out)
    return out


def part_bytes(t: GossipTrainer) -> int:
    """Bytes a part of `t`'s exchange sends (the reply carries as many)."""
    t.initiator.begin(t.learner.params, 1)
    size = sum(len(m) for m in t.initiator.messages(t.sender, 0))
    t.initiator.abort()
    return size


def test_a_large_exchange_over_a_slow_link_is_not_given_up_at_90_s_but_at_its_bound():
    t = trainer(A)
    sent = part_bytes(t)
    # measured: both ways of a part take 25 s -> expected 25.05 s, give-up 4x = 100.2 s
    t.peers.observe_transfer(B, sent, sent, 25.0, 0.0)
    t.peers.observe_rtt(B, 0.05, 0.0)
    [request] = take_step(t, 1000.0)
    assert isinstance(request.body, AverageRequest) and request.to == B
    ex = t.exchange
    assert ex.sent == sent and ex.started == 1000.0
    assert ex.deadline - ex.started == pytest.approx(MARGIN * (0.05 + 25.0))
    assert t.next_deadline() == ex.deadline
    t.tick(1000.0 + FLOOR)  # the old fixed give-up: still waiting
    t.tick(ex.deadline - 1e-6)
    assert t.exchange is ex and t.stats["average_timeout"] == 0
    t.tick(ex.deadline)  # the scaled bound: given up
    assert t.exchange is None and not t.initiator.is_open
    assert t.stats["average_timeout"] == 1
    # the shortfall proves the link slower still: the next part waits longer (x margin)
    assert t.peers.get(B).bandwidth == pytest.approx(2 * sent / (ex.deadline - ex.started))
    take_step(t, 2000.0)
    second = t.exchange  # 401 s
    assert second.deadline - second.started == pytest.approx(
        MARGIN * (0.05 + (ex.deadline - ex.started)))
    t.tick(second.deadline)  # (b rests twice the 401 s: answer.strike)
    take_step(t, second.deadline + 2 * (second.deadline - second.started))
    assert t.exchange is not None  # and the ceiling bounds the back-off
    assert t.exchange.deadline - t.exchange.started == CEILING


def test_an_unmeasured_peer_gets_the_floor_and_a_fast_one_too():
    t = trainer(A)
    take_step(t, 10.0)
    assert t.exchange.deadline == 10.0 + FLOOR
    t.tick(10.0 + FLOOR)
    assert t.stats["average_timeout"] == 1
    fast = trainer(A)
    fast.peers.observe_transfer(B, 100 * MB, 100 * MB, 1.0, 0.0)
    take_step(fast, 10.0)
    assert fast.exchange.deadline == 10.0 + FLOOR


def test_averaging_partners_are_drawn_with_the_configured_exploration():
    """`gossip.average_explore` floors the averaging partner draw: at the default 0.01 a peer
    whose exchange takes 100x longer is hardly ever chosen (an exchange with it would hold the
    node's one exchange all that while); at 1.0 it gets about a third of the draws."""
    partners = ((B, "10.0.0.2:7100"), (C, "10.0.0.3:7100"))
    picks = {}
    for explore in (0.01, 1.0):
        t = trainer(A, average_explore=explore)
        for peer, seconds in ((B, 0.01), (C, 1.0)):  # the round trip dominates
            t.peers.observe_rtt(peer, seconds, 0.0)
            t.peers.observe_transfer(peer, 100 * MB, 100 * MB, 0.1 + seconds, 0.0)
        chosen = []
        for i in range(200):
            take_step(t, 10.0 + i, partners)
            chosen.append(t.exchange.peer)
            t.close()  # forget the exchange: the next step opens another
        picks[explore] = chosen.count(C)
    assert picks[0.01] <= 6 and picks[1.0] >= 40
    assert GossipConfig().average_explore == 0.01
    with pytest.raises(ValueError, match="average_explore"):
        GossipConfig(average_explore=1.5)


def test_averaging_partners_are_peers_whose_rate_is_known_and_fast_ones_by_the_power():
    """With observed sample rates, a peer whose rate is not known yet is never an averaging
    partner, and a due exchange with none known is skipped (counted); the draw weighs the
    rates to `average_draw_power`: on equal links a peer 3x slower gets 1/28 of the weight at
    3, 1/4 at 1. A trainer that observes no rates (`rate_of` None) draws by link alone."""
    d = "dd" * 16
    partners = ((B, "10.0.0.2:7100"), (C, "10.0.0.3:7100"), (d, "10.0.0.4:7100"))
    picks = {}
    for power in (1.0, 3.0):
        t = trainer(A, average_draw_power=power, average_explore=0.0)
        for peer in (B, C, d):
            t.peers.observe_rtt(peer, 0.01, 0.0)
        rates = {A: 6.0, B: 6.0, C: 2.0, d: None}
        t.rate_of = rates.get
        chosen = []
        for i in range(400):
            take_step(t, 10.0 + i, partners)
            chosen.append(t.exchange.peer)
            t.close()
        picks[power] = (chosen.count(C), chosen.count(d))
    assert picks[1.0][1] == picks[3.0][1] == 0  # the unknown peer: never
    assert 60 <= picks[1.0][0] <= 140 and picks[3.0][0] <= 35  # 1/4 (100) and 1/28 (14) of 400
    t = trainer(A)
    t.rate_of = {A: 6.0}.get  # no partner's rate known yet
    assert take_step(t, 1.0, partners) == [] and t.exchange is None
    assert t.stats["average_waited"] == 1
    t = trainer(A)  # nothing observes rates: partners by link alone
    assert take_step(t, 1.0, partners) and t.exchange is not None
    blind = trainer(A, average_known_rates=False)
    blind.rate_of = {A: 6.0}.get
    assert take_step(blind, 1.0, partners) and blind.exchange is not None
    assert GossipConfig().average_draw_power == 3.0 and GossipConfig().average_known_rates
    with pytest.raises(ValueError, match="average_draw_power"):
        GossipConfig(average_draw_power=0.5)


def exchange_round(a: GossipTrainer, b: GossipTrainer, request: Out, now: float) -> list[Out]:
    """Deliver `request` from a to b at `now`, and b's reply back to a; a's next sends."""
    parsed = b.parse(A, request.body)
    replies: list[Out] = []
    b.on_body(now, A, "10.0.0.1:7100", request.body, parsed, busy=False,
              outbound_sender=False, out=replies)
    [reply] = replies
    assert isinstance(reply.body, AverageReply) and reply.body.chunks
    parsed = a.parse(B, reply.body)
    out: list[Out] = []
    a.on_body(now, B, "10.0.0.2:7100", reply.body, parsed, busy=False,
              outbound_sender=False, out=out)
    return out


def test_an_exchange_sends_no_part_after_it_has_run_the_maximum():
    small = dict(averaging="subset", subset_fraction=1.0, average_part=1024,
                 average_timeout_max=150.0)
    a, b = trainer(A, **small), trainer(B, **small)
    [request] = take_step(a, 0.0)
    assert a.exchange.parts >= 3
    [request] = exchange_round(a, b, request, 100.0)  # part 0 done: part 1 goes at once
    assert a.exchange.part == 1 and a.exchange.opened == 0.0
    assert a.exchange.deadline == 100.0 + FLOOR
    assert exchange_round(a, b, request, 160.0) == []  # part 1 done, the maximum passed
    assert a.exchange is None and a.stats["average_cut_short"] == 1
    assert a.stats["average_applied"] == 2  # the parts done stay applied


# -- staleness in seconds of the swarm's sample rate --------------------------------------------


def test_the_swarm_rate_is_the_counts_growth_over_recent_steps():
    rate = SwarmRate(window=4)
    assert rate.samples_per_second is None and rate.step_seconds is None
    rate.observe(0.0, 0)
    assert rate.samples_per_second is None
    for t, count in ((1.0, 1000), (2.0, 2000), (3.0, 3000), (4.0, 10_000)):
        rate.observe(t, count)
    # the window keeps the last 4 boundaries: (1, 1000) .. (4, 10000)
    assert rate.samples_per_second == pytest.approx(9000 / 3)
    assert rate.step_seconds == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rate.observe(3.5, 11_000)  # time never runs backwards
    rate.clear()
    assert rate.samples_per_second is None


def test_staleness_is_bounded_in_seconds_of_the_swarm_sample_rate():
    mixer = GradientMixer(GossipConfig(max_staleness_seconds=2.0, **LOOSE), N)
    # nothing measured: nothing is dropped as stale
    assert mixer.max_staleness == math.inf
    assert send(mixer, msgs(grad(1), 1, 0, 8.0), 10**9) is not None
    assert mixer.mix(grad(0), 8.0, 10**9).dropped_stale == 0
    # a fast swarm: 1,000 samples/s, 0.1 s steps -> 2 s are 2,000 samples
    for i in range(11):
        mixer.observe(0.1 * i, 100 * i)
    assert mixer.max_staleness == pytest.approx(2000)
    send(mixer, msgs(grad(1), 1, 1000, 8.0), 1000)
    send(mixer, msgs(grad(2), 2, 999, 8.0), 1000)
    report = mixer.mix(grad(0), 8.0, 3000)  # 2,000 and 2,001 samples old
    assert report.senders == {bytes([1]) * 16} and report.dropped_stale == 1
    assert report.max_staleness == pytest.approx(2000)
    # the same 2 s in a swarm 100x slower (a larger model): 20 samples
    slow = GradientMixer(GossipConfig(max_staleness_seconds=2.0, **LOOSE), N)
    for i in range(11):
        slow.observe(0.1 * i, i)
    assert slow.max_staleness == pytest.approx(20)
    send(slow, msgs(grad(1), 1, 1000, 8.0), 1000)
    assert slow.mix(grad(0), 8.0, 1021).dropped_stale == 1


def test_the_bound_is_never_less_than_two_own_steps():
    mixer = GradientMixer(GossipConfig(max_staleness_seconds=2.0, **LOOSE), N)
    for i in range(5):  # a Pi at 1B: a 30 s step, the swarm 40 samples/s
        mixer.observe(30.0 * i, 1200 * i)
    assert mixer.rate.step_seconds == 30.0
    assert mixer.max_staleness == pytest.approx(40 * STEP_FLOOR * 30.0)


def test_the_deprecated_count_replaces_the_seconds_and_old_files_still_load(tmp_path):
    fixed = GradientMixer(GossipConfig(max_staleness_samples=4096, **LOOSE), N)
    assert fixed.max_staleness == 4096  # before any measurement
    for i in range(3):
        fixed.observe(float(i), 10**6 * i)
    assert fixed.max_staleness == 4096  # whatever the rate
    path = tmp_path / "node.toml"
    path.write_text("[gossip]\nmax_staleness_samples = 32768\n")
    gossip = settings_of(resolve(str(path), {}, {})).node.gossip
    assert (gossip.max_staleness_samples, gossip.max_staleness_seconds) == (32768, 5.0)
    seconds = settings_of(resolve(None, {"P2PTRAIN_GOSSIP_MAX_STALENESS_SECONDS": "12"}, {}))
    assert seconds.node.gossip.max_staleness_seconds == 12.0
    for bad in (dict(max_staleness_seconds=-1.0), dict(max_staleness_seconds=math.nan),
                dict(max_staleness_samples=-1), dict(average_timeout_margin=0.5),
                dict(average_timeout_max=math.inf)):
        with pytest.raises(ValueError):
            GossipConfig(**bad)


def test_the_default_bound_keeps_the_old_count_at_the_default_model():
    # seed-fleet, default model: the swarm makes ~6,700 samples/s (BENCHMARKS §8), where the
    # old default was 32,768 samples
    assert GossipConfig().max_staleness_seconds * 6678 == pytest.approx(32768, rel=0.02)
    assert GossipConfig().max_staleness_samples == 0


def test_the_trainer_measures_the_rate_at_every_step():
    t = trainer(A, average_every=0)
    for i in range(4):
        take_step(t, 0.5 * i, partners=())
    assert t.mixer.rate.samples_per_second == pytest.approx(t.learner.batch / 0.5)
    assert t.last_mix.max_staleness == pytest.approx(
        t.learner.batch / 0.5 * max(5.0, STEP_FLOOR * 0.5))
    t.close()  # the replica may be replaced: the rate starts afresh
    assert t.mixer.max_staleness == math.inf


# -- the simulator's traffic model gives exchanges up as the protocol does ---------------------


SLOW_OFFICE = {
    "name": "slow-office", "mode": "traffic", "duration": 900.0, "seed": 2,
    "charge": {"params": 1e9, "ctx_len": 64},
    "sites": [{"name": "dc"},
              {"name": "office", "uplink": {"kind": "fibre", "up_mbps": 50.0,
                                            "down_mbps": 200.0, "latency_ms": 10.0}}],
    "nodes": [{"device": "server", "count": 2, "site": "dc", "medium": "wired"},
              {"device": "server", "count": 2, "site": "office", "medium": "wired"}],
    "sweep": {"nodes": [2]},
    "methods": [{"name": "fixed", "kind": "gossip", "average_timeout_max": 90.0,
                 "averaging": "subset_fp16"},  # 200 MB an exchange (int8: 100 MB)
                {"name": "scaled", "kind": "gossip", "averaging": "subset_fp16"}],
}


def test_the_traffic_model_gives_up_long_exchanges_later_and_completes_them():
    fixed, scaled = run.run_scenario(parse(SLOW_OFFICE))["points"]
    # 200 MB up a 50 Mbit/s uplink: 32 s alone, minutes when the office's machines share it
    assert fixed["average_give_up_median_max"] == [90.0, 90.0]
    assert scaled["average_give_up_median_max"][1] <= GossipConfig().average_timeout_max
    _, done, given_up = fixed["averages_across_sites"]  # seed 2: 2 done, 34 given up
    assert given_up > 5 * done
    _, s_done, s_given_up = scaled["averages_across_sites"]  # 22 done, 5 given up
    assert s_done > 5 * max(done, 1) and s_given_up < given_up
    for row in (fixed, scaled):  # what is still in flight at the end is not given up
        started, open_at_end = row["averages_across_sites"][0], row["averages_open_at_end"]
        assert open_at_end > 0 and row["averages_given_up"] < started


class _Heavier:
    """A model that computes `factor` times as much per sample (LoRA on a big frozen base:
    the same travelling vector, far more FLOPs), otherwise the learner's own."""

    def __init__(self, model, factor: float):
        self._model, self._factor = model, factor

    def flops_per_token(self) -> float:
        return self._model.flops_per_token() * self._factor

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_auto_averaging_covers_everything_only_where_compute_dwarfs_the_exchange():
    """`averaging = "auto"` (the default): a subset in int8 for a fully trained model (~6 x
    ctx_len FLOPs per coordinate and sample); every coordinate in int8 once the model computes
    AUTO_FULL_FLOPS per travelling coordinate (rank-16 LoRA on the seed-1b base: 19,470)."""
    config = GossipConfig()
    assert config.averaging == AUTO
    plain = GossipTrainer(config, learner("a" * 16), np.random.default_rng(1),
                          average_timeout=FLOOR, chunk_elems=1 << 20)
    n = plain.learner.model.space.n_params
    per = flops_per_coordinate(plain.learner.model, n)
    assert per < AUTO_FULL_FLOPS and (plain.plan.fraction, plain.plan.values) == (0.1, "int8")
    heavy = learner("b" * 16)
    heavy.model = _Heavier(heavy.model, 2 * AUTO_FULL_FLOPS / per)
    full = GossipTrainer(config, heavy, np.random.default_rng(1), average_timeout=FLOOR,
                         chunk_elems=1 << 20)
    assert (full.plan.fraction, full.plan.values) == (1.0, "int8")
    seed1b = RWKVConfig(**dict(zip(("n_layer", "n_embd"), PRESETS["seed-1b"], strict=True)),
                        vocab_size=50277)
    params, flops = lora_sizes(seed1b, LoRAConfig(rank=16))
    assert config.averaging_mode(flops * seed1b.ctx_len / params) == "int8"
    assert GossipConfig(averaging="subset").averaging_mode(1e9) == "subset"  # set by hand


def test_the_start_log_says_what_auto_averaging_resolved_to():
    from p2ptrain.models import build_model
    from p2ptrain.startup import averaging_text

    settings = settings_of(resolve(None, {}, {}))
    model = build_model("rwkv")
    text = averaging_text(settings, model)
    assert "a seeded 10% of the coordinates in int8" in text and "every 5 steps" in text
    assert "(auto: 375 FLOPs" in text and "under 2,000" in text, text
    heavy = _Heavier(model, 10.0)
    assert "every coordinate in int8" in averaging_text(settings, heavy)
    off = settings_of(resolve(None, {}, {"gossip.average_every": 0}))
    assert averaging_text(off, model).endswith("off (gossip.average_every = 0)")
    fixed = settings_of(resolve(None, {}, {"gossip.averaging": "full",
                                           "gossip.average_every_fast": 0}))
    assert averaging_text(fixed, heavy).endswith("every coordinate in fp32 with one peer every "
                                                 "5 steps")
    tiered = settings_of(resolve(None, {}, {"gossip.subset_fraction": 0.3,
                                            "gossip.subset_fraction_slow": 0.001}))
    assert ("a seeded 30% of the coordinates between two of the swarm's fastest members, 0.1% "
            "otherwise in int8") in averaging_text(tiered, model)
    assert "subset_fraction_slow is for the subset modes: unused" in averaging_text(
        tiered, heavy)  # auto resolves to every coordinate there
    assert ("every 5 steps, and with one of the swarm's fastest every 1 step while this node is "
            "one of them and they are at most 50% of the members (auto") in text  # a fast core
    lora = settings_of(resolve(None, {}, {"train.mode": "lora"}))  # whatever their share
    assert ("with one peer every 5 steps, and with one of the swarm's fastest every 1 step "
            "while this node is one of them (auto") in averaging_text(lora, heavy)
    assert "every 2 steps while" in averaging_text(settings_of(resolve(
        None, {}, {"gossip.average_every_fast": 2})), model)
