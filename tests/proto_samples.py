"""Sample control-plane messages shared by the tests of p2ptrain.proto."""

from __future__ import annotations

from p2ptrain.proto.messages import (
    PROTOCOL_VERSION,
    Ack,
    Claim,
    Envelope,
    Header,
    Heartbeat,
    Leave,
    Notify,
    Ping,
    PingReq,
    Refuse,
    Resign,
    SyncReply,
    SyncRequest,
    Yield,
)
from p2ptrain.proto.records import Holding, LeaderView, MemberInfo, Update, fingerprint_of
from tests.cluster.harness import FIELDS

A = "a" * 32
B = "b" * 32
C = "c" * 32


def info(node_id: str = A, addr: str = "10.0.0.1:7100", priority: int = 0,
         outbound_only: bool = False, fields: dict | None = None) -> MemberInfo:
    fields = dict(FIELDS if fields is None else fields)
    return MemberInfo(node_id, addr, "pi4", 12.5, priority, fingerprint_of(fields), fields,
                      outbound_only)


HOLDING = Holding(2, 120, 4800, "0123456789abcdef")


def header(sender: str = A, view: LeaderView | None = None, updates=(), incarnation: int = 1,
           fields: dict | None = None, holds: Holding | None = HOLDING) -> Header:
    me = info(sender, fields=fields)
    return Header(PROTOCOL_VERSION, sender, incarnation, me.addr, me.fingerprint, 100, 7, 3,
                  view, tuple(updates), holds)


def sample_bodies():
    listing = (Update("alive", A, 1, A, info(A)), Update("suspect", B, 3, A, info(B, "h:1")))
    return [
        Ping(5, B), Ack(5, B), PingReq(9, C, "10.0.0.3:7100"), Notify(),
        SyncRequest(listing, {A: 10, B: 0}, {B: HOLDING}), SyncReply(listing, {}),
        Refuse("configuration differs: vocab", dict(FIELDS)), Leave(), Claim(), Heartbeat(),
        Resign(4), Yield(4, 5),
    ]


def sample_envelopes():
    view = LeaderView(3, A, 0, 12.5, 17)
    ups = (Update("alive", C, 2, A, info(C, "10.0.0.3:7100")), Update("dead", B, 1, A),
           Update("heard", C, 2, A, beat=33))
    return [Envelope(header(A, view, ups), body) for body in sample_bodies()]
