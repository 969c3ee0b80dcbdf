"""Tracking (gossip.track_peers, proto/gossip/tracking.py): pushes keep every receiver's copy
bit-identical to its sender's public copy, mixing draws replicas together, and a missed push,
a full receiver, a silent target or a hostile chunk each end in a defined state."""

from __future__ import annotations

import dataclasses
import struct
from collections import Counter

import numpy as np
import pytest

from p2ptrain.codecs import CodecError, make_codec
from p2ptrain.codecs.wire import HEADER_SIZE, message_size
from p2ptrain.proto import GossipConfig, TrackAck, TrackPush
from p2ptrain.proto.gossip import tracking
from p2ptrain.proto.gossip.messages import TRACK_OK, TRACK_REFUSED, TRACK_RESET
from p2ptrain.proto.gossip.tracking import COOLDOWN, RESTART_SECONDS, STALE_SECONDS, STEADY, Tracker

N = 5000
CHUNK = 1024  # several chunks, a short last one
IDS = [f"{i:032x}" for i in range(1, 4)]


def _tracker(k: int = 2, warmup: int = 4, gamma: float = 0.5, seed: int = 0) -> Tracker:
    guard = GossipConfig(max_distance=10.0).distance_guard()
    return Tracker(N, k, gamma, warmup, guard, np.random.default_rng(seed), CHUNK, Counter())


def _give_up(peer: str, size: int) -> float:
    return 5.0


class Swarm:
    """Trackers wired by hand: every push delivered, every ack returned, in order."""

    def __init__(self, count: int, seed: int = 1, **kw):
        rng = np.random.default_rng(seed)
        self.ids = IDS[:count]
        self.nodes = {i: _tracker(seed=n, **kw) for n, i in enumerate(self.ids)}
        base = rng.standard_normal(N).astype(np.float32)  # replicas of one start, drifted
        self.params = {i: base + np.float32(0.01) * rng.standard_normal(N).astype(np.float32)
                       for i in self.ids}
        self.unseen: dict[str, set[str]] = {}  # member -> members it does not see as fast

    def step(self, now: float, deliver: bool = True) -> list:
        pending = []
        for me, node in self.nodes.items():
            out: list = []
            fast = [(p, p) for p in self.ids if p != me and p not in self.unseen.get(me, ())]
            node.after_step(now, self.params[me], fast, bytes.fromhex(me), 0, _give_up, out)
            pending += [(me, o) for o in out]
        while deliver and pending:
            sender, o = pending.pop(0)
            if type(o.body) is TrackPush:
                receiver = self.nodes[o.to]
                parsed = receiver.parse(sender, o.body)
                status = receiver.on_push(now, sender, o.body, parsed, True)
                pending.append((o.to, type("O", (), {"to": sender, "body": TrackAck(
                    o.body.epoch, o.body.seq, o.body.part, status)})))
            else:
                out = []
                self.nodes[o.to].on_ack(now, sender, o.body, _give_up, out)
                pending += [(o.to, x) for x in out]
        return pending

    def spread(self) -> float:
        mean = np.mean([p for p in self.params.values()], axis=0)
        return float(np.sqrt(np.mean([(p - mean) ** 2 for p in self.params.values()])))


@pytest.mark.parametrize("part_bytes", [48 << 20, 3000])  # one part a push, or three
def test_copies_equal_their_senders_public_copy_and_replicas_meet(monkeypatch, part_bytes):
    monkeypatch.setattr(tracking, "PART_BYTES", part_bytes)
    swarm = Swarm(3)
    int8, sign = swarm.nodes[IDS[0]].layouts  # (chunks a part, parts)
    assert int8[1] == (1 if part_bytes > N * 8 else 3) and sign[1] == 1
    start = swarm.spread()
    swarm.step(0.0)  # every member seen fast: taken on after STEADY seconds
    for t in range(60):
        swarm.step(STEADY + t)
    for me, node in swarm.nodes.items():
        assert set(node.targets) == set(swarm.ids) - {me}
        for other, copy in node.copies.items():
            assert np.array_equal(copy.vec, swarm.nodes[other].own), "copies drifted"
    assert node.stats["track_mixes"] > 0
    assert swarm.spread() < 0.25 * start  # no training: tracking alone drew them together
    # the public copy follows its replica: sign pushes halve the gap about every push
    for me, node in swarm.nodes.items():
        gap = np.sqrt(np.mean((swarm.params[me] - node.own) ** 2))
        assert gap < start


def test_a_push_carries_one_bit_a_coordinate_and_a_scale_per_bucket():
    swarm = Swarm(2)
    swarm.step(0.0)
    swarm.step(STEADY)  # the epoch's first push (int8), delivered and acked
    first = swarm.nodes[IDS[0]].stats["track_bytes_sent"]
    out = swarm.step(STEADY + 1, deliver=False)  # then signs
    (sender, o), = [(s, o) for s, o in out if s == IDS[0]]
    sign = make_codec("sign", bucket=1024)
    bounds = [(i * CHUNK, min(CHUNK, N - i * CHUNK)) for i in range(-(-N // CHUNK))]
    assert o.body.seq == 2
    assert sum(len(c) for c in o.body.chunks) == sum(message_size(sign, n) for _, n in bounds)
    assert sign.encoded_size(1 << 20) * 31 < 4 << 20  # 31x fewer bytes than float32
    assert first == sum(message_size(make_codec("int8"), n) for _, n in bounds)


def test_no_push_until_every_target_acknowledged_the_last():
    swarm = Swarm(2)
    swarm.step(0.0)
    assert swarm.step(STEADY, deliver=False)  # a push, not delivered
    assert swarm.step(STEADY + 1, deliver=False) == []  # waits for its ack
    assert swarm.nodes[IDS[0]].stats["track_push_waited"] == 1


def test_a_missed_push_resets_the_copy_and_a_new_epoch_restarts_it():
    swarm = Swarm(2)
    swarm.step(0.0)
    swarm.step(STEADY)
    a, b = swarm.nodes[IDS[0]], swarm.nodes[IDS[1]]
    assert IDS[0] in b.copies
    out: list = []
    a.after_step(STEADY + 1, swarm.params[IDS[0]], [(IDS[1], "x")], bytes.fromhex(IDS[0]), 0,
                 _give_up, out)
    lost = out[0].body
    skipped = dataclasses.replace(lost, seq=lost.seq + 1)  # as if `lost` never arrived
    parsed = b.parse(IDS[0], skipped)
    assert b.on_push(STEADY + 1, IDS[0], skipped, parsed, True) == TRACK_RESET
    assert IDS[0] not in b.copies
    acked: list = []
    a.on_ack(STEADY + 1, IDS[1], TrackAck(lost.epoch, lost.seq, 0, TRACK_RESET), _give_up, acked)
    assert IDS[1] not in a.targets and a.cool[IDS[1]] == STEADY + 1 + COOLDOWN
    # a fresh epoch (seq 1) is followed again from zero
    restart = TrackPush(lost.epoch + 1, 1, tuple(_chunks_from(IDS[0])), 0, 1)
    assert b.on_push(STEADY + 2, IDS[0], restart, b.parse(IDS[0], restart), True) == TRACK_OK
    assert b.copies[IDS[0]].seq == 1


def test_a_full_receiver_refuses_and_a_joiner_refuses():
    swarm = Swarm(3, k=1)
    swarm.step(0.0)
    swarm.step(STEADY)
    # each pushes to one other; one node is the target of two and has room for one copy
    refused = sum(n.stats["track_refused"] for n in swarm.nodes.values())  # acks received
    held = [len(n.copies) for n in swarm.nodes.values()]
    assert max(held) <= 1 and refused >= 1
    b = swarm.nodes[IDS[1]]
    push = TrackPush(7, 1, tuple(_chunks_from(IDS[2])), 0, 1)
    assert b.on_push(0.0, IDS[2], push, b.parse(IDS[2], push), False) == TRACK_REFUSED


def _chunks_from(sender: str) -> list[bytes]:
    t = _tracker()
    out: list = []
    t.after_step(0.0, np.ones(N, np.float32), [(IDS[0], "x")], bytes.fromhex(sender), 0,
                 _give_up, out)
    t.after_step(STEADY, np.ones(N, np.float32), [(IDS[0], "x")], bytes.fromhex(sender), 0,
                 _give_up, out)
    return list(out[0].body.chunks)


def test_a_silent_target_is_dropped_at_its_give_up_time():
    swarm = Swarm(2)
    swarm.step(0.0)
    swarm.step(STEADY, deliver=False)
    a = swarm.nodes[IDS[0]]
    assert a.next_deadline() == STEADY + 5.0
    a.tick(STEADY + 5.0)
    assert not a.targets and a.stats["track_timeout"] == 1 and a.next_deadline() is None


def test_hostile_pushes_are_refused_and_change_nothing():
    b = _tracker()
    good = TrackPush(3, 1, tuple(_chunks_from(IDS[0])), 0, 1)
    with pytest.raises(CodecError):
        b.parse(IDS[1], good)  # chunks name another sender
    with pytest.raises(CodecError):
        b.parse(IDS[0], dataclasses.replace(good, chunks=good.chunks[:-1]))
    with pytest.raises(CodecError):
        b.parse(IDS[0], dataclasses.replace(good, parts=2))
    swapped = (good.chunks[1], good.chunks[0], *good.chunks[2:])
    with pytest.raises(CodecError):
        b.parse(IDS[0], dataclasses.replace(good, chunks=swapped))
    assert not b.copies
    # a NaN scale: parsed (the header is fine) but refused when decoded; no copy kept
    bad = bytearray(good.chunks[0])
    bad[HEADER_SIZE: HEADER_SIZE + 4] = np.float32(np.nan).tobytes()
    import xxhash

    from p2ptrain.codecs.wire import TRAILER_SIZE  # the checksum covers the payload
    bad[-TRAILER_SIZE:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(bad[:-TRAILER_SIZE])))
    hostile = dataclasses.replace(good, chunks=(bytes(bad), *good.chunks[1:]))
    try:
        parsed = b.parse(IDS[0], hostile)
    except CodecError:
        return  # refused at the frame: fine too
    with pytest.raises(CodecError):
        b.on_push(0.0, IDS[0], hostile, parsed, True)
    assert IDS[0] not in b.copies


def test_settings_are_checked():
    with pytest.raises(ValueError, match="track_gamma"):
        GossipConfig(track_peers=2, track_gamma=1.5)
    with pytest.raises(ValueError, match="outer steps"):
        GossipConfig(track_peers=2, outer_every=10, fanout=1)
    assert GossipConfig().track_peers == 0  # off by default



def test_a_node_that_does_not_track_refuses_a_push_without_calling_it_an_offence():
    from tests.test_gossip_longex import trainer

    t = trainer("b" * 32)  # gossip.track_peers = 0
    n = t.n
    sender = _tracker()
    sender.n, sender.bounds = n, [(0, n)]
    sender.layouts = ((1, 1), (1, 1))
    out: list = []
    x = np.ones(n, np.float32)
    sender.after_step(0.0, x, [("b" * 32, "x")], bytes.fromhex("a" * 32), 0, _give_up, out)
    sender.after_step(STEADY, x, [("b" * 32, "x")], bytes.fromhex("a" * 32), 0, _give_up, out)
    push = out[0].body
    assert t.parse("a" * 32, push) is None  # no CodecError: not an offence
    replies: list = []
    t.on_body(0.0, "a" * 32, "10.0.0.1:7100", push, None, busy=False, outbound_sender=False,
              out=replies)
    assert [r.body.status for r in replies] == [TRACK_REFUSED]


def test_a_member_becoming_fast_while_a_push_awaits_its_ack_waits_for_a_new_epoch():
    a = _tracker()
    me, params = bytes.fromhex(IDS[0]), np.ones(N, np.float32)
    a.after_step(0.0, params, [(IDS[1], "b")], me, 0, _give_up, [])
    out: list = []
    a.after_step(STEADY, params, [(IDS[1], "b")], me, 0, _give_up, out)  # epoch 1, B
    epoch = a.epoch
    both = [(IDS[1], "b"), (IDS[2], "c")]
    a.after_step(STEADY + 1, params, both, me, 0, _give_up, [])  # C seen fast from now
    later = STEADY + 1 + max(STEADY, RESTART_SECONDS)
    a.after_step(later, params, both, me, 0, _give_up, [])  # B's ack still awaited
    assert set(a.targets) == {IDS[1]} and a.epoch == epoch  # C not taken on mid-epoch
    a.on_ack(later, IDS[1], TrackAck(epoch, a.seq, 0, TRACK_OK), _give_up, [])
    out = []
    a.after_step(later + 0.1, params, both, me, 0, _give_up, out)
    assert set(a.targets) == {IDS[1], IDS[2]} and a.epoch != epoch and a.seq == 1
    assert {o.to for o in out} == {IDS[1], IDS[2]}  # both get the new epoch's first push


def test_a_copy_whose_sender_stopped_pushing_is_not_mixed():
    swarm = Swarm(2)
    swarm.step(0.0)
    for t in range(10):
        swarm.step(STEADY + t * 0.1)
    b = swarm.nodes[IDS[1]]
    now = STEADY + 0.9
    assert b.stats["track_mixes"] > 0
    mixes, before = b.stats["track_mixes"], swarm.params[IDS[1]].copy()
    b.mix(now + STALE_SECONDS + 0.01, swarm.params[IDS[1]])  # A silent since `now`
    assert b.stats["track_mixes"] == mixes and np.array_equal(swarm.params[IDS[1]], before)


def test_every_part_of_a_100m_push_fits_the_wire():
    from p2ptrain.proto import wire

    t = Tracker(100_358_400, 2, 0.5, 4, GossipConfig().distance_guard(),
                np.random.default_rng(0), 1 << 20, Counter())  # allocates nothing yet
    assert t.layout(1)[1] > 1  # the int8 first push is ~100 MB
    assert t.layout(2) == t.layout(9) and t.layout(2)[1] == 1  # a sign push (12.9 MB): one
    for seq, codec in ((1, t.first_codec), (2, t.codec)):
        per, parts = t.layout(seq)
        for part in range(parts):
            sizes = [message_size(codec, n) for _, n in t.bounds[part * per:(part + 1) * per]]
            assert sum(sizes) <= wire.MAX_BLOB and len(sizes) <= 1024


def test_a_node_refuses_a_malformed_push_with_an_ack_at_once():
    from p2ptrain.proto.events import RemoteError, Send
    from p2ptrain.proto.node import NodeConfig
    from tests.cluster.harness import Network
    from tests.cluster.training import TrainingCluster
    from tests.test_node import envelope_from, learner

    gossip = GossipConfig(average_every=2, track_peers=2)
    config = NodeConfig(gossip=gossip, min_peers=2, join_timeout=5.0)
    c = TrainingCluster(3, 3, lambda i, node_id: learner(node_id), node_config=config,
                        step_seconds=0.5, network=Network(bandwidth=2e5))
    c.run_until(6.0)
    node = c.training_node(0)
    assert node.phase == "training"
    forged = TrackPush(5, 1, (b"not a chunk",), 0, node.trainer.tracker.layout(1)[1])
    actions = c.inject(0, envelope_from(c, 1, 0, forged), c.nodes[1].info.addr)
    assert [type(a) for a in actions] == [RemoteError, Send]
    ack = actions[1].envelope.body
    assert actions[1].reply and type(ack) is TrackAck and ack.status == TRACK_REFUSED
    assert (ack.epoch, ack.seq, ack.part) == (5, 1, 0)


def test_a_push_waits_for_its_ack_a_bounded_time():
    t = _tracker()
    out: list = []
    fast = [(IDS[1], "b")]
    t.after_step(0.0, np.ones(N, np.float32), fast, bytes(16), 0, lambda p, s: 1e6, out, 0.5)
    t.after_step(STEADY, np.ones(N, np.float32), fast, bytes(16), 0, lambda p, s: 1e6, out, 0.5)
    assert t.next_deadline() == STEADY + max(tracking.GIVE_UP_MIN, tracking.GIVE_UP_STEPS * 0.5)


def test_a_node_that_stopped_pushing_stops_mixing_and_its_replica_stays_put():
    """Its h_i frozen, each mix's h_j - h_i would add its own steps since again: a member
    it no longer takes as a target (rates seen differently from each side) but that still
    pushes to it must not run its replica away (found by review: RMS gap 0.005 -> 7)."""
    swarm = Swarm(2)
    a, b = IDS[:2]
    g = np.float32(1e-3) * np.random.default_rng(5).standard_normal(N).astype(np.float32)
    t = 0.0
    for _ in range(40):  # both push and mix, training alike
        for p in swarm.params.values():
            p += g
        swarm.step(t)
        t += 0.25
    assert swarm.nodes[a].stats["track_mixes"] > 0
    warm_gap = float(np.sqrt(np.mean((swarm.params[a] - swarm.params[b]) ** 2)))
    swarm.unseen[a] = {b}  # a no longer sees b as fast; b still pushes to a
    for _ in range(200):
        for p in swarm.params.values():
            p += g
        swarm.step(t)
        t += 0.25
    node = swarm.nodes[a]
    assert not node.targets and b in node.copies and t - node.copies[b].heard <= 0.25
    assert node.stats["track_own_stale"] > 0
    gap = float(np.sqrt(np.mean((swarm.params[a] - swarm.params[b]) ** 2)))
    assert gap < 3 * warm_gap + 1e-3, (warm_gap, gap)


def test_a_push_delivered_twice_is_not_applied_twice():
    """After a push's last part the copy waits for the next push's part 0; the same push's
    part 0 again matched "the next part of this push" and was added a second time, leaving the
    copy off its sender's public copy until the next epoch, silently. Now a done push again is
    a reset (or, for an epoch's first push, a restart that rebuilds the copy)."""
    swarm = Swarm(2)
    swarm.step(0.0)
    for t in range(5):
        swarm.step(STEADY + t)
    a, b = swarm.nodes[IDS[0]], swarm.nodes[IDS[1]]
    assert np.array_equal(b.copies[IDS[0]].vec, a.own)
    out: list = []
    a.after_step(STEADY + 6, swarm.params[IDS[0]], [(IDS[1], "x")], bytes.fromhex(IDS[0]), 0,
                 _give_up, out)
    push = out[0].body
    assert push.seq > 1 and push.parts == 1
    assert b.on_push(STEADY + 6, IDS[0], push, b.parse(IDS[0], push), True) == TRACK_OK
    assert np.array_equal(b.copies[IDS[0]].vec, a.own)
    assert b.on_push(STEADY + 6, IDS[0], push, b.parse(IDS[0], push), True) == TRACK_RESET
    assert IDS[0] not in b.copies  # gone, not wrong: the sender starts a new epoch
    first = TrackPush(push.epoch + 1, 1, tuple(_chunks_from(IDS[0])), 0, 1)
    assert b.on_push(STEADY + 7, IDS[0], first, b.parse(IDS[0], first), True) == TRACK_OK
    once = b.copies[IDS[0]].vec.copy()
    # an epoch's first push again: the copy is rebuilt from zero, the same
    assert b.on_push(STEADY + 7, IDS[0], first, b.parse(IDS[0], first), True) == TRACK_OK
    assert np.array_equal(b.copies[IDS[0]].vec, once)
