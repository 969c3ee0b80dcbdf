"""Push-pull parameter averaging: the pair's sum is preserved while both sides keep stepping,
consensus distance falls, subsets agree on both sides, bad replies leave params untouched."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.codecs import HEADER_SIZE, CodecError
from p2ptrain.proto.gossip.averaging import ParameterAverager, pull_share, read_snapshot
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.plan import AVERAGING_MODES, FAST_PAIR, AveragingPlan
from tests.test_gossip_mixer import reseal

N = 5003  # not a multiple of the subset block: the partial last run is exercised
A_ID, B_ID = b"A" * 16, b"B" * 16


def params(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def pair(mode: str, fraction: float = 0.3, chunk: int = 700):
    plan = AveragingPlan.from_mode(N, mode, fraction)
    return ParameterAverager(plan, chunk_elems=chunk), ParameterAverager(plan, chunk_elems=chunk)


def exchange(av_a, av_b, xa, xb, seed, between=None):
    """One push-pull: A snapshots and sends, `between()` runs local steps, B answers and
    applies at once, A applies the reply."""
    av_a.begin(xa, seed)
    request = list(av_a.messages(A_ID, 100))
    if between:
        between()
    report_b, reply = av_b.respond(xb, request, B_ID, 200)
    if between:
        between()
    report_a = av_a.finish(xa, reply)
    return report_a, report_b


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("mode", list(AVERAGING_MODES))
def test_pair_sum_is_preserved_while_both_sides_step(mode):
    av_a, av_b = pair(mode)
    xa, xb = params(1), params(2) * 3.0 + 0.5
    total = xa.astype(np.float64) + xb  # what the sum must be: start plus all local steps
    rng = np.random.default_rng(5)

    def local_steps():
        nonlocal total
        for x in (xa, xb):
            step = (rng.standard_normal(N) * 0.01).astype(np.float32)
            x += step
            total += step

    for seed in range(12):
        local_steps()
        report_a, report_b = exchange(av_a, av_b, xa, xb, seed, between=local_steps)
        assert report_a.peer == B_ID and report_b.peer == A_ID
        assert report_a.covered == report_b.covered and report_a.seed == report_b.seed
        assert report_a.distance == pytest.approx(report_b.distance, rel=1e-12)
        assert not av_a.is_open and not av_b.is_open
    np.testing.assert_allclose(xa.astype(np.float64) + xb, total, rtol=0, atol=2e-5)


@pytest.mark.parametrize("mode", list(AVERAGING_MODES))
def test_averaging_reduces_consensus_distance(mode):
    av_a, av_b = pair(mode)
    xa, xb = params(1), params(2)
    start = rms(xa - xb)
    distances, gaps = [], [start]
    for seed in range(8):
        report, _ = exchange(av_a, av_b, xa, xb, seed)
        distances.append(report.distance)
        gaps.append(rms(xa - xb))
    end, (subset, values) = gaps[-1], AVERAGING_MODES[mode]
    # what rounding leaves: each side moves by the rounded difference, so the gap after an
    # exchange is the two sides' rounding errors (int8: up to absmax/254 a block, here ~3/254)
    residue = {"fp32": 1e-6, "fp16": 2e-3, "int8": 1e-2}[values]
    if subset:  # ~0.7^8 of the coordinates never covered
        if values == "int8":  # a run both sides already hold alike may round alike: no move
            assert all(later <= earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
        else:
            assert all(later < earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
        assert end < 0.35 * start
    else:  # one full exchange nearly closes it, to the rounding residue
        assert distances[0] == pytest.approx(start, rel=1e-3 if values == "fp16" else 1e-2)
        assert distances[1] < residue * start
        assert end < residue * start


def test_full_exchange_reports_the_distance_and_meets_in_the_middle():
    av_a, av_b = pair("full")
    xa, xb = params(1), params(2)
    mid = (xa.astype(np.float64) + xb) / 2
    report, _ = exchange(av_a, av_b, xa, xb, 9)
    assert report.covered == N and report.distance == pytest.approx(rms(params(1) - params(2)))
    np.testing.assert_allclose(xa, mid, atol=1e-6)
    np.testing.assert_allclose(xb, mid, atol=1e-6)


def test_subset_is_shared_seeded_stratified_and_covers_the_tail():
    plan = AveragingPlan(N, fraction=0.3, block=256)
    runs = plan.subset(42)
    assert runs is not None and runs.shape[0] == plan.k_blocks == 6
    assert (np.diff(runs) > 0).all() and runs[0] >= 0 and runs[-1] < plan.n_blocks
    np.testing.assert_array_equal(runs, AveragingPlan(N, 0.3, block=256).subset(42))
    seen = np.zeros(plan.n_blocks, int)
    for seed in range(2000):
        seen[plan.subset(seed)] += 1
    assert (seen > 0).all()  # every run, the partial last one included, gets its turn
    assert seen.min() > 0.5 * seen.mean() and seen.max() < 1.5 * seen.mean()
    tail_seed = next(s for s in range(2000) if plan.subset(s)[-1] == plan.n_blocks - 1)
    av = ParameterAverager(plan)
    x = params(3)
    m = av.begin(x, tail_seed)
    assert m == 5 * 256 + N % 256
    snapshot = read_snapshot(av.messages(A_ID, 0)).chunks[0].decode()
    runs = plan.subset(tail_seed)
    expected = np.concatenate([x[r * 256 : (r + 1) * 256] for r in runs])
    np.testing.assert_array_equal(snapshot, expected)
    assert AveragingPlan(N, fraction=1.0).subset(1) is None
    assert AveragingPlan(10, fraction=0.01, block=4).k_blocks == 1


def test_fp16_snapshot_is_what_the_peer_decodes():
    av = ParameterAverager(AveragingPlan(N, values="fp16"))
    x = params(4) * 1e-3  # plenty of values that fp16 cannot hold exactly
    av.begin(x, 1)
    sent = read_snapshot(av.messages(A_ID, 0))
    decoded = np.concatenate([c.decode() for c in sent.chunks])
    assert not np.array_equal(decoded, x)  # rounding happened
    np.testing.assert_allclose(decoded, x, rtol=1e-3, atol=1e-7)
    # The reply built from the same snapshot twice is bit-identical: rounding is idempotent.
    again = np.concatenate([c.decode() for c in read_snapshot(av.messages(A_ID, 0)).chunks])
    np.testing.assert_array_equal(decoded, again)


@pytest.mark.parametrize("chunk", [700, 1024])
def test_int8_snapshot_is_what_the_peer_decodes_chunk_by_chunk(chunk):
    """int8 scales each block of 256 from its chunk's start: the own snapshot is rounded on
    the same grid, so it is exactly what the peer decodes (distance 0), also when chunks are
    not whole blocks; blocks of very different magnitudes make another grid show."""
    av = ParameterAverager(AveragingPlan(N, values="int8"), chunk_elems=chunk)
    x = params(4) * np.repeat(10.0 ** np.arange(-3, 3), -(-N // 6))[:N].astype(np.float32)
    av.begin(x, 1)
    sent = read_snapshot(av.messages(A_ID, 0))
    decoded = np.concatenate([c.decode() for c in sent.chunks])
    assert not np.array_equal(decoded, x)  # rounding happened
    assert np.abs(decoded - x).max() <= np.abs(x).max() / 254 * 1.001
    assert av.distance(sent) == 0.0
    # rounding the whole vector on one grid from 0 agrees only when chunks are whole blocks
    codec = AveragingPlan(N, values="int8").codec()
    one_grid = np.zeros(N, np.float32)
    raw = np.zeros(codec.encoded_size(N), np.uint8)
    codec.encode_into(x, raw)
    codec.decode_into(raw, one_grid)
    assert np.array_equal(one_grid, decoded) == (chunk % 256 == 0)


def test_bad_or_mismatched_replies_leave_params_untouched():
    xa, xb = params(1), params(2)
    for mode, tamper in [("full", "payload"), ("full", "seed"), ("fp16", "codec"),
                         ("subset", "plan"), ("full", "missing"), ("full", "far"),
                         ("int8", "code"), ("int8", "scale")]:
        av_a, av_b = pair(mode)
        if tamper == "far":
            av_a.max_distance = 0.5
        av_a.begin(xa, 7)
        other = av_b
        if tamper == "codec":
            other = ParameterAverager(AveragingPlan(N), chunk_elems=700)
        elif tamper == "plan":
            other = ParameterAverager(AveragingPlan.from_mode(N, "subset", 0.5), 700)
        other.begin(xb, 8 if tamper == "seed" else 7)
        reply = [bytes(m) for m in other.messages(B_ID, 0)]
        other.abort()
        if tamper == "payload":  # a NaN in the values, with a valid checksum
            raw = bytearray(reply[1])
            raw[HEADER_SIZE : HEADER_SIZE + 4] = np.float32(np.nan).tobytes()
            reply[1] = reseal(raw)
        elif tamper in ("code", "scale"):  # int8: code -128, or a negative block scale
            raw = bytearray(reply[1])
            if tamper == "code":  # the 3 scales of a 700-value chunk, then its codes
                raw[HEADER_SIZE + 12 + 5] = 0x80
            else:
                raw[HEADER_SIZE + 4 : HEADER_SIZE + 8] = np.float32(-1.0).tobytes()
            reply[1] = reseal(raw)
        elif tamper == "missing":
            reply = reply[:-1]
        before = xa.copy()
        with pytest.raises(CodecError):
            av_a.finish(xa, reply)
        np.testing.assert_array_equal(xa, before)
        assert not av_a.is_open, (mode, tamper)


def test_responder_refuses_a_bad_request_without_moving():
    av_a, av_b = pair("full")
    xa, xb = params(1), params(2)
    av_a.begin(xa, 3)
    request = [bytes(m) for m in av_a.messages(A_ID, 0)]
    before = xb.copy()
    with pytest.raises(CodecError):
        av_b.respond(xb, request[1:], B_ID, 0)
    np.testing.assert_array_equal(xb, before)
    assert not av_b.is_open


def test_misuse_is_a_local_error():
    av = ParameterAverager(AveragingPlan(N))
    x = params(1)
    with pytest.raises(RuntimeError):
        av.finish(x, [])
    av.begin(x, 1)
    with pytest.raises(RuntimeError):
        av.begin(x, 2)
    lazy = av.messages(A_ID, 0)
    av.abort()
    with pytest.raises(RuntimeError):
        next(lazy)
    with pytest.raises(TypeError):
        av.begin(x.astype(np.float64), 1)
    bad = x.copy()
    bad[3] = np.inf
    with pytest.raises(ValueError):
        av.begin(bad, 1)
    assert not av.is_open


@pytest.mark.parametrize("mode", list(AVERAGING_MODES))
def test_an_exchange_in_parts_preserves_the_sum_and_meets_like_one_message(mode):
    """A big model's exchange travels as parts of a few MB, each averaged on its own: the
    snapshot buffer is one part long, the pair's sum holds part by part while both sides
    step, and the parts together cover exactly what one message would."""
    part = 600  # rounds up to 768 = 3 runs of 256
    plan = AveragingPlan.from_mode(N, mode, 0.6, part=part)
    av_a, av_b = ParameterAverager(plan, chunk_elems=300), ParameterAverager(plan, 300)
    assert plan.buffer_size == 768 and av_a._snap.shape == (768,)
    xa, xb = params(1), params(2) * 2.0
    total = xa.astype(np.float64) + xb
    rng = np.random.default_rng(3)
    seed = 11
    parts = plan.parts(seed)
    assert parts == -(-plan.covered(seed) // 768) and parts > 1
    ranges = [plan.part_range(seed, p) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.covered(seed)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    covered = 0
    for p in range(parts):
        m = av_a.begin(xa, seed, p)
        request = list(av_a.messages(A_ID, 100))
        step = (rng.standard_normal(N) * 0.01).astype(np.float32)
        xb += step  # B steps while the part is in flight
        total += step
        report_b, reply = av_b.respond(xb, request, B_ID, 200, part=p)
        report_a = av_a.finish(xa, reply)
        assert report_a.covered == report_b.covered == m == ranges[p][1] - ranges[p][0]
        covered += m
    assert covered == plan.covered(seed)
    np.testing.assert_allclose(xa.astype(np.float64) + xb, total, rtol=0, atol=2e-5)
    with pytest.raises(ValueError):
        plan.part_range(seed, parts)  # no part past the end


def test_rate_weighted_pull_moves_the_slow_replica_and_keeps_the_weighted_mean():
    """With `gossip.average_pull_max` above 1/2 each side moves by its peer's share of the
    pair's sample rates: a replica 9x slower goes 90% of the way, the fast one 10%, and the
    rate-weighted mean of the pair stays where it was."""
    assert pull_share(1.0, 9.0, 0.5) == 0.5  # plain averaging: the default
    assert pull_share(None, 9.0, 0.95) == 0.5 and pull_share(1.0, None, 0.95) == 0.5
    assert pull_share(0.0, 0.0, 0.95) == 0.5  # nothing measured to weigh by
    assert pull_share(1.0, 9.0, 0.95) == pytest.approx(0.9)
    assert pull_share(9.0, 1.0, 0.95) == pytest.approx(0.1)
    assert pull_share(1.0, 1e9, 0.95) == 0.95 and pull_share(1e9, 1.0, 0.95) == pytest.approx(
        0.05)  # a forged rate moves an honest replica no more than the clamp
    # power 3: the rates' cubes are weighed -- a replica 3x slower moves 27/28 of the way,
    # the fast one 1/28; the clamp still bounds it, and huge or zero rates stay finite
    assert pull_share(1.0, 3.0, 0.99, 3.0) == pytest.approx(27 / 28)
    assert pull_share(3.0, 1.0, 0.99, 3.0) == pytest.approx(1 / 28)
    assert pull_share(3.0, 1.0, 0.9, 3.0) == pytest.approx(0.1)
    assert pull_share(2.0, 2.0, 0.99, 3.0) == 0.5
    assert pull_share(1e300, 1.0, 0.99, 16.0) == pytest.approx(0.01)
    assert pull_share(0.0, 5.0, 0.99, 16.0) == 0.99
    with pytest.raises(ValueError, match="average_pull_power"):
        GossipConfig(average_pull_power=0.5)
    av_a, av_b = pair("full")
    slow, fast = params(1), params(2)
    weighted = (1.0 * slow.astype(np.float64) + 9.0 * fast) / 10
    av_a.begin(slow, 5)  # both sides snapshot, the snapshots cross, each moves by its pull
    av_b.begin(fast, 5)
    to_b, to_a = list(av_a.messages(A_ID, 100)), list(av_b.messages(B_ID, 200))
    av_a.finish(slow, to_a, pull=pull_share(1.0, 9.0, 0.95))
    av_b.finish(fast, to_b, pull=pull_share(9.0, 1.0, 0.95))
    np.testing.assert_allclose(slow, 0.1 * params(1) + 0.9 * params(2), atol=1e-5)
    np.testing.assert_allclose(fast, 0.9 * params(2) + 0.1 * params(1), atol=1e-5)
    np.testing.assert_allclose((1.0 * slow + 9.0 * fast) / 10, weighted, atol=1e-5)
    av_a.begin(slow, 6)
    with pytest.raises(ValueError):  # a pull outside (0, 1) is a local error
        av_a.finish(slow, list(av_b.respond(fast, list(av_a.messages(A_ID, 1)), B_ID, 1)[1]),
                    pull=1.0)


def test_a_plan_with_a_slow_share_reads_it_from_the_seed_and_both_sides_agree():
    """`slow_fraction`: an exchange whose seed has the FAST_PAIR bit covers `fraction`, any
    other `slow_fraction`; the responder derives the share from the seed alone, and either
    exchange keeps the pair's sum as any subset does."""
    plan = AveragingPlan(N, fraction=0.3, slow_fraction=0.05, block=256)
    wide, narrow = 42 | FAST_PAIR, 42 & ~FAST_PAIR
    assert plan.k_for(wide) == plan.k_blocks == 6 and plan.k_for(narrow) == 1
    assert plan.covered(narrow) <= 256 < plan.covered(wide)
    assert plan.capacity == 6 * 256 and not plan.covers_all
    plain = AveragingPlan(N, fraction=0.3, block=256)
    assert plain.k_for(narrow) == plain.k_for(wide) == 6  # no slow share: the seed is moot
    for seed in (wide, narrow):
        av_a, av_b = ParameterAverager(plan), ParameterAverager(plan)
        xa, xb = params(11), params(12)
        total = xa.astype(np.float64) + xb
        report_a, report_b = exchange(av_a, av_b, xa, xb, seed)
        assert report_a.covered == report_b.covered == plan.covered(seed)
        assert int((xa != params(11)).sum()) == plan.covered(seed)
        np.testing.assert_allclose(xa.astype(np.float64) + xb, total, atol=1e-5)
    everything = AveragingPlan(N, fraction=1.0, slow_fraction=0.1)
    assert everything.subset(FAST_PAIR) is None and everything.subset(2) is not None
    assert everything.capacity == N and not everything.covers_all
    assert AveragingPlan.from_mode(N, "int8", 0.3, slow_fraction=0.01).slow_fraction is None
    assert AveragingPlan.from_mode(N, "subset_int8", 0.3,
                                   slow_fraction=0.01).slow_fraction == 0.01
    for bad in (0.0, 0.31):
        with pytest.raises(ValueError, match="slow_fraction"):
            AveragingPlan(N, fraction=0.3, slow_fraction=bad)
    with pytest.raises(ValueError, match="subset_fraction_slow"):
        GossipConfig(subset_fraction=0.1, subset_fraction_slow=0.2)


@pytest.mark.parametrize("mode", ["full", "int8"])
def test_a_spike_on_a_few_coordinates_moves_them_no_more_than_the_spread_bound(mode):
    """A peer can keep an exchange's RMS distance small while putting any value on a few
    coordinates: no coordinate moves by more than SPREAD x the exchange's median |difference|
    (over two, at pull 1/2), the same clip on both sides (their sum kept), honest ones
    untouched, and the distance reported -- what the guard judges -- is the clipped one."""
    from p2ptrain.proto.gossip.spread import SPREAD

    n = 1 << 22
    plan = AveragingPlan.from_mode(n, mode, 0.3)
    av_a, av_b = ParameterAverager(plan, chunk_elems=1 << 16), ParameterAverager(plan, 1 << 16)
    xa = params(1, n)
    xb = xa + np.float32(0.01) * params(2, n)  # an honest drift
    median = float(np.median(np.abs(xb - xa)))
    xb[100] += np.float32(1e3)  # and a spike: a move of 500 at pull 1/2 unclipped
    total = xa.astype(np.float64) + xb
    report, _ = exchange(av_a, av_b, xa, xb, 3)
    bound = 0.5 * SPREAD * median * 1.25 * 1.05  # (a bin is at most 25% wide)
    moved = np.abs(xa - params(1, n))
    assert moved[100] <= bound < 1  # clipped: 64 x a median of ~0.007
    assert report.distance < 0.05  # the spike counts as clipped (~0.5 RMS unclipped)
    honest = np.ones(n, bool)
    honest[:256] = False  # (in int8 the spike's scale block rounds coarsely: left out)
    assert moved[honest].max() < 0.1  # the honest coordinates met halfway as ever
    np.testing.assert_allclose(xa.astype(np.float64) + xb, total, rtol=0, atol=1e-2)
