"""The message bodies of gossip training (wire ids 32-63): gradient pushes and push-pull
parameter averaging.

They ride in the control plane's `Envelope` (`Control.wrap`), so every one of them carries
the sender's header -- its own entry of the swarm sample G-counter, its leader view, and
piggybacked membership updates -- at no extra cost. Tensor data travels as codec chunk
messages (`p2ptrain.codecs` wire format: each chunk has its own header and checksum) in
`bytes` fields, which go into the binary tail of the frame unescaped.

- `GradientPush`: one chunk of the sender's latest gradient, fire and forget.
- `GradientReply`: the same, sent in the response to an outbound-only member's push: how
  gradients reach a node nobody can connect to.
- `TrackPush` / `TrackAck`: one part of a tracking push (tracking.py: the sign of the
  sender's replica minus its public copy, which the receiver's copy adds) and its answer.
- `AverageRequest` / `AverageReply`: the two snapshots of one part of a push-pull averaging
  exchange (a big model's exchange travels as several parts of a few MB, one after the
  other, each averaged on its own, so no side ever holds a second copy of the model), each
  with the sender's whole G-counter (averaging is rare, so the full counter is cheap
  there; gradient pushes carry only the header's own entry) and its latest training loss
  (for status, and the swarm's loss a joiner judges a checkpoint by, when no gradients
  travel). A reply with no chunks declines.

`check()` refuses what no honest peer sends (negative counters, malformed counter keys, too
many chunks); whether the chunks decode, match this node's model and come from the header's
sender is checked by the training node (training.py) before anything changes. This file owns
the shapes only: no state, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.proto.gossip.seeds import NONCE_BYTES
from p2ptrain.proto.messages import Body, register
from p2ptrain.proto.records import check_count, check_node_id

_HEX = frozenset("0123456789abcdef")

MAX_CHUNKS = 1024  # chunk messages in one averaging body
MAX_PARTS = 1 << 16  # parts of one averaging exchange (a 128G-coordinate model at 2M each)
MAX_COUNTER_ENTRIES = 65536  # node ids in one G-counter


def _check_counts(counts: dict[str, int]) -> None:
    if len(counts) > MAX_COUNTER_ENTRIES:
        raise ValueError("sample counter has too many entries")
    for node_id, n in counts.items():
        check_node_id(node_id, "sample counter key")
        check_count(n, "sample count")


def _check_part(part: int, parts: int) -> None:
    check_count(part, "part")
    check_count(parts, "parts")
    if not part < parts <= MAX_PARTS:
        raise ValueError(f"part {part} of {parts}: need part < parts <= {MAX_PARTS}")


def _check_progress(step: int, loss: float | None) -> None:
    check_count(step, "step")
    # (the wire refuses NaN and inf; a body built here must too)
    if loss is not None and not 0.0 <= loss < math.inf:
        raise ValueError("loss must be finite and >= 0")


@register(32)
@dataclass(frozen=True, slots=True)
class GradientPush(Body):
    """One chunk of the sender's gradient of local step `step`."""

    step: int  # sender's local step the gradient belongs to
    loss: float  # sender's training loss at that step (for status)
    chunk: bytes  # one codec chunk message (its header names codec, sender, weight, samples)

    def check(self) -> None:
        _check_progress(self.step, self.loss)


@register(33)
@dataclass(frozen=True, slots=True)
class GradientReply(Body):
    """One chunk of the responder's latest gradient, answering an outbound-only member's
    push (sent in the response, the only way to reach it)."""

    step: int
    loss: float
    chunk: bytes

    def check(self) -> None:
        _check_progress(self.step, self.loss)


@register(34)
@dataclass(frozen=True, slots=True)
class AverageRequest(Body):
    """Open a push-pull averaging exchange: the initiator's snapshot."""

    seed: int  # the exchange's seed: chooses the covered coordinates; every chunk carries it
    step: int  # initiator's local step when it snapshotted
    counts: dict[str, int]  # initiator's swarm sample G-counter
    chunks: tuple[bytes, ...]  # the part's snapshot as codec chunk messages, in index order
    part: int = 0  # which part of the exchange (each part is averaged on its own)
    parts: int = 1  # how many parts the exchange has
    loss: float | None = None  # initiator's latest training loss (None before its first step)
    reveal: str = ""  # the nonce the seed was derived from, hex (seeds.py); zeros: none yet
    commit: str = ""  # commitment to the nonce of the pair's next exchange, hex (first parts)
    # (hex in the JSON, not bytes in the binary tail: the tail is the codec chunks alone)

    def check(self) -> None:
        check_count(self.seed, "seed")
        _check_progress(self.step, self.loss)
        _check_counts(self.counts)
        _check_part(self.part, self.parts)
        if not 1 <= len(self.chunks) <= MAX_CHUNKS:
            raise ValueError(f"an averaging request needs 1..{MAX_CHUNKS} chunks")
        if (len(self.reveal) not in (0, 2 * NONCE_BYTES) or len(self.commit) not in (0, 32)
                or not set(self.reveal + self.commit) <= _HEX):
            raise ValueError("an averaging request's nonce or commitment is not 16 bytes of hex")

    @property
    def nonce(self) -> bytes:
        return bytes.fromhex(self.reveal)

    @property
    def commitment(self) -> bytes:
        return bytes.fromhex(self.commit)


@register(35)
@dataclass(frozen=True, slots=True)
class AverageReply(Body):
    """The responder's snapshot for the exchange `seed` (already applied on its side), or no
    chunks: declined (busy with another exchange, or not training)."""

    seed: int
    step: int
    counts: dict[str, int]
    chunks: tuple[bytes, ...]
    part: int = 0
    parts: int = 1
    loss: float | None = None
    grant: int = 0  # the responder's part of the pair's next seed (seeds.py); 0: none
    reseed: bool = False  # the request's seed did not follow: start the pair's chain anew

    def check(self) -> None:
        check_count(self.seed, "seed")
        check_count(self.grant, "grant")
        _check_progress(self.step, self.loss)
        _check_counts(self.counts)
        _check_part(self.part, self.parts)
        if len(self.chunks) > MAX_CHUNKS:
            raise ValueError(f"an averaging reply has at most {MAX_CHUNKS} chunks")


TRACK_OK, TRACK_RESET, TRACK_REFUSED = "ok", "reset", "refused"
TRACK_STATUSES = (TRACK_OK, TRACK_RESET, TRACK_REFUSED)


def _check_track(epoch: int, seq: int, part: int, parts: int) -> None:
    check_count(epoch, "epoch")
    check_count(seq, "seq")
    _check_part(part, parts)
    if epoch < 1 or seq < 1:
        raise ValueError("a tracking push's epoch and seq start at 1")


@register(36)
@dataclass(frozen=True, slots=True)
class TrackPush(Body):
    """Part `part` of push `seq` of the sender's tracking epoch `epoch`: codec chunk messages
    of the difference its public copy adds (a new epoch's copy starts at zero)."""

    epoch: int
    seq: int  # pushes of the epoch so far, this one included
    chunks: tuple[bytes, ...]
    part: int = 0
    parts: int = 1

    def check(self) -> None:
        _check_track(self.epoch, self.seq, self.part, self.parts)
        if not 1 <= len(self.chunks) <= MAX_CHUNKS:
            raise ValueError(f"a tracking push needs 1..{MAX_CHUNKS} chunks")


@register(37)
@dataclass(frozen=True, slots=True)
class TrackAck(Body):
    """The answer to a `TrackPush` (in its response): `ok` (applied), `reset` (it does not
    follow the copy held, which is dropped: a new epoch would be followed) or `refused`
    (no room for another copy, or not training)."""

    epoch: int
    seq: int
    part: int
    status: str

    def check(self) -> None:
        _check_track(self.epoch, self.seq, self.part, self.part + 1)
        if self.status not in TRACK_STATUSES:
            raise ValueError(f"tracking status must be one of {TRACK_STATUSES}")


GOSSIP_BODIES: tuple[type[Body], ...] = (GradientPush, GradientReply, AverageRequest,
                                         AverageReply, TrackPush, TrackAck)

__all__ = ["GOSSIP_BODIES", "TRACK_OK", "TRACK_REFUSED", "TRACK_RESET", "AverageReply",
           "AverageRequest", "GradientPush", "GradientReply", "TrackAck", "TrackPush"]
