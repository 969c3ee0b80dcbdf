"""Noticing that this node sits behind NAT or a firewall: it reaches its peers (its requests
succeed) but no peer has reached it (no authenticated inbound request) for a window of three
member-list periods. Then it should run outbound-only (DESIGN.md, Reachability). Pure: time
and counts are passed in.
"""

from __future__ import annotations


class Reachability:
    """Decides once that the node is unreachable from its peers."""

    def __init__(self, window: float):
        self.window = window  # s of being unreached while reaching others
        self.since: float | None = None  # when we first reached a peer, unreached
        self.decided = False

    def unreachable(self, now: float, inbound: int, sent: int) -> bool:
        """True (once) when `window` s passed with requests succeeding (`sent` > 0) and no
        inbound message (`inbound` == 0)."""
        if self.decided or inbound > 0:
            return False
        if sent == 0:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if now - self.since >= self.window:
            self.decided = True
            return True
        return False
