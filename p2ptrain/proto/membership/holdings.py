"""Which checkpoint each member holds (issue 14: any holder serves, joiners fetch from many).

A member says what it holds in the header of every message it sends (`Header.holds`: the
newest checkpoint it holds whole, or the one it is fetching); member-list exchanges relay
what the sender heard (`holdings`), so a joiner learns every holder in its first exchange.
What a member says itself wins over what others relay about it; a relayed entry replaces an
older relayed one only with a newer (term, step). Only members in the table are kept, so the
maps are bounded by the membership. A wrong entry costs a fetcher one question: the holder
it names answers "not held here" and is dropped from that fetch. Pure; no clock needed.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from p2ptrain.proto.errors import LocalProtocolError
from p2ptrain.proto.records import Holding


class Holdings:
    """This node's view of who holds which checkpoint."""

    def __init__(self, me: str):
        self.me = me
        self.mine: Holding | None = None  # what this node holds (the driver says: Holds)
        self.said: dict[str, Holding] = {}  # member -> what it said itself
        self.relayed: dict[str, Holding] = {}  # member -> what another member relayed
        self.listings = 0  # member lists merged so far (0: what others hold is not known yet)

    def own(self, holding: Holding | None) -> None:
        """The driver says what this node holds now (a local value: checked all the same)."""
        if holding is not None:
            try:
                holding.check()
            except ValueError as exc:
                raise LocalProtocolError(f"Holds: {exc}") from None
        self.mine = holding

    def heard(self, sender: str, holding: Holding | None, members: Container[str]) -> None:
        """A message's header: what its sender holds now (None: nothing)."""
        if sender == self.me or sender not in members:
            return
        if holding is None:
            self.said.pop(sender, None)
        else:
            self.said[sender] = holding

    def merge(self, listing: dict[str, Holding], members: Container[str]) -> None:
        """A member list's holdings, relayed by its sender."""
        self.listings += 1
        for node_id, holding in listing.items():
            if node_id == self.me or node_id not in members or node_id in self.said:
                continue
            old = self.relayed.get(node_id)
            if old is None or (holding.term, holding.step) > (old.term, old.step):
                self.relayed[node_id] = holding

    def of(self, node_id: str) -> Holding | None:
        if node_id == self.me:
            return self.mine
        return self.said.get(node_id) or self.relayed.get(node_id)

    def listing(self, members: Container[str]) -> dict[str, Holding]:
        """What a member-list exchange carries: what is known of `members` (members that left
        the table are dropped here), and this node's own."""
        for table in (self.said, self.relayed):
            for gone in [n for n in table if n not in members]:
                del table[gone]
        out = {**self.relayed, **self.said}
        if self.mine is not None:
            out[self.me] = self.mine
        return out

    def holders(self, digest: str, among: Iterable[str]) -> list[str]:
        """The members of `among` that hold (some of) the checkpoint with `digest`."""
        return [n for n in among if (h := self.of(n)) is not None and h.digest == digest]
