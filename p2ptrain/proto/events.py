"""What goes into the control plane and the training node (events) and what comes out
(actions).

`Control.handle(now, event)` and `Node.handle(now, event)` take one event and return a list
of actions; the driver (the asyncio runtime, the simulator, the test harness) performs the
actions and feeds back what happens as events. `StepDone`, `Evaluated`, `RunStep` and
`Finished` concern only a training `Node`. All are frozen, slotted dataclasses. A driver
must handle every action type it may receive; unknown future actions can be ignored safely
only if they are notifications (MemberUp, MemberDown, LeaderChanged, Refused, RemoteError,
Finished). This file owns the shapes only; it never decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.proto.messages import Envelope
from p2ptrain.proto.records import Holding, MemberInfo

# -- events (driver -> control plane) ---------------------------------------------------------


class Event:
    """Base of all events."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Time passed: run every timer due at `now` (call at or after `next_deadline()`)."""


@dataclass(frozen=True, slots=True)
class Received(Event):
    """A message arrived: raw wire bytes (decoded and validated here) or an Envelope already
    decoded by the caller (the in-memory harness)."""

    addr: str  # transport address it came from (for logs and replies to strangers)
    message: Envelope | bytes


@dataclass(frozen=True, slots=True)
class Discovered(Event):
    """A peer address was found (mDNS, a static seed, a DNS name): try to join through it."""

    addr: str


@dataclass(frozen=True, slots=True)
class Progress(Event):
    """The trainer's counters: local step, the swarm sample count, own samples processed."""

    step: int  # local optimiser step (never decreases)
    swarm_samples: int  # the swarm G-counter's total as the trainer knows it
    samples: int  # samples this node has processed (never decreases)
    finished: bool = False  # the run reached total_samples: the leader saves a final checkpoint


@dataclass(frozen=True, slots=True)
class Holds(Event):
    """The driver's checkpoint holdings changed: the newest checkpoint this node holds and
    serves (whole, or verified chunks of a fetch in progress), or None. Gossiped in every
    header from now on."""

    holding: Holding | None


@dataclass(frozen=True, slots=True)
class Leave(Event):
    """Shut down: announce departure (and resign, if leading); afterwards the node is inert."""


@dataclass(frozen=True, slots=True)
class StepDone(Event):
    """The driver finished the `RunStep` of the same `step`: the learner's gradient buffer
    holds the batch gradient and `loss` is the batch's mean loss (training nodes only)."""

    step: int  # the RunStep's step number
    loss: float  # mean training loss of the batch (nats/token); not finite: step discarded


@dataclass(frozen=True, slots=True)
class Reading(Event):
    """The driver starts (active) or has stopped reading the learner's buffers in another
    thread -- a checkpoint written straight from them, with no copy (training nodes only).
    Until Reading(False) nothing the node does writes the parameters or optimiser state:
    averaging half steps are held as while a step runs, and StepDone must wait."""

    active: bool


@dataclass(frozen=True, slots=True)
class CheckpointFetched(Event):
    """The driver's answer to `FetchCheckpoint`: the verified checkpoint's location and its
    swarm sample count, or (path None) why there is none and whether asking again may help."""

    path: str | None  # a verified checkpoint of this swarm's model, or None
    swarm_samples: int = 0  # the checkpoint's swarm sample count
    reason: str = ""  # why there is no checkpoint (path None)
    retry: bool = True  # path None: a transient failure (worth another try, with back-off)
    loss: float | None = None  # the checkpoint's held-out loss on a fixed batch (inf: unusable)
    own_loss: float | None = None  # this node's replica's loss on the same batch
    counts: dict[str, int] | None = None  # the checkpoint's swarm G-counter (node id -> count)


@dataclass(frozen=True, slots=True)
class Unanswered(Event):
    """The driver's request carrying part `part` of averaging exchange `seed` to `peer` is
    over (failed, refused, or answered) and whatever reply it brought was delivered: if the
    exchange still waits on that part, no reply will come (training nodes only). Without it
    the exchange waits for its give-up."""

    peer: str  # node id the request went to
    seed: int
    part: int
    timed_out: bool = False  # the request ran out of time (a bandwidth signal)


@dataclass(frozen=True, slots=True)
class Evaluated(Event):
    """The driver measured the held-out loss of the replica (for status; training nodes)."""

    eval_loss: float


# -- actions (control plane -> driver) ---------------------------------------------------------


class Action:
    """Base of all actions."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Send(Action):
    """Send `envelope` (wire.encode it) to the node at `addr`. `reply` marks the answer to a
    request from that node: send it in the response, which reaches outbound-only peers."""

    to: str | None  # node id, or None when only the address is known (a seed)
    addr: str
    envelope: Envelope
    reply: bool = False


@dataclass(frozen=True, slots=True)
class SaveCheckpoint(Action):
    """The leader decided: write a checkpoint stamped (term, step, leader, swarm samples)."""

    term: int
    step: int
    swarm_samples: int
    leader: str  # this node
    final: bool = False  # the run is over


@dataclass(frozen=True, slots=True)
class LeaderChanged(Action):
    """The leader this node follows changed; `leader` is None while none is known. When
    `leader` is this node, the driver must persist `term` (the `term_floor` of a restart)."""

    term: int
    leader: str | None


@dataclass(frozen=True, slots=True)
class MemberUp(Action):
    """A member joined or came back (new incarnation)."""

    info: MemberInfo
    incarnation: int


@dataclass(frozen=True, slots=True)
class MemberDown(Action):
    """A member was declared dead, or left."""

    node_id: str
    incarnation: int
    left: bool  # True: it announced its departure


@dataclass(frozen=True, slots=True)
class Refused(Action):
    """A peer's configuration differs: `keys` names the differing fingerprint fields.
    `by_peer` is True when the peer refused us (we cannot join it), False when we refused it."""

    addr: str
    node_id: str | None
    keys: tuple[str, ...]
    reason: str
    by_peer: bool


@dataclass(frozen=True, slots=True)
class RemoteError(Action):
    """A peer sent something malformed or illegal; it was refused and nothing changed."""

    addr: str
    sender: str | None  # node id, when the header could be read
    reason: str
    # counts against the sender as an offender (False: a judgement of drift, such as a
    # snapshot too far from our replica, that honest members can earn)
    offence: bool = True


@dataclass(frozen=True, slots=True)
class RunStep(Action):
    """Compute the gradient of the next local batch now (`learner.compute_gradient()`), off
    the event loop, and report `StepDone(step, loss)`. Until then the node writes no
    parameter, so the computation may read them from another thread."""

    step: int  # local step number the gradient is for (1-based)


@dataclass(frozen=True, slots=True)
class Finished(Action):
    """The swarm sample count reached the run's total: this node takes no more steps."""

    step: int
    swarm_samples: int


@dataclass(frozen=True, slots=True)
class FetchCheckpoint(Action):
    """Joining: fetch the swarm's latest checkpoint from `sources` (addresses of members that
    hold it; the leader's first), verify it, and answer `CheckpointFetched`. Load nothing."""

    leader: str  # node id of the leader whose checkpoint is wanted (signs its manifest)
    sources: tuple[str, ...]  # addresses to fetch from
    attempt: int  # 1 for the first try
    # (term, step) of the checkpoint to ask the leader for (joining.swarm_choice); if the
    # leader no longer holds it, or None, its newest
    prefer: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class AdoptCheckpoint(Action):
    """Load the weights (not the optimiser state) of the fetched checkpoint at `path` into the
    learner now, before the next event: it is newer than this node's replica."""

    path: str
    swarm_samples: int


@dataclass(frozen=True, slots=True)
class Joined(Action):
    """The join is over: training starts (with adopted weights or the node's own)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Offender(Action):
    """A member's values were refused too often: it is ignored until `until` (node time)."""

    node_id: str
    refusals: int  # refusals of its values so far
    until: float
    reason: str  # the last refusal's reason


@dataclass(frozen=True, slots=True)
class Deliver(Action):
    """A message whose body the control plane does not own (gradient gossip, averaging): its
    header has been processed; hand the body to its owner."""

    envelope: Envelope
    addr: str
