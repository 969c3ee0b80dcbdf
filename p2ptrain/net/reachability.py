"""Noticing that this node sits behind NAT or a firewall: it reaches its peers (its requests
succeed) but no peer has reached it (no authenticated inbound request) for a window of three
member-list periods. Then it should run outbound-only (DESIGN.md, Reachability). Pure: time
and counts are passed in.

"It reaches them" means requests keep succeeding through the window: a stretch of a third of
the window without one success starts the window again. (Counting one success ever let a
node whose peers were all paused -- every request timing out -- decide it was unreachable
after the first, and switch to outbound-only for the rest of its run.)
"""

from __future__ import annotations


class Reachability:
    """Decides once that the node is unreachable from its peers."""

    def __init__(self, window: float):
        self.window = window  # s of being unreached while reaching others
        self.gap = window / 3  # s without a successful request that start the window again
        self.since: float | None = None  # when this stretch of successes began, unreached
        self.sent = 0  # successful requests counted at the last look
        self.succeeded_at: float | None = None  # when that count last grew
        self.decided = False

    def unreachable(self, now: float, inbound: int, sent: int) -> bool:
        """True (once) when `window` s passed with requests succeeding (`sent`, a running
        count, growing at least every `gap` s) and no inbound message (`inbound` == 0)."""
        if sent > self.sent:
            self.sent, self.succeeded_at = sent, now
        if self.decided or inbound > 0:
            return False
        if self.succeeded_at is None or now - self.succeeded_at > self.gap:
            self.since = None
            return False
        if self.since is None:
            self.since = self.succeeded_at
        if now - self.since >= self.window:
            self.decided = True
            return True
        return False
