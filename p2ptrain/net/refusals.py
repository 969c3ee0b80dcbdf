"""Telling a wrong swarm key from peers that are merely down: a node whose key is wrong gets
HTTP 401 (with no response MAC) from every peer it asks, and would otherwise train alone
forever, warning only that a "response carries no MAC".

`RefusalWatch` is told the outcome of every request the node sends. Once a peer refuses us
it says so in one warning; when, for `window` seconds and at least `MIN_REFUSALS` requests,
every address we asked refused us at least once and no request was accepted, it gives its
verdict: the swarm key is wrong (or every peer named belongs to another swarm). An accepted
request (a response whose MAC verifies) clears everything. An address that only fails
otherwise (refused connection, timeout) holds the verdict back: it may be a member that is
still starting. Pure bookkeeping: the clock is passed in, and it never does I/O.

Only some refusals are evidence against our key: those of an address the user named (a
seed: `named`) or of one that once answered us with a valid MAC (it held the swarm's key
then: it was a member). Anyone on the LAN can copy our mDNS advertisement -- the swarm id
is public -- and answer 401 without any key; a lone node, waiting for its first peer, must
not take that for a verdict on its key and exit.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MIN_REFUSALS = 3  # requests refused before a verdict, however short the window
MAX_VOUCHED = 4096  # addresses remembered as having answered us (oldest forgotten first)


_OLDER = re.compile(r"incarnation (\d+) is older than (\d+)")


def _cause(reason: str) -> str:
    """What a refusal most likely means, and what to do."""
    older = _OLDER.search(reason)
    if older is None:  # (the peer's reason may ask already: not asked twice)
        return "" if "swarm key" in reason else "is the swarm key right?"
    return (f"the peers remember a later start of this node (incarnation {older.group(2)}, "
            f"this one is {older.group(1)}): was its state directory restored from a backup? "
            f"Stop it, write {int(older.group(2)) + 1} into the state directory's "
            f"`incarnation` file, and start it again")


class RefusalWatch:
    """Counts 401 refusals since the last accepted request; `on_verdict(message)` once."""

    def __init__(self, window: float, now: Callable[[], float],
                 on_verdict: Callable[[str], None], warn: Callable[[str], None],
                 named: Callable[[str], bool] | None = None):
        self.window, self.now = window, now  # window 0: never give a verdict
        self.on_verdict, self.warn = on_verdict, warn
        self.named = named  # None: every address counts; else seeds, and `vouched` ones
        self.vouched: dict[str, None] = {}  # addresses that answered us with a valid MAC
        self.strangers_warned = False
        self.since: float | None = None  # first refusal since the last accepted request
        self.refusals = 0
        self.refused_by: dict[str, bool] = {}  # address asked since -> it refused us
        self.reason = ""  # the last refusal's reason, as the peer put it
        self.warned = self.given = False

    def accepted(self, addr: str) -> None:
        """A request to `addr` got an authenticated answer: our key is the swarm's."""
        self.vouched.pop(addr, None)
        self.vouched[addr] = None
        if len(self.vouched) > MAX_VOUCHED:
            del self.vouched[next(iter(self.vouched))]
        self.since, self.refusals = None, 0
        self.refused_by.clear()

    def refused(self, addr: str, reason: str) -> None:
        """`addr` answered 401: it did not accept our MAC (or saw a replay)."""
        if not self._counts(addr):
            if not self.strangers_warned:
                self.strangers_warned = True
                self.warn(f"{addr} refuses this node's requests (HTTP 401: {reason}); it is no "
                          f"seed and never answered us, so it proves nothing about our key (a "
                          f"host advertising this swarm without its key?)")
            return
        if self.since is None:
            self.since = self.now()
        self.refusals += 1
        self.refused_by[addr] = True
        self.reason = reason
        if not self.warned:
            self.warned = True
            cause = _cause(reason)
            self.warn(f"{addr} refuses this node's requests (HTTP 401: {reason})"
                      + (f": {cause}" if cause else ""))
        self._judge()

    def failed(self, addr: str) -> None:
        """A request to `addr` failed otherwise (no answer, another status)."""
        if self.since is not None and self._counts(addr):
            self.refused_by.setdefault(addr, False)

    def _counts(self, addr: str) -> bool:
        return self.named is None or self.named(addr) or addr in self.vouched

    def _judge(self) -> None:
        if (self.given or self.window <= 0 or self.since is None
                or self.refusals < MIN_REFUSALS or not all(self.refused_by.values())):
            return
        waited = self.now() - self.since
        if waited < self.window:
            return
        self.given = True
        who = ", ".join(sorted(self.refused_by))
        if _OLDER.search(self.reason):
            self.on_verdict(f"every peer refuses this node (HTTP 401 from {who} for "
                            f"{waited:.0f}s): {_cause(self.reason)}; the last refusal: "
                            f"{self.reason}")
            return
        self.on_verdict(f"every peer refuses this node (HTTP 401 from {who} for {waited:.0f}s, "
                        f"{self.refusals} requests, none accepted): the swarm key is wrong -- "
                        f"check --token, --token-file or the config's key_file (or the peers "
                        f"named belong to another swarm); the last refusal: {self.reason}")
