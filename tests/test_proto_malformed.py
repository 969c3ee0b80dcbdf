"""Every malformed or illegal message leaves every node's state unchanged and produces a
RemoteError action (issue 4): truncated, wrong version, wrong types, huge lengths, NaN
tensors, a tensor of the wrong length, forged claims."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash

from p2ptrain.codecs import CodecError, encode_vector, make_codec, parse_message
from p2ptrain.proto import wire
from p2ptrain.proto.errors import LocalProtocolError
from p2ptrain.proto.events import Deliver, Progress, Received, RemoteError, Tick
from p2ptrain.proto.messages import (
    PROTOCOL_VERSION,
    Body,
    Claim,
    Envelope,
    Header,
    Heartbeat,
    Notify,
    Ping,
    SyncRequest,
    register,
)
from p2ptrain.proto.records import LeaderView, Update
from tests.cluster.harness import Cluster, Network

VECTOR = 64  # elements of the test model


@register(251)
@dataclass(frozen=True, slots=True)
class FakeGradient(Body):
    """Stands in for a gossip layer's gradient chunk: a codec wire message, checked whole."""

    length: int
    chunk: bytes

    def check(self) -> None:
        try:
            msg = parse_message(self.chunk)
            if msg.vector_length != VECTOR or self.length != VECTOR:
                raise ValueError(f"gradient of {msg.vector_length} elements, model has {VECTOR}")
            msg.decode()  # refuses non-finite values
        except CodecError as exc:
            raise ValueError(exc.reason) from None


def _chunk(x: np.ndarray) -> bytes:
    return bytes(next(encode_vector(make_codec("none"), x, sender_id=b"\x01" * 16,
                                    swarm_samples=5, weight=8.0, seed=3)))


def _nan_chunk() -> bytes:
    msg = bytearray(_chunk(np.zeros(VECTOR, np.float32)))
    msg[96:100] = struct.pack("<f", float("nan"))
    struct.pack_into("<Q", msg, len(msg) - 8, xxhash.xxh3_64_intdigest(bytes(msg[:-8])))
    return bytes(msg)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    c = Cluster(5, seed=21, network=Network(loss=0.05), outbound_only=(4,))
    c.run_until(6.0)
    assert len(c.leaders()) == 1
    return c


def _header(c: Cluster, who: int, view=None, updates=(), **changes) -> Header:
    node = c.nodes[who]
    ctl = c.control(who)
    fields = dict(version=PROTOCOL_VERSION, sender=node.info.node_id,
                  incarnation=ctl.incarnation, addr=node.info.addr,
                  fingerprint=node.info.fingerprint, samples=1, beat=1, live=1, view=view,
                  updates=tuple(updates))
    fields.update(changes)
    return Header(**fields)


def _frame_doc(data: bytes):
    n = struct.unpack_from("<I", data, 8)[0]
    return json.loads(data[16 : 16 + n])


def _reframe(type_id: int, doc, tail: bytes = b"", edit=lambda text: text) -> bytes:
    text = edit(json.dumps(doc).encode())
    return struct.pack("<4sBBHII", b"P2PM", 1, type_id, 0, len(text), len(tail)) + text + tail


def _malformed(c: Cluster, target: int) -> dict[str, bytes]:
    """name -> wire bytes a peer (node 0 or a stranger) might send to `target`."""
    sender = 0 if target != 0 else 1
    ping = wire.encode(Envelope(_header(c, sender), Ping(7, c.nodes[target].info.node_id)))
    doc = _frame_doc(ping)
    stranger = "f" * 32
    leader = c.leaders()[0]
    term = c.control(leader).term
    me = c.nodes[0].info
    entry = ["alive", stranger, 1, stranger,
             [stranger, "h:1", "pi4", 1.0, 0, me.fingerprint, me.fingerprint_fields, False], 0]
    out = {
        "empty": b"",
        "truncated header": ping[:10],
        "truncated body": ping[:-3],
        "trailing garbage": ping + b"\x00\x01",
        "bad magic": b"P2PX" + ping[4:],
        "frame version 9": ping[:4] + b"\x09" + ping[5:],
        "unknown type": ping[:5] + b"\xee" + ping[6:],
        "huge lengths": struct.pack("<4sBBHII", b"P2PM", 1, 1, 0, 2**31, 2**31) + b"[]",
        "protocol version 1": _reframe(1, [[1, *doc[0][1:]], doc[1]]),
        "seq is a string": _reframe(1, [doc[0], ["7", doc[1][1]]]),
        "incarnation negative": _reframe(1, [[*doc[0][:2], -1, *doc[0][3:]], doc[1]]),
        "sender not hex": _reframe(1, [[doc[0][0], "zz" * 16, *doc[0][2:]], doc[1]]),
        "NaN samples": _reframe(1, doc, edit=lambda t: t.replace(b", 1, 1, 1, null",
                                                                    b", NaN, 1, 1, null")),
        "updates not a list": _reframe(1, [[*doc[0][:9], {"a": 1}], doc[1]]),
        "update of unknown kind": _reframe(1, [[*doc[0][:9], [["zombie", stranger, 1,
                                                               stranger, None, 0]]], doc[1]]),
        "NaN tensor": wire.encode(Envelope(_header(c, sender), FakeGradient(VECTOR,
                                                                            _nan_chunk()))),
        "gradient of the wrong length": wire.encode(Envelope(_header(c, sender), FakeGradient(
            VECTOR, _chunk(np.ones(VECTOR + 16, np.float32))))),
        "corrupt tensor chunk": wire.encode(Envelope(_header(c, sender), FakeGradient(
            VECTOR, _chunk(np.ones(VECTOR, np.float32))[:-20]))),
        "forged higher term without membership": wire.encode(Envelope(
            _header(c, sender, view=LeaderView(term + 10**6, stranger, 99, 1e9, 0),
                    sender=stranger), Claim())),
        "gradient from a non-member": wire.encode(Envelope(
            _header(c, sender, sender=stranger), FakeGradient(VECTOR, _chunk(
                np.ones(VECTOR, np.float32))))),
        "claim for someone else": wire.encode(Envelope(_header(
            c, sender, view=LeaderView(term + 5, c.nodes[leader].info.node_id, 0, 1.0, 0)),
            Heartbeat())),
        "claim with a forged priority": wire.encode(Envelope(_header(
            c, sender, view=LeaderView(term + 5, c.nodes[sender].info.node_id, 10**6,
                                       c.nodes[sender].info.capability, 0)), Claim())),
        "claim by an outbound-only member": wire.encode(Envelope(_header(
            c, 4, view=LeaderView(term + 5, c.nodes[4].info.node_id,
                                  c.nodes[4].info.priority, c.nodes[4].info.capability, 0)),
            Claim())),
        "message from itself": wire.encode(Envelope(_header(c, target), Notify())),
        "sync listing an entry twice": _reframe(5, [doc[0], [[entry, entry], {}]]),
    }
    return out


def test_every_malformed_message_is_refused_without_effect(cluster):
    for target in range(len(cluster.nodes)):
        for name, data in _malformed(cluster, target).items():
            if name == "claim by an outbound-only member" and target == 4:
                continue  # that one is "message from itself" for node 4
            ctl = cluster.control(target)
            before = ctl.snapshot()
            actions = ctl.handle(cluster.now, Received("198.51.100.7:7100", data))
            assert len(actions) == 1 and isinstance(actions[0], RemoteError), (name, actions)
            assert actions[0].reason, name
            assert ctl.snapshot() == before, name


def test_the_cluster_carries_on_after_the_garbage(cluster):
    for target in range(len(cluster.nodes)):
        for data in _malformed(cluster, target).values():
            cluster.inject(target, data)
    cluster.run_for(10.0)
    assert len(cluster.leaders()) == 1
    for j in cluster.up():
        assert sum(1 for s, _, _ in cluster.control(j).members().values() if s == "alive") == 4


def test_a_well_formed_gossip_body_is_delivered_after_its_header(cluster):
    ctl = cluster.control(1)
    env = Envelope(_header(cluster, 0), FakeGradient(VECTOR, _chunk(np.ones(VECTOR,
                                                                            np.float32))))
    actions = ctl.handle(cluster.now, Received("x", wire.encode(env)))
    assert actions == [Deliver(env, "x")]
    send = ctl.wrap(cluster.nodes[0].info.node_id, cluster.nodes[0].info.addr, env.body)
    assert send.envelope.header.sender == cluster.nodes[1].info.node_id
    assert wire.decode(wire.encode(send.envelope)) == send.envelope


def test_api_misuse_is_a_local_error_and_changes_nothing(cluster):
    ctl = cluster.control(2)
    before = ctl.snapshot()
    with pytest.raises(LocalProtocolError):
        ctl.handle(cluster.now - 1.0, Tick())
    with pytest.raises(LocalProtocolError):
        ctl.handle(float("nan"), Tick())
    with pytest.raises(LocalProtocolError):
        ctl.handle(cluster.now, "tick")
    with pytest.raises(LocalProtocolError):
        ctl.handle(cluster.now, Received("x", 42))
    with pytest.raises(LocalProtocolError):
        ctl.handle(cluster.now, Progress(-1, 0, 0))
    with pytest.raises(LocalProtocolError):
        ctl.handle(cluster.now, Progress(0, 0, 0))  # the step went backwards
    assert ctl.snapshot() == before


def test_updates_from_a_member_are_applied_but_a_sync_needs_its_sender_listed(cluster):
    """Not malformed: a sync from a member is merged (the contrast to the refusals)."""
    ctl = cluster.control(3)
    newcomer = cluster.nodes[0].info.__class__(
        "e" * 32, "10.9.9.9:7100", "pi4", 1.0, 0, cluster.nodes[0].info.fingerprint,
        dict(cluster.nodes[0].info.fingerprint_fields), False)
    body = SyncRequest((Update("alive", newcomer.node_id, 1, newcomer.node_id, newcomer),), {})
    ctl.handle(cluster.now, Received("x", wire.encode(Envelope(_header(cluster, 0), body))))
    assert ctl.member_state("e" * 32) == "alive"
