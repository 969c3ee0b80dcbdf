"""Gradient gossip: the config, the sender's encoder, and the mixer's queue, staleness,
clipping, refusals and weighted average."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
import xxhash

from p2ptrain.codecs import (
    HEADER_SIZE,
    CodecError,
    ErrorFeedback,
    decode_message,
    encode_vector,
    make_codec,
)
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.mixer import (
    CHUNK_OVERHEAD,
    MAX_PEER_CHUNK,
    Arrival,
    GradientMixer,
    PlainEncoder,
    gradient_encoder,
)
from p2ptrain.proto.gossip.peers import PeerTable

N = 1000
LOOSE = dict(clip_multiple=1e3, absurd_norm_multiple=1e4)  # no clipping in weight tests


def sid(i: int) -> bytes:
    return bytes([i]) * 16


def grad(seed: int, scale: float = 1.0, n: int = N) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def msgs(x, sender: int, samples: int, weight: float, codec: str = "none",
         chunk: int = 1 << 20, **params) -> list[bytes]:
    return [bytes(m) for m in encode_vector(
        make_codec(codec, **params), x, sender_id=sid(sender), swarm_samples=samples,
        weight=weight, seed=samples, chunk_elems=chunk)]


def send(mixer: GradientMixer, messages, now: int) -> Arrival:
    out = None
    for m in messages:
        out = mixer.receive(m, now)
    return out


def state(mixer: GradientMixer):
    return mixer.pending, mixer.pending_bytes, mixer.norms


def reseal(raw: bytearray) -> bytes:
    """Recompute a tampered message's checksum, so only the payload defect remains."""
    end = len(raw) - 8
    struct.pack_into("<Q", raw, end, xxhash.xxh3_64_intdigest(bytes(raw[:end])))
    return bytes(raw)


# -- config and encoder -----------------------------------------------------------------------


def test_config_defaults_and_validation():
    cfg = GossipConfig()  # the simulator's choice: pure averaging, 10% int8 every 5 steps
    assert cfg.fanout == 0 and cfg.codec == "topk" and cfg.codec_params["fraction"] == 0.01
    assert (cfg.averaging, cfg.subset_fraction, cfg.max_staleness_seconds) == (
        "auto", 0.1, 5.0)  # auto: the 10% subset in full training, everything in LoRA mode
    assert (cfg.averaging_mode(384.0), cfg.averaging_mode(19470.0)) == ("subset_int8", "int8")
    assert cfg.uses_error_feedback
    assert not GossipConfig(codec="fp16", codec_params={}).uses_error_feedback
    assert [s for s in range(1, 31) if cfg.averaging_due(s)] == [5, 10, 15, 20, 25, 30]
    assert not any(GossipConfig(average_every=0).averaging_due(s) for s in range(50))
    for bad in (dict(fanout=-1), dict(averaging="sometimes"), dict(subset_fraction=0.0),
                dict(codec="zip", codec_params={}), dict(queue_vectors=0)):
        with pytest.raises(ValueError):
            GossipConfig(**bad)


def test_gradient_encoder_uses_error_feedback_only_for_biased_codecs():
    assert isinstance(gradient_encoder(GossipConfig(), N), ErrorFeedback)
    assert isinstance(gradient_encoder(GossipConfig(error_feedback=False), N), PlainEncoder)
    plain = gradient_encoder(GossipConfig(codec="fp16", codec_params={}), N)
    assert isinstance(plain, PlainEncoder)
    out = np.zeros(N, np.float32)
    for m in plain.encode_vector(grad(1), sender_id=sid(1), swarm_samples=5, weight=8.0,
                                 seed=1):
        decode_message(m, out)
    np.testing.assert_allclose(out, grad(1), rtol=1e-3, atol=1e-4)


# -- mixing -------------------------------------------------------------------------------------


def test_mix_is_the_sample_weighted_average():
    mixer = GradientMixer(GossipConfig(**LOOSE), N)
    g0, g1, g2 = grad(0), grad(1), grad(2)
    assert send(mixer, msgs(g1, 1, 100, 32.0), 100) is Arrival.COMPLETE
    assert send(mixer, msgs(g2, 2, 90, 16.0), 100) is Arrival.COMPLETE
    own = g0.copy()
    report = mixer.mix(own, 8.0, 110)
    expected = (8 * g0.astype(np.float64) + 32 * g1 + 16 * g2) / 56
    np.testing.assert_allclose(own, expected, rtol=1e-5, atol=1e-6)
    assert report.total_weight == 56.0 and report.senders == {sid(1), sid(2)}
    assert [p.staleness for p in report.peers] == [10, 20]
    assert all(p.scale == 1.0 for p in report.peers)
    assert mixer.pending == 0 and mixer.pending_bytes == 0
    assert mixer.used == {sid(1): 1, sid(2): 1}
    again = g0.copy()  # nothing waits any more: the own gradient passes through
    assert mixer.mix(again, 8.0, 120).peers == ()
    np.testing.assert_array_equal(again, g0)


def test_chunked_vectors_wait_until_whole_and_mix_with_any_codec():
    mixer = GradientMixer(GossipConfig(max_staleness_samples=4096, **LOOSE), N)
    g0, g1, g2 = grad(0), grad(1), grad(2)
    a = msgs(g1, 1, 50, 4.0, chunk=300)  # 4 chunks
    b = msgs(g2, 2, 50, 12.0, "topk", chunk=256, fraction=0.1)
    assert len(a) == 4 and len(b) == 4
    arrivals = [mixer.receive(m, 60) for pair in zip(a[::-1], b, strict=True) for m in pair]
    assert arrivals[:-2] == [Arrival.PENDING] * 6
    assert arrivals[-2:] == [Arrival.COMPLETE, Arrival.COMPLETE]
    partial = msgs(grad(3), 3, 55, 4.0, chunk=300)[:2]  # never completes in time
    send(mixer, partial, 60)
    own = g0.copy()
    report = mixer.mix(own, 4.0, 60)
    sparse = np.zeros(N, np.float32)
    for m in b:
        decode_message(m, sparse)
    expected = (4 * g0.astype(np.float64) + 4 * g1 + 12 * sparse) / 20
    np.testing.assert_allclose(own, expected, rtol=1e-5, atol=1e-6)
    assert report.senders == {sid(1), sid(2)} and report.pending == 1
    report = mixer.mix(g0.copy(), 4.0, 60 + 5000)  # the partial vector expires
    assert report.dropped_incomplete == 1 and mixer.drops["incomplete"] == 1
    assert mixer.pending == 0


def test_staleness_is_counted_in_swarm_samples_at_use():
    mixer = GradientMixer(GossipConfig(max_staleness_samples=100, **LOOSE), N)
    g0 = grad(0)
    assert send(mixer, msgs(grad(1), 1, 1000, 8.0), 1050) is Arrival.COMPLETE
    own = g0.copy()
    report = mixer.mix(own, 8.0, 1101)  # 101 samples since it was computed: too old
    assert report.peers == () and report.dropped_stale == 1 and mixer.drops["stale"] == 1
    np.testing.assert_array_equal(own, g0)
    assert mixer.pending == 0
    # Already too old on arrival: not even queued.
    assert send(mixer, msgs(grad(1), 1, 1000, 8.0), 1200) is Arrival.STALE
    assert mixer.drops["stale"] == 2 and mixer.pending == 0
    # Exactly at the limit is still fresh, however many steps that took anyone.
    send(mixer, msgs(grad(2), 2, 1100, 8.0), 1150)
    assert mixer.mix(g0.copy(), 8.0, 1200).senders == {sid(2)}
    # A sender ahead of us is aged from arrival (our count then), not from its own count.
    send(mixer, msgs(grad(3), 3, 9000, 8.0), 2000)
    assert mixer.mix(g0.copy(), 8.0, 2101).dropped_stale == 1
    send(mixer, msgs(grad(3), 3, 9001, 8.0), 2000)
    assert mixer.mix(g0.copy(), 8.0, 2100).senders == {sid(3)}


def test_peer_gradients_are_clipped_to_a_multiple_of_the_median_norm():
    mixer = GradientMixer(GossipConfig(clip_multiple=2.0, norm_window=8), N)
    g0 = grad(0)
    g0 /= np.linalg.norm(g0)  # own norm 1
    for _ in range(3):
        mixer.mix(g0.copy(), 8.0, 0)
    big = grad(1)
    big *= 10.0 / np.linalg.norm(big)  # norm 10: clipped to 2
    small = grad(2)
    small *= 1.5 / np.linalg.norm(small)  # below the threshold: untouched
    send(mixer, msgs(big, 1, 0, 8.0), 0)
    send(mixer, msgs(small, 2, 0, 8.0), 0)
    own = g0.copy()
    report = mixer.mix(own, 8.0, 0)
    assert report.clip_norm == pytest.approx(2.0, rel=1e-5)
    scales = {p.sender: p.scale for p in report.peers}
    assert scales[sid(1)] == pytest.approx(0.2, rel=1e-5) and scales[sid(2)] == 1.0
    expected = (g0.astype(np.float64) + 0.2 * big + small) / 3
    np.testing.assert_allclose(own, expected, rtol=1e-5, atol=1e-6)
    assert len(mixer.norms) == 6 and max(mixer.norms) == pytest.approx(10.0, rel=1e-5)


def test_bad_messages_are_refused_and_leave_the_mixer_unchanged():
    mixer = GradientMixer(GossipConfig(absurd_norm_multiple=100.0), N)
    g0 = grad(0)
    mixer.mix(g0.copy(), 8.0, 0)  # the median norm is now ~sqrt(N)
    send(mixer, msgs(grad(1), 1, 0, 8.0, chunk=600)[:1], 0)  # one half-received vector
    before = state(mixer)

    nan = bytearray(msgs(grad(2), 2, 0, 8.0)[0])
    struct.pack_into("<f", nan, HEADER_SIZE + 4 * 17, float("nan"))
    wrong_length = msgs(grad(3, n=N + 1), 3, 0, 8.0)[0]
    absurd = msgs(grad(4, scale=1e3), 4, 0, 8.0)[0]  # 1000x the median norm
    zero_weight = msgs(grad(5), 5, 0, 0.0)[0]
    duplicate = msgs(grad(1), 1, 0, 8.0, chunk=600)[0]
    inconsistent = msgs(grad(1), 1, 0, 9.0, chunk=600)[1]
    flipped = bytearray(msgs(grad(6), 6, 0, 8.0)[0])
    flipped[HEADER_SIZE + 3] ^= 1  # checksum no longer matches
    cases = [(reseal(nan), "malformed"), (wrong_length, "malformed"), (absurd, "norm"),
             (zero_weight, "malformed"), (duplicate, "malformed"),
             (inconsistent, "malformed"), (bytes(flipped), "malformed"), (b"junk", "malformed")]
    for raw, kind in cases:
        count = mixer.drops[kind]
        with pytest.raises(CodecError):
            mixer.receive(raw, 0)
        assert mixer.drops[kind] == count + 1
        assert state(mixer) == before
    own = g0.copy()
    assert mixer.mix(own, 8.0, 0).peers == ()
    np.testing.assert_array_equal(own, g0)


def test_a_vector_whose_total_norm_is_absurd_is_dropped_whole():
    mixer = GradientMixer(GossipConfig(absurd_norm_multiple=5.0, clip_multiple=2.0), 1200)
    one = grad(0, n=1200)
    mixer.mix(one, 1.0, 0)
    x = grad(1, n=1200)
    median = np.linalg.norm(one)
    for half in (x[:600], x[600:]):  # each half 4.2x the median: fine alone, 5.9x together
        half *= 4.2 * median / np.linalg.norm(half)
    parts = msgs(x, 1, 0, 8.0, chunk=600)
    assert mixer.receive(parts[0], 0) is Arrival.PENDING
    with pytest.raises(CodecError):
        mixer.receive(parts[1], 0)
    assert mixer.pending == 0 and mixer.pending_bytes == 0 and mixer.drops["norm"] == 1


def test_queue_bound_evicts_the_busiest_senders_oldest_and_counts_it():
    mixer = GradientMixer(GossipConfig(queue_vectors=3, **LOOSE), N)
    for samples in (100, 200, 300):
        assert send(mixer, msgs(grad(samples), 1, samples, 8.0), 300) is Arrival.COMPLETE
    assert send(mixer, msgs(grad(7), 2, 150, 8.0), 300) is Arrival.COMPLETE
    assert mixer.drops["full"] == 1 and mixer.pending == 3
    report = mixer.mix(grad(0), 8.0, 300)
    assert sorted((p.sender, p.swarm_samples) for p in report.peers) == [
        (sid(1), 200), (sid(1), 300), (sid(2), 150)]
    # One entry per sender: the stalest loses, which may be the newcomer itself.
    for i, samples in ((1, 400), (2, 500), (3, 600)):
        send(mixer, msgs(grad(i), i, samples, 8.0), 600)
    assert send(mixer, msgs(grad(4), 4, 350, 8.0), 600) is Arrival.FULL
    assert send(mixer, msgs(grad(5), 5, 700, 8.0), 600) is Arrival.COMPLETE
    assert mixer.drops["full"] == 3
    report = mixer.mix(grad(0), 8.0, 600)
    assert report.senders == {sid(2), sid(3), sid(5)}


def test_queue_byte_bound():
    size = len(msgs(grad(1), 1, 0, 8.0)[0]) - HEADER_SIZE - 8  # payload bytes of one vector
    size += CHUNK_OVERHEAD  # and what holding its one chunk costs besides
    mixer = GradientMixer(GossipConfig(queue_bytes=2 * size, **LOOSE), N)
    for i in (1, 2, 3):
        send(mixer, msgs(grad(i), i, 10 * i, 8.0), 30)
    assert mixer.pending == 2 and mixer.pending_bytes == 2 * size
    assert mixer.drops["full"] == 1
    assert mixer.mix(grad(0), 8.0, 30).senders == {sid(2), sid(3)}


def test_every_node_mixes_gradients_from_several_peers():
    """Four nodes push each step's gradient to two peers chosen by link speed; over a few
    steps every node mixes gradients from at least two different peers."""
    names = [f"node{i}" for i in range(4)]
    cfg = GossipConfig(fanout=2, codec="topk", codec_params={"fraction": 0.05}, **LOOSE)
    mixers = {name: GradientMixer(cfg, N) for name in names}
    encoders = {name: gradient_encoder(cfg, N) for name in names}
    tables = {name: PeerTable() for name in names}
    rng = np.random.default_rng(7)
    for name in names:
        for j, other in enumerate(names):
            if other != name:
                tables[name].observe_transfer(other, 1 << 20, 0, 0.01 * (j + 1), 0.0)
    swarm = 0
    for step in range(6):
        for k, name in enumerate(names):
            g = grad(100 * step + k)
            out = list(encoders[name].encode_vector(
                g, sender_id=sid(k), swarm_samples=swarm, weight=8.0, seed=step))
            targets = tables[name].choose([n for n in names if n != name], cfg.fanout, rng,
                                          sum(map(len, out)))
            for target in targets:
                send(mixers[target], out, swarm)
            mixers[name].mix(g, 8.0, swarm)
            swarm += 8
    for name in names:
        assert len(mixers[name].used) >= 2, name


def test_chunks_of_one_vector_must_share_one_tiling():
    """The wire checks each chunk against *some* tiling; two with the same count but
    another chunk size overlap, and the vector would look complete with coordinates twice."""
    mixer = GradientMixer(GossipConfig(**LOOSE), N)
    v = np.ones(N, np.float32)
    a, b = msgs(v, 9, 7, 1.0, chunk=999), msgs(v, 9, 7, 1.0, chunk=600)  # 2 chunks each
    assert mixer.receive(a[0], 0) is Arrival.PENDING
    with pytest.raises(CodecError, match="disagrees"):
        mixer.receive(b[1], 0)
    assert mixer.receive(a[1], 0) is Arrival.COMPLETE


def test_one_sender_has_one_vote_in_the_median_norm():
    """A member that sends many vectors under distinct counts cannot set the median: not
    down (zero vectors: every honest peer refused as absurd) nor up (a huge one let through)."""
    mixer = GradientMixer(GossipConfig(), N)  # norm_window 32, clip 3x, absurd 1000x
    for _ in range(4):
        mixer.mix(grad(0), 8.0, 0)  # own norm ~31.6
    for k in range(40):  # zero vectors, tiny weight, distinct keys
        send(mixer, msgs(np.zeros(N, np.float32), 9, 1000 + k, 1e-6), 0)
    assert mixer.norms.count(0.0) == 1
    assert send(mixer, msgs(grad(1), 1, 5, 8.0), 0) is Arrival.COMPLETE  # honest, accepted
    for k in range(40):  # then ever larger ones, each under the limit of the moment
        limit = 900 * float(np.median(mixer.norms))
        x = grad(2)
        x *= np.float32(limit / np.linalg.norm(x))
        with contextlib.suppress(CodecError):  # (one above the limit is refused: fine)
            send(mixer, msgs(x, 9, 5000 + k, 1e-6), 0)
    assert np.median(mixer.norms) < 100  # the own norms and the honest peer's hold it
    report = mixer.mix(grad(3), 8.0, 0)
    assert all(p.norm * p.scale < 100 for p in report.peers)  # clipped to 3x the median


def test_a_claimed_weight_counts_only_as_far_as_the_senders_observed_speed():
    """A push claiming max_sample_weight (65536 samples) against an own batch of 8 used to
    make up 99.99% of the mix: the receiver stepped along the member's vector."""
    rates = {sid(0).hex(): 10.0, sid(2).hex(): 100.0}  # node 2 is seen 10x as fast
    for sender, cap in ((1, 4 * 8.0), (2, 4 * 8.0 * 10)):
        mixer = GradientMixer(GossipConfig(**LOOSE), N, sid(0).hex())
        mixer.rate_of = rates.get
        send(mixer, msgs(grad(sender), sender, 100, 65536.0), 100)
        report = mixer.mix(grad(0), 8.0, 110)
        assert report.total_weight == 8.0 + cap
        assert report.peers[0].weight == cap


def test_tiny_chunks_are_charged_what_holding_them_costs():
    """A peer's gradient may come in chunks of one element: 3 payload bytes each, ~930 bytes
    held (message, codec, table entry). Only payloads were counted against queue_bytes, so
    256 MiB admitted ~89 million such chunks (~80 GB); with outer steps an incomplete vector
    never went stale. Each held chunk now counts CHUNK_OVERHEAD besides."""
    mixer = GradientMixer(GossipConfig(queue_bytes=100 * CHUNK_OVERHEAD, **LOOSE), N)
    for i, m in enumerate(msgs(grad(1), 1, 5, 8.0, chunk=1)):
        mixer.receive(m, 10)
        assert mixer.pending_bytes <= 100 * CHUNK_OVERHEAD
        if i == 300:
            break
    assert mixer.drops["full"] >= 1  # the vector can never fit: it is dropped, again and again


def test_a_chunk_longer_than_any_node_sends_is_refused_before_decoding():
    """The norm of a dense chunk is taken over a decoded copy the mixer keeps: a peer choosing
    a 64M-element sign chunk (8 MiB on the wire) made it allocate and keep 244 MiB."""
    n = MAX_PEER_CHUNK + 8
    (chunk,) = (bytes(m) for m in encode_vector(
        make_codec("sign"), np.ones(n, np.float32), sender_id=sid(1), swarm_samples=1,
        weight=1.0, seed=1, chunk_elems=n))
    mixer = GradientMixer(GossipConfig(codec="sign", **LOOSE), n)
    with pytest.raises(CodecError, match="at most"):
        mixer.receive(chunk, 10)
    assert mixer._scratch.nbytes == 0 and mixer.drops["malformed"] == 1


def test_a_vector_that_can_never_fit_is_refused_before_it_evicts_anything():
    """With its chunks' overhead a vector may be larger than the whole queue: it evicted the
    complete vectors held, then itself, chunk after chunk."""
    held = msgs(grad(1), 1, 5, 8.0)
    mixer = GradientMixer(GossipConfig(queue_bytes=len(held[0]) + 2 * CHUNK_OVERHEAD, **LOOSE),
                          N)
    assert send(mixer, held, 10) is Arrival.COMPLETE
    tiny = msgs(grad(2), 2, 6, 8.0, chunk=8)  # 125 chunks: never fits
    assert mixer.receive(tiny[0], 10) is Arrival.FULL
    assert mixer.pending == 1 and mixer.drops["full"] == 1
    assert mixer.mix(grad(0), 8.0, 10).senders == {sid(1)}
