"""Joining: before its first step a node adopts the swarm's latest checkpoint when it is newer
than its own replica (DESIGN.md, Checkpoints: "A joining node fetches the leader's latest
before it trains").

    waiting  --leader known (not us)-->  fetching  --CheckpointFetched-->  done
       |  \\--we lead / join_timeout-->  done          | failed, retry
       |                                            backoff --retry_at--> waiting (the
       |                                                        current leader, maybe new)

Rules it keeps:
- The decision is made against the replica the node *started* with (`own_samples`): nothing
  a joiner hears before the fetch (counters in headers, averaging requests, which it declines)
  may make it believe its replica is current.
- A checkpoint is adopted only if its weights load and are finite and its held-out loss on
  a fixed batch (the driver measures it, and our own replica's on the same batch) is not far
  above what the swarm reports (else our own): a hostile or broken leader cannot hand its
  joiners wrecked weights. The leader whose checkpoint was refused is named (`refused`).
- A failed fetch is retried with exponential back-off (`fetch_backoff` doubling up to
  `fetch_backoff_max`), each time from whoever leads then, at most `fetch_attempts` times;
  a leader that has no checkpoint yet is not asked again (retry False). Then the node
  trains from what it has; averaging catches it up.
Pure: time is passed in; it emits actions and never does I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from p2ptrain.proto.events import (
    Action,
    AdoptCheckpoint,
    CheckpointFetched,
    FetchCheckpoint,
    Joined,
)

WAITING, FETCHING, BACKOFF, DONE = "waiting", "fetching", "backoff", "done"


class Join:
    """One node's join: see the module docstring."""

    def __init__(self, *, now: float, own_samples: int, timeout: float, attempts: int,
                 backoff: float, backoff_max: float, loss_tolerance: float,
                 enabled: bool = True):
        self.started = now
        self.own_samples = own_samples  # swarm samples of the replica the node started with
        self.timeout = timeout  # s to wait for a leader at all
        self.attempts, self.backoff, self.backoff_max = attempts, backoff, backoff_max
        self.state = WAITING if enabled else DONE
        self.attempt = 0
        self.retry_at = 0.0
        self.wait_from = now  # when the current wait for a leader began
        self.fetching_from = ""  # the leader the fetch in flight asks
        self.reason = "" if enabled else "joining without a fetch"
        self.last_error = ""
        self.loss_tolerance = loss_tolerance  # see `unacceptable`
        self.refused: str | None = None  # the leader whose checkpoint was refused, if any

    @property
    def done(self) -> bool:
        return self.state == DONE

    def next_deadline(self) -> float | None:
        if self.state == WAITING:
            return self.wait_from + self.timeout
        if self.state == BACKOFF:
            return self.retry_at
        return None

    def advance(self, now: float, me: str, leader: str | None,
                addr_of: Callable[[str], str | None]) -> list[Action]:
        """Move on as far as the current view allows (called after every event)."""
        if self.state == BACKOFF and now >= self.retry_at:
            self.state, self.wait_from = WAITING, now
        if self.state != WAITING:
            return []
        if leader == me:
            return self._finish("this node leads")
        addr = addr_of(leader) if leader is not None else None
        if addr is not None:
            self.state = FETCHING
            self.attempt += 1
            self.fetching_from = leader
            return [FetchCheckpoint(leader, (addr,), self.attempt)]
        if now >= self.wait_from + self.timeout:
            if self.attempt:
                return self._finish(f"no leader to fetch from after {self.attempt} attempts "
                                    f"({self.last_error}); starting from the local weights")
            return self._finish(f"no leader answered within {self.timeout:g}s")
        return []

    def unacceptable(self, event: CheckpointFetched, reference: float | None) -> str:
        """Why a fetched checkpoint must not be adopted ("" if it may): weights that are not
        finite or do not load, or a held-out loss far above the reference (what the swarm
        reports, else our own replica's on the same batch) -- a hostile or broken leader
        cannot hand joiners wrecked weights."""
        if event.loss is None:
            return ""
        if not event.loss < float("inf"):
            return "its weights are not finite"
        ref = reference if reference is not None else event.own_loss
        if ref is not None and event.loss > ref * (1 + self.loss_tolerance) + 0.05:
            return f"held-out loss {event.loss:.3f} against {ref:.3f}"
        return ""

    def fetched(self, now: float, event: CheckpointFetched,
                reference: float | None = None) -> list[Action]:
        """The driver's answer to our FetchCheckpoint (`reference`: the loss the swarm
        reports, if known)."""
        if self.state != FETCHING:
            return []  # a late answer (the join ended meanwhile): nothing to do
        if event.path is not None:
            problem = self.unacceptable(event, reference)
            if problem:
                self.refused = self.fetching_from
                return self._finish(f"refused the leader's checkpoint ({problem}); starting "
                                    f"from the local weights")
            if event.swarm_samples > self.own_samples:
                return [AdoptCheckpoint(event.path, event.swarm_samples),
                        *self._finish(f"weights from the leader's checkpoint "
                                      f"({event.swarm_samples:,} swarm samples)")]
            return self._finish(f"the local replica is as new as the leader's checkpoint "
                                f"({self.own_samples:,} swarm samples)")
        self.last_error = event.reason or "fetch failed"
        if not event.retry or self.attempt >= self.attempts:
            tries = f" after {self.attempt} attempts" if event.retry else ""
            return self._finish(f"no checkpoint from the leader{tries} ({self.last_error}); "
                                f"starting from the local weights")
        self.state = BACKOFF
        self.retry_at = now + min(self.backoff_max, self.backoff * 2 ** (self.attempt - 1))
        return []

    def _finish(self, reason: str) -> list[Action]:
        self.state, self.reason = DONE, reason
        return [Joined(reason)]
