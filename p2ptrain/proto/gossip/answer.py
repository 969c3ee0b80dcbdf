"""How a node's gossip trainer answers what peers start (trainer.py owns the state): an
averaging request, answered from a snapshot of the replica's covered coordinates or declined,
and an outbound-only member's gradient push, answered with this node's latest gradient.

A request is declined while the node joins (`decline`), when its half step could not be held
until the step boundary (a step is outstanding and the held store is full), when its seed
does not follow the pair's chain (seeds.py: the reply grants a new chain, or tells the
initiator to start over), when its sender started far more of the node's recent exchanges
than their other partners had (guard.py's `crowded`), and when it crosses the
exchange this node opened with the same peer and still waits on: each side's half step is
taken from the two snapshots, so answering both would move each replica all the way to the
other's -- they would swap and stay as far apart. The node with the smaller id declines; the
other answers, and both land on the mean.

And how long a partner whose exchanges end without a half step is benched (`strike`): a
member holding the key that never answers held an honest node's one exchange slot for its
give-up (90 s and more), and was drawn again at the next due step -- six nodes with one such
member started 90 exchanges in 400 s instead of 1,985. Each exchange with it that ends
without its reply (given up, unanswered, the partner gone) benches it as long as the slot
was held (5 s at least), doubled for each such exchange in a row, up to MAX_REST; an applied
one clears it. A benched partner is drawn only when every partner is benched: two honest
nodes whose link came back after an outage would otherwise not average for as long as each
benched the other. A declined request is no strike: it costs a round trip, and a refusal
by the distance guard is one (drifted replicas average again once refusals have come
`distance_patience` times). `t` is the GossipTrainer. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any

from p2ptrain.proto.gossip.averaging import PeerSnapshot
from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest, GradientReply
from p2ptrain.proto.messages import Out

UNANSWERED_REST = 5.0  # s a partner rests after an exchange that ended without a half step
# s it rests at most: a silent partner's give-up grows to gossip.average_timeout_max (600 s)
# as its link looks slower each time, so it holds a node's slot a seventh of the time at most
MAX_REST = 3600.0


def strike(t: Any, now: float, peer: str, held: float) -> None:
    """An exchange of `t` with `peer` ended without its reply after holding the slot `held`
    s: `peer` is benched as long (UNANSWERED_REST at least), twice as long as after the last
    one in a row -- a silent member holds a node's slot a shrinking share of the time."""
    n = min(t.benched.get(peer, (0, 0.0))[0] + 1, 64)
    rest = max(UNANSWERED_REST, held) * 2.0 ** (n - 1)
    t.benched[peer] = (n, max(now + min(rest, MAX_REST), t.benched.get(peer, (0, 0.0))[1]))


def declines(t: Any, sender: str, body: AverageRequest) -> str | None:
    """Why `t` declines `sender`'s request whatever it holds (None: it need not): its seed
    does not follow the pair's chain (seeds.py), it crosses the exchange `t` opened with it,
    or `sender` is far ahead of `t`'s other recent partners (guard.py's `crowded`)."""
    if not t.seeds.check(sender, body.seed, body.part, body.nonce):
        return "seed"
    if crossing(t, sender):
        return "crossing"
    if body.part == 0 and t.guard.crowded(sender):  # (an exchange taken goes on)
        return "crowded"
    return None


def crossing(t: Any, sender: str) -> bool:
    """Whether `sender`'s request crosses the exchange `t` opened with it (reply awaited) and
    `t` is the side that declines."""
    ex = t.exchange
    return (ex is not None and ex.peer == sender and t.initiator.is_open
            and t.node_id < sender)


def respond(t: Any, now: float, sender: str, addr: str, body: AverageRequest,
            snap: PeerSnapshot, busy: bool, decline: bool, out: list[Out]) -> None:
    """Answer (or decline) `sender`'s averaging request; the half step goes to the parameters,
    or into the held half steps while `busy`. An answered peer is no partner of `t`'s own
    exchanges at its next step (they have just averaged), nor until the reply has surely
    reached it (the give-up's margin over the reply's expected time on the link): a request
    `t` sent meanwhile would find its exchange still open, and the larger id answers it --
    half a swap."""
    learner = t.learner
    chunks: tuple[bytes, ...] = ()
    why, grant = None, 0
    if not decline and busy and not t.held.room(t._part_size(body.seed, body.part)):
        decline = True  # its half step could not be held until the step boundary
        t.stats["average_declined_held_full"] += 1
    elif not decline and (why := declines(t, sender, body)) is not None:
        decline = True
        t.stats[f"average_declined_{why}"] += 1
    if why == "seed":  # a new chain, if the initiator's last began long enough ago
        grant = t.seeds.refused(sender, now, body.part, body.commitment)
    elif not decline:  # a read: allowed while busy
        t.responder.begin(learner.params, body.seed, body.part)
        chunks = tuple(bytes(c) for c in t.responder.messages(t.sender, learner.count.total))
        grant = t.seeds.taken(sender, body.seed, body.part, body.commitment)
    out.append(Out(sender, addr, AverageReply(body.seed, learner.step, learner.count.as_dict(),
                                              chunks, body.part, body.parts, t.loss, grant,
                                              why == "seed" and not grant), reply=True))
    if decline:
        t.stats["average_declined_by_us"] += 1
        return
    t.stats["average_answered"] += 1
    cfg = t.config
    t.resting[sender] = (now, now + t.peers.give_up(
        sender, sum(len(c) for c in chunks), floor=1e-3, margin=cfg.average_timeout_margin,
        ceiling=cfg.average_timeout_max))
    t._finish(t.responder, snap, busy, body.part)


def serve_latest(t: Any, sender: str, addr: str, out: list[Out]) -> None:
    """An outbound-only member pushed: return `t`'s latest gradient in the response, once per
    own step (nobody can connect to that member to push it)."""
    if t.latest is None:
        return
    step, loss, chunks = t.latest
    if t.served.get(sender, 0) >= step:
        return
    t.served[sender] = step
    out.extend(Out(sender, addr, GradientReply(step, loss, c), reply=True) for c in chunks)
    t.stats["gradient_replies"] += 1
