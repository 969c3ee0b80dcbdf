"""What a node's gossip trainer keeps of one averaging exchange it opened (`Exchange`), and
how much of other exchanges' results it may hold while a step is outstanding
(`held_capacity`). Pure data: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

HELD_SHARE = 8  # averaging half steps held while busy: at most 1/HELD_SHARE of the model...
HELD_FLOOR = 1 << 24  # ...or this many coordinates (64 MiB), if more


def held_capacity(n: int) -> int:
    """Coordinates of averaging half steps a node of n parameters holds while a step is
    outstanding (one part more when its own exchange's reply lands on a full store)."""
    return max(n // HELD_SHARE, HELD_FLOOR)


@dataclass(slots=True)
class Exchange:
    """The averaging exchange this node opened and still waits on."""

    peer: str  # node id of the responder
    seed: int
    started: float  # when the request of the current part was made
    deadline: float  # aborted if no reply by then
    sent: int  # bytes of snapshot sent for the current part
    part: int = 0  # the part awaiting its reply
    parts: int = 1  # parts of the exchange
    addr: str = ""  # where the responder accepts requests
    opened: float | None = None  # when the exchange's first part was sent (None: `started`)
    life: int | None = None  # the responder's incarnation when the part was sent (None: not
    # live then)

    def postpone(self, seconds: float, now: float) -> None:
        """This node was paused for `seconds` while it waited: its clocks move by as much
        (never past `now`: an exchange opened since cannot have waited through it)."""
        shift = max(0.0, min(seconds, now - self.started))
        self.started += shift
        self.deadline += shift
        if self.opened is not None:
            self.opened = min(self.opened + shift, self.started)
