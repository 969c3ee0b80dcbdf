"""Joining: before its first step a node adopts the swarm's latest checkpoint when it is newer
than its own replica (DESIGN.md, Checkpoints: "A joining node fetches the leader's latest
before it trains") -- but for fresh weights in a swarm with no leader yet, which train alone
while the join waits (node.py, `_trains_while_joining`).

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
  above both what the swarm reported when the fetch began and our own replica's: a hostile
  or broken leader cannot hand its joiners wrecked weights, an honest checkpoint is not
  judged by how far the swarm got while a big fetch ran, and one better than our own is
  never refused. What the swarm reports is the median of the losses the other members last
  reported, the judged leader's own reports aside (node.py): a leader cannot set the
  yardstick it is judged by. The leader whose checkpoint was refused is named (`refused`).
  A node that starts from fresh weights (no samples) adopts only a checkpoint clearly better
  than them (`FRESH_MARGIN`): weights as good as random by the loss -- a degenerate replica
  that predicts uniformly, which no step moves and no averaging reaches -- are not taken,
  from a hostile leader that reports a high loss of its own or from an honest swarm that has
  not learned yet (then without naming the leader). Likewise a node that trained while it
  waited (`trained_alone`: fresh weights in a swarm with no leader yet, node.py) keeps its
  replica unless the checkpoint is clearly better, without naming the leader: an honest
  leader's checkpoint of that moment may be older than the steps taken meanwhile.
- Such a node does not fetch at all when the leader's checkpoint is the same swarm's start:
  when no checkpoint of the leader's is known yet (what it said in its headers, else what
  members relayed: holdings.py), or one of at most `ALONE_HEAD_START` times the samples
  trained here meanwhile. A swarm that started together holds nothing a fetch would
  bring, and on a slow uplink that fetch stops its joiners for minutes. A checkpoint far
  ahead (a swarm that was electing a new leader when the node came) is fetched as always.
  A leader that understates what it holds, or a member relaying a small holding for a
  leader that has not spoken yet, only leaves the node training its own replica (as a
  leader that does not serve its checkpoint would); a large one only brings the usual fetch
  and judgement.
- The fetch names the leader's address first, then every member that says it holds the same
  checkpoint (holdings.py): the driver pulls chunks from all of them at once. Which
  checkpoint: the leader's that the most members hold (`swarm_choice`), asked for by name, so
  a join storm stays on one checkpoint while the leader writes newer ones.
- A failed fetch is retried with exponential back-off (`fetch_backoff` doubling up to
  `fetch_backoff_max`), each time from whoever leads then, at most `fetch_attempts` times;
  a leader that has no checkpoint yet is not asked again (retry False). Then the node
  trains from what it has; averaging catches it up.
Pure: time is passed in; it emits actions and never does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from p2ptrain.proto.events import (
    Action,
    AdoptCheckpoint,
    CheckpointFetched,
    FetchCheckpoint,
    Joined,
)
from p2ptrain.proto.membership.holdings import Holdings
from p2ptrain.proto.records import Holding

WAITING, FETCHING, BACKOFF, DONE = "waiting", "fetching", "backoff", "done"
# s a joiner that knows the leader waits for its first member list before choosing what to
# fetch: it hears of the leader (a header) before it hears who else is fetching what (a
# list), and would start on the newest alone; past this it chooses with what it knows
LISTING_GRACE = 5.0
# nats a fetched checkpoint's held-out loss must be below a fresh replica's to be adopted by a
# node that starts from fresh weights (see the module docstring)
FRESH_MARGIN = 0.05
# a node that trained alone while no leader was known fetches the leader's checkpoint only
# when it holds more than this many times the samples trained meanwhile (module docstring)
ALONE_HEAD_START = 4


def median_loss(losses: Iterable[float | None]) -> float | None:
    """The median of the losses that are known (None if none is): the swarm's yardstick."""
    known = sorted(loss for loss in losses if loss is not None)
    return known[len(known) // 2] if known else None


def swarm_choice(leader: str, addr_of: Callable[[str], str | None], holdings: Holdings,
                 members: Iterable[str]) -> Holding | None:
    """Which of `leader`'s checkpoints a joiner fetches: of those of its current term and not
    newer than the one it holds now, the one the most reachable members besides the leader
    say they hold (whole or in part), the newest on a tie -- with nobody else holding any,
    the leader's newest. A join storm keeps to one checkpoint when the leader writes a newer
    one meanwhile (two fetches of different checkpoints share no chunk), and every holder
    adds upload. How old it may be is bounded by what the leader keeps (`checkpoint.keep`:
    2 intervals older at most by default): one the leader no longer holds is answered "not
    held" and the fetch takes the leader's newest. A member that lies about what it holds
    moves a joiner, at worst, to an older checkpoint the leader still signs. None while the
    leader says it holds none."""
    own = holdings.of(leader)
    if own is None:
        return None
    count = {own: 0}
    for node in sorted(set(members)):
        held = holdings.of(node) if node != leader and addr_of(node) is not None else None
        if held is not None and held.term == own.term and held.step <= own.step:
            count[held] = count.get(held, 0) + 1
    return max(count, key=lambda h: (count[h], h.step, h.samples, h.digest))


def preferred(leader: str, addr_of: Callable[[str], str | None], holdings: Holdings,
              members: Iterable[str]) -> Holding | None:
    """`swarm_choice` when it is an older checkpoint than the one the leader says it holds
    (ask for it by name), else None (ask the leader for its newest, which may be newer still
    than what it said)."""
    choice = swarm_choice(leader, addr_of, holdings, members)
    return None if choice is None or choice == holdings.of(leader) else choice


def sources(leader: str, digest: str | None, addr_of: Callable[[str], str | None],
            holdings: Holdings, members: Iterable[str], limit: int) -> tuple[str, ...]:
    """Where to fetch `leader`'s checkpoint with `digest` (None: `swarm_choice`'s): its
    address first, then (in the order of `members`) the reachable members that say they hold
    the same one, whole or in part; () while the leader cannot be reached."""
    addr = addr_of(leader)
    if addr is None:
        return ()
    if digest is None:
        members = list(members)
        holding = swarm_choice(leader, addr_of, holdings, members)
        digest = None if holding is None else holding.digest
    if digest is None:
        return (addr,)
    others = (addr_of(n) for n in holdings.holders(digest, members) if n != leader)
    return (addr, *[a for a in others if a is not None][: limit - 1])


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
        self.reference: float | None = None  # the swarm's loss when the fetch began
        self.listing_wait: float | None = None  # until when to wait for a member list
        self.listing_waited = False  # the wait for a member list is over (once per join)

    @property
    def done(self) -> bool:
        return self.state == DONE

    def resumed(self, now: float) -> None:
        """The process was paused: a wait for a leader (and for its list) starts again. A
        joiner paused past `timeout` gave up on the leader it had not had time to hear, and
        trained from its own, fresh weights."""
        if self.state == WAITING:
            self.wait_from = now
            if self.listing_wait is not None:
                self.listing_wait = now + LISTING_GRACE

    def next_deadline(self) -> float | None:
        if self.state == WAITING:
            if self.listing_wait is not None:
                return min(self.wait_from + self.timeout, self.listing_wait)
            return self.wait_from + self.timeout
        if self.state == BACKOFF:
            return self.retry_at
        return None

    def advance(self, now: float, me: str, leader: str | None,
                sources_of: Callable[[str], tuple[str, ...]],
                swarm_loss: float | None = None,
                choice_of: Callable[[str], Holding | None] | None = None,
                listings: int = 1, alone: int = 0,
                held_of: Callable[[str], Holding | None] | None = None) -> list[Action]:
        """Move on as far as the current view allows (called after every event);
        `swarm_loss`: what the swarm reports now, the yardstick for what this fetch brings;
        `choice_of(leader)`: the checkpoint to ask for (`preferred`; None: the newest);
        `listings`: member lists merged so far (none: wait up to LISTING_GRACE for one);
        `alone`: samples trained while no leader was known (0: none); `held_of(leader)`: the
        checkpoint the leader is known to hold (`Holdings.of`)."""
        if self.state == BACKOFF and now >= self.retry_at:
            self.state, self.wait_from = WAITING, now
        if self.state != WAITING:
            return []
        if leader == me:
            return self._finish("this node leads")
        sources = sources_of(leader) if leader is not None else ()
        # the wait for a member list ends at the grace or at the join's own wait, if sooner
        # (a deadline this leaves in the past would wake the node again at once, for ever)
        timed_out = now >= self.wait_from + self.timeout
        if sources and not listings and not self.listing_waited:
            if self.listing_wait is None:
                self.listing_wait = now + LISTING_GRACE
            if now < self.listing_wait and not timed_out:
                return []  # the first member list will say who else holds what
        if self.listing_wait is not None and (listings or timed_out or now >= self.listing_wait):
            self.listing_wait, self.listing_waited = None, True
        if sources and alone and not self.attempt:
            held = held_of(leader) if held_of is not None else None
            if held is None:
                return self._finish("the leader has announced no checkpoint (the swarm started "
                                    "together); no fetch")
            if held.samples <= ALONE_HEAD_START * alone:
                return self._finish(f"the leader's checkpoint ({held.samples:,} swarm samples) is "
                                    f"this swarm's start, as far as {alone:,} trained here; no "
                                    f"fetch")
        if sources:
            self.state = FETCHING
            self.attempt += 1
            self.fetching_from = leader
            self.reference = swarm_loss
            choice = choice_of(leader) if choice_of is not None else None
            prefer = None if choice is None else (choice.term, choice.step)
            return [FetchCheckpoint(leader, sources, self.attempt, prefer)]
        if now >= self.wait_from + self.timeout:
            if self.attempt:
                return self._finish(f"no leader to fetch from after {self.attempt} attempts "
                                    f"({self.last_error}); starting from the local weights")
            return self._finish(f"no leader answered within {self.timeout:g}s")
        return []

    def unacceptable(self, event: CheckpointFetched, reference: float | None) -> str:
        """Why a fetched checkpoint must not be adopted ("" if it may): weights that are not
        finite or do not load, or a held-out loss far above both yardsticks -- what the swarm
        reports and our own replica's loss on the same batch. A hostile or broken leader
        cannot hand joiners wrecked weights; a checkpoint better than what this node would
        train from anyway is never refused (the swarm reports a noisy training loss, and a
        fresh node's own weights are random)."""
        if event.loss is None:
            return ""
        if not event.loss < float("inf"):
            return "its weights are not finite"
        known = [r for r in (reference, event.own_loss) if r is not None]
        ref = max(known) if known else None
        if ref is not None and event.loss > ref * (1 + self.loss_tolerance) + 0.05:
            return f"held-out loss {event.loss:.3f} against {ref:.3f}"
        return ""

    def fetched(self, now: float, event: CheckpointFetched, reference: float | None = None,
                trained_alone: bool = False) -> list[Action]:
        """The driver's answer to our FetchCheckpoint (`reference`: the loss the swarm
        reports now, if known; the one it reported when the fetch began wins -- a big fetch
        takes minutes, and the swarm's loss falls meanwhile below an honest checkpoint's;
        `trained_alone`: our replica took steps while the join waited)."""
        if self.state != FETCHING:
            return []  # a late answer (the join ended meanwhile): nothing to do
        if event.path is not None:
            if (trained_alone and event.loss is not None and event.own_loss is not None
                    and event.loss < float("inf")
                    and not event.loss < event.own_loss - FRESH_MARGIN):
                return self._finish(f"the leader's checkpoint is no better than the weights "
                                    f"trained while joining (held-out loss {event.loss:.3f} "
                                    f"against {event.own_loss:.3f}); keeping them")
            problem = self.unacceptable(event, self.reference if self.reference is not None
                                        else reference)
            if problem:
                self.refused = self.fetching_from
                return self._finish(f"refused the leader's checkpoint ({problem}); starting "
                                    f"from the local weights")
            if (self.own_samples == 0 and event.loss is not None and event.own_loss is not None
                    and not event.loss < event.own_loss - FRESH_MARGIN):
                return self._finish(f"the leader's checkpoint is no better than fresh weights "
                                    f"(held-out loss {event.loss:.3f} against "
                                    f"{event.own_loss:.3f}); starting from the local weights")
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
