"""Holdings (issue 14): what members say they hold, relayed in member lists, bounded by the
membership; a hostile value is refused by the decoder, a wrong one costs one question."""

from __future__ import annotations

import pytest

from p2ptrain.proto import wire
from p2ptrain.proto.errors import RemoteProtocolError
from p2ptrain.proto.membership.holdings import Holdings
from p2ptrain.proto.messages import Envelope, SyncRequest
from p2ptrain.proto.records import Holding
from tests.proto_samples import A, B, C, header

OLD, NEW = Holding(1, 10, 100, "00000000000000aa"), Holding(2, 20, 200, "00000000000000bb")


def test_what_a_member_says_wins_over_what_is_relayed_about_it():
    h = Holdings("me" * 16)
    members = {A, B}
    h.merge({A: OLD, B: NEW, C: NEW}, members)  # C is no member: not kept
    assert h.of(A) == OLD and h.of(C) is None
    h.merge({A: Holding(1, 5, 50, "00000000000000cc")}, members)  # older: ignored
    assert h.of(A) == OLD
    h.heard(A, NEW, members)
    assert h.of(A) == NEW
    h.merge({A: OLD}, members)
    assert h.of(A) == NEW  # its own word stands
    h.heard(A, None, members)  # it holds nothing any more
    assert h.of(A) == OLD  # ... only the relay is left, until it is dropped with the member
    assert h.holders(NEW.digest, [A, B, C]) == [B]
    h.mine = OLD
    assert h.listing({B}) == {B: NEW, "me" * 16: OLD}  # A left the table: dropped
    assert h.of(A) is None


@pytest.mark.parametrize("bad", [
    Holding(1, 10, 100, "XYZ"), Holding(1, 10, 100, "0" * 15), Holding(-1, 1, 1, "0" * 16),
    Holding(2**60, 1, 1, "0" * 16), Holding(1, 1, -5, "0" * 16),
])
def test_malformed_holdings_are_refused_by_the_decoder(bad):
    for message in (Envelope(header(holds=bad), SyncRequest((), {}, {})),
                    Envelope(header(holds=None), SyncRequest((), {}, {B: bad}))):
        with pytest.raises(RemoteProtocolError):
            wire.decode(wire.encode(message))


def test_a_holding_travels_in_every_header_and_in_member_lists():
    message = Envelope(header(holds=NEW), SyncRequest((), {}, {B: OLD}))
    back = wire.decode(wire.encode(message))
    assert back.header.holds == NEW and back.body.holdings == {B: OLD}
