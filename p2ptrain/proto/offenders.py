"""Members whose values this node keeps refusing (issue 13: one member holding the swarm key
must not be able to wreck the run). Every refusal of a member's value -- a malformed or
illegal message, a gradient or averaging snapshot the guards refuse, a checkpoint a joiner
will not adopt -- is counted against its sender; `limit` refusals within `window` seconds
make it an offender, ignored for `cooloff` seconds: its messages are dropped unread, it is
never chosen as a push target, averaging partner or checkpoint source. It is named in the
node's status and announced once (`Offender`). Honest members that drift apart are not caught
by one refusal: it takes refusals spread over seconds. Refusals less than `SPACING` apart count
as one towards `limit` (all count in the totals): one refused vector of a big model is many
chunk messages, and one honest cause (a setting that differs, a spike) refused in a burst must
not make an offender by itself; a member sending garbage still becomes one within
(limit - 1) x SPACING seconds. Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_TRACKED = 1024  # senders whose recent refusals are remembered, at most
SPACING = 1.0  # s: refusals closer than this to the last one counted count as that one


@dataclass
class Record:
    refusals: deque[float] = field(default_factory=deque)  # times of recent refusals
    total: int = 0  # refusals ever
    ignored_until: float = 0.0
    reason: str = ""  # the last refusal's reason


class Offenders:
    """The refusal counts and cool-offs of one node."""

    def __init__(self, limit: int, window: float, cooloff: float):
        self.limit, self.window, self.cooloff = limit, window, cooloff
        self.records: dict[str, Record] = {}

    def refused(self, now: float, sender: str, reason: str) -> bool:
        """Count one refusal of `sender`'s value; True when this makes it an offender."""
        record = self.records.get(sender)
        if record is None:
            if len(self.records) >= MAX_TRACKED:  # forget the quietest
                del self.records[min(self.records, key=lambda s: self.records[s].total)]
            record = self.records[sender] = Record()
        record.total += 1
        record.reason = reason
        if record.refusals and now - record.refusals[-1] < SPACING:
            return False  # the same burst
        record.refusals.append(now)
        while record.refusals and record.refusals[0] < now - self.window:
            record.refusals.popleft()
        if self.limit and len(record.refusals) >= self.limit and not self.ignored(now, sender):
            record.ignored_until = now + self.cooloff
            record.refusals.clear()
            return True
        return False

    def ignored(self, now: float, sender: str) -> bool:
        record = self.records.get(sender)
        return record is not None and now < record.ignored_until

    def status(self, now: float) -> list[dict]:
        """Members with refusals, worst first, for /v1/status."""
        rows = [{"node_id": s, "refusals": r.total, "last_reason": r.reason,
                 "ignored_for_s": max(0.0, r.ignored_until - now)}
                for s, r in self.records.items()]
        return sorted(rows, key=lambda row: -row["refusals"])[:32]
