"""Push-pull parameter averaging between two nodes (step 4 of DESIGN.md's training algorithm).

Each side snapshots the covered coordinates of its parameters, the snapshots cross, and each
side applies `(x_peer - x_self) / 2`, computed from the two *snapshots*, to its *current*
parameters: local steps taken while the exchange was in flight are kept, and because the two
sides add exactly opposite float32 values (`fl(a - b) == -fl(b - a)`, halving is exact), the
pair's sum is preserved up to the rounding of the final additions. (Weighted by sample rates,
`pull_share`, each side moves by its peer's share instead.) With fp16 or int8 values a side
rounds its own snapshot through the codec exactly as the peer will decode it, so both work
from the same two rounded snapshots. No coordinate moves by more than `SPREAD` times the
median |x_peer - x_self| of the exchange (a clip, the same on both sides; spread.py), and the
exchange's distance -- what the guard judges -- is the RMS of that clipped difference: a peer
cannot keep an ordinary distance while putting any value on a few coordinates.
Which coordinates an exchange covers, and how its values travel, is its plan's (`plan.py`).

Sequence, initiator:  begin(params, seed) -> send messages() -> finish(params, reply).
Sequence, responder:  respond(params, request) -> (report, reply): it applies at once.
If the initiator never gets a valid reply it calls abort(); the responder has then moved alone
(a one-sided half step toward the peer): harmless for training, but that pair's sum is off. A
half step that must wait (a step is running) goes into `HeldDeltas`, added later.

This file owns the snapshot buffer and the update arithmetic. It never does I/O, never reads
the clock, never draws from global random state, and after construction allocates nothing of
the model's size (one snapshot buffer, reused; sub-block temporaries; a held half step is one
part's copy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ptrain.codecs import DEFAULT_CHUNK, Codec, CodecError, Message, parse_message
from p2ptrain.codecs.kernels import BLOCK, all_finite, bf16_bits_to_f32, blocks
from p2ptrain.codecs.wire import Origin, chunk_bounds, encode_chunk
from p2ptrain.optim import Progress
from p2ptrain.proto.gossip.plan import AveragingPlan
from p2ptrain.proto.gossip.spread import Spread, clip_sq

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    """One side's snapshot as received: all its chunk messages, checked for consistency."""

    seed: int  # the exchange's seed (the subset)
    sender: bytes  # raw 16-byte node id
    swarm_samples: int  # the sender's swarm count when it snapshotted
    length: int  # coordinates covered
    codec: Codec  # how values travel
    chunks: tuple[Message, ...]  # in index order, payloads not yet decoded


def read_snapshot(messages: Iterable[Any]) -> PeerSnapshot:
    """Parse a side's chunk messages (bytes or parsed) and check they form one whole vector;
    CodecError naming the first defect. Payloads are validated when applied."""
    parsed = [m if isinstance(m, Message) else parse_message(m) for m in messages]
    if not parsed:
        raise CodecError("averaging snapshot has no messages")
    first = parsed[0]
    for m in parsed:
        if (m.seed, m.sender_id, m.swarm_samples, m.vector_length, m.chunk_count, m.codec) != (
                first.seed, first.sender_id, first.swarm_samples, first.vector_length,
                first.chunk_count, first.codec):
            raise CodecError("averaging chunks disagree on seed, sender, length or codec")
    by_index = {m.chunk_index: m for m in parsed}
    if len(by_index) != len(parsed) or len(parsed) != first.chunk_count:
        raise CodecError(f"averaging snapshot has {len(parsed)} chunks ({len(by_index)} "
                         f"distinct), expected {first.chunk_count}")
    chunks = tuple(by_index[i] for i in range(first.chunk_count))
    return PeerSnapshot(first.seed, first.sender_id, first.swarm_samples, first.vector_length,
                        first.codec, chunks)


def read_part(plan: AveragingPlan, codec: Codec, sender: bytes, chunks: Iterable[Any],
              seed: int, part: int, parts: int) -> PeerSnapshot:
    """The snapshot an averaging body from `sender` carries for part `part` of `parts` of
    exchange `seed`, checked against the plan, the swarm's `codec` and the sender, every value
    finite; CodecError naming the first defect."""
    snap = read_snapshot(chunks)
    if parts != plan.parts(seed) or part >= parts:
        raise CodecError(f"averaging part {part} of {parts} does not match the plan "
                         f"({plan.parts(seed)} parts)")
    lo, hi = plan.part_range(seed, part)
    if snap.sender != sender or snap.seed != seed:
        raise CodecError("averaging chunks name another sender or exchange")
    if snap.codec != codec or snap.length != hi - lo:
        raise CodecError(f"averaging snapshot ({snap.codec.name}, {snap.length} values) "
                         f"does not match the plan ({codec.name}, {hi - lo})")
    for chunk in snap.chunks:
        if not math.isfinite(chunk.sq_norm()):
            raise CodecError("averaging snapshot holds non-finite values")
    return snap


@dataclass(frozen=True, slots=True)
class AveragingReport:
    """What one applied exchange did."""

    peer: bytes  # the peer's raw node id
    seed: int  # the exchange's seed
    covered: int  # coordinates averaged
    distance: float  # consensus distance: RMS of (x_peer - x_self) over them, from snapshots,
    # each |x_peer - x_self| clipped as the exchange clips it (spread.py)


HELD_PULL = 1.0  # the pulls held during one step sum to at most this (HeldDeltas)


class HeldDeltas:
    """Averaging half steps that finished while a step was outstanding, kept sparse -- the
    coordinates each part covered and its values -- until the step boundary adds them to the
    parameters: no buffer of the model's size. Holds at most `capacity` coordinates; a caller
    asks `room` before it commits to another part.

    Every half step held was taken against the same frozen parameters, so they add up: K of
    them toward one point with pull 1/2 would move a coordinate K/2 of the way there and on,
    past it (a member sending many requests while a step ran could push a replica anywhere,
    each request within the distance guard). So the pulls held over any coordinate sum to at
    most HELD_PULL: then the boundary's parameters are a convex combination of the frozen
    ones and the peers' snapshots. A half step past that budget is taken with what is left
    of it (none: left out). The budget is kept per span of the vector a part reaches, so the
    parts of one exchange (disjoint spans) do not share it."""

    def __init__(self, plan: AveragingPlan, capacity: int):
        self.plan = plan
        self.capacity = capacity  # coordinates held at most (callers check `room`)
        self.size = 0  # coordinates held
        self.pulls: list[tuple[int, int, float]] = []  # (lo, hi, pull): the span a part reaches
        self._parts: list[tuple[np.ndarray | None, int, np.ndarray]] = []  # (runs, lo, delta)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def room(self, m: int) -> bool:
        """Whether `m` more coordinates fit. (A request past the pull budget is still answered
        and its half step taken with what is left, maybe none: the peer moves, this node
        less -- as with pulls by sample rate, the pair's sum is not kept exactly. Declining
        instead cut multi-part exchanges short whenever two met on one span in a step.)"""
        return self.size + m <= self.capacity

    def take(self, pull: float, lo: int, hi: int) -> float:
        """The part of `pull` the budget of coordinates [lo, hi) still allows (0: none), now
        spent (conservatively: every held span that overlaps counts whole)."""
        allowed = max(0.0, min(pull, HELD_PULL - self._used(lo, hi)))
        if allowed > 0:
            self.pulls.append((lo, hi, allowed))
        return allowed

    def add(self, runs: np.ndarray | None, lo: int, delta: np.ndarray) -> None:
        self._parts.append((runs, lo, delta.copy()))
        self.size += int(delta.shape[0])

    def apply(self, params: np.ndarray) -> None:
        """Add every held half step to `params`, in the order they finished; then empty."""
        for runs, lo, delta in self._parts:
            self.plan.scatter_add(params, runs, delta, lo)
        self.clear()

    def _used(self, lo: int, hi: int) -> float:
        return sum(p for a, b, p in self.pulls if a < hi and lo < b)

    def clear(self) -> None:
        self._parts.clear()
        self.size = 0
        self.pulls.clear()


class ParameterAverager:
    """One node's side of push-pull averaging, one exchange open at a time."""

    def __init__(self, plan: AveragingPlan, chunk_elems: int = DEFAULT_CHUNK,
                 max_distance: float = math.inf, anchor: Progress | None = None):
        self.plan = plan
        # outer steps that rewind (outer.py): the replica goes back to x + d at the round's
        # end, so the snapshots are x + d (d: `anchor`, the round's progress in bfloat16) and
        # a half step moves x by the anchors' difference; snapshots of x would carry each
        # side's partial progress into the other's anchor (their difference survives the
        # rewind and pushes the anchors apart)
        self.anchor = anchor
        self._bits = np.zeros(0, np.uint16)  # d of one part, gathered
        self._wide = np.zeros(0, np.float32)  # one block of it, widened
        self.codec = plan.codec()
        self.chunk_elems = chunk_elems  # elements per chunk message
        self.max_distance = max_distance  # refuse a peer farther than this (RMS)
        self._snap = np.zeros(plan.buffer_size, np.float32)  # own snapshot, then difference
        self._round = np.zeros(self.codec.encoded_size(min(plan.buffer_size, BLOCK)),
                               np.uint8)  # one sub-block encoded, to round as the peer will
        self._scratch = np.zeros(0, np.float32)  # one peer chunk, for `distance`
        self._seed: int | None = None  # the open exchange's seed
        self._part = 0  # the open part
        self._runs: np.ndarray | None = None  # the part's runs (None: a contiguous range)
        self._lo = 0  # first coordinate of a contiguous part
        self._m = 0  # coordinates the part covers
        self._generation = 0  # bumped at every begin/close: stale message iterators fail

    @property
    def is_open(self) -> bool:
        return self._seed is not None

    def begin(self, params: np.ndarray, seed: int, part: int = 0) -> int:
        """Snapshot the coordinates part `part` of the exchange `seed` covers (rounded as
        they will travel); returns how many. The local steps may go on between this and
        `finish`. Parts are independent exchanges: each preserves the pair's sum alone."""
        self._check_params(params)
        if self.is_open:
            raise RuntimeError("an averaging exchange is already open")
        seed &= _MASK64
        lo, hi = self.plan.part_range(seed, part)
        runs = self.plan.subset(seed)
        if runs is not None:
            b = self.plan.block
            runs = runs[lo // b : -(-hi // b)]
        self._lo = lo
        m = self._gather(params, runs, hi - lo, self._snap)
        snap = self._snap[:m]
        if self.anchor is not None:
            if self._bits.shape[0] < m:
                self._bits = np.zeros(self._snap.shape[0], np.uint16)
            self._gather(self.anchor.bits, runs, hi - lo, self._bits)
            if self._wide.shape[0] < BLOCK:
                self._wide = np.zeros(BLOCK, np.float32)
            for start, stop in blocks(m):  # snap += bfloat16(d), a sub-block at a time
                wide = self._wide[: stop - start]
                bf16_bits_to_f32(self._bits[start:stop], wide)
                snap[start:stop] += wide
        if not all_finite(snap):
            raise ValueError("own parameters are not finite")
        if self.plan.values != "fp32":  # round in place exactly as the peer will decode:
            self._round_as_sent(snap)  # chunk by chunk, as messages() encodes
        self._seed, self._part, self._runs, self._m = seed, part, runs, m
        self._generation += 1
        return m

    def messages(self, sender_id: bytes, swarm_samples: int) -> Iterator[bytearray]:
        """The open snapshot as chunk messages, made lazily; consume them before `finish`."""
        if self._seed is None:
            raise RuntimeError("no averaging exchange is open")
        seed, m, generation = self._seed, self._m, self._generation
        origin = Origin(sender_id, swarm_samples, 1.0)
        bounds = chunk_bounds(m, self.chunk_elems)

        def make() -> Iterator[bytearray]:
            for index, (offset, length) in enumerate(bounds):
                if self._generation != generation:
                    raise RuntimeError("the snapshot changed: its exchange was closed")
                yield encode_chunk(self.codec, self._snap[offset : offset + length], origin,
                                   m, offset, index, len(bounds), seed)

        return make()

    def distance(self, peer: PeerSnapshot) -> float:
        """The (clipped) RMS distance between the open snapshot and the peer's, computed as
        `finish` will, changing neither (a chunk-sized scratch buffer, kept for the next call).
        CodecError if the peer's snapshot does not match the open exchange or is malformed."""
        m = self._check_peer(peer)
        spread, sq = Spread(), 0.0
        for clipping in (False, True):  # the clip first, then the clipped difference
            peak = spread.peak() if clipping else math.inf
            for chunk in peer.chunks:
                lo, n = chunk.chunk_offset, chunk.chunk_length
                if self._scratch.shape[0] < n:
                    self._scratch = np.zeros(n, np.float32)
                d = self._scratch[:n]
                np.copyto(d, self._snap[lo : lo + n])
                chunk.codec.decode_into(chunk.payload, d, -1.0, chunk.seed)  # mine - peer
                if clipping:
                    sq += clip_sq(d, peak)
                else:
                    spread.add(d)
        return math.sqrt(sq / m) if m else 0.0

    def finish(self, params: np.ndarray, peer: PeerSnapshot | Iterable[Any],
               held: HeldDeltas | None = None, pull: float = 0.5) -> AveragingReport:
        """Apply pull * (x_peer - x_self) (pairwise averaging: 1/2) from the two snapshots to
        the current `params` (or keep it in `held`, to be added later) and close the exchange.
        CodecError (exchange closed, params untouched) if the peer's snapshot is malformed,
        covers other coordinates, or is farther than `max_distance`."""
        self._check_params(params)
        if not 0.0 < pull < 1.0:
            raise ValueError(f"pull must be in (0, 1), got {pull}")
        if self._seed is None:
            raise RuntimeError("no averaging exchange is open")
        m, diff = self._m, self._snap[: self._m]
        try:
            if not isinstance(peer, PeerSnapshot):
                peer = read_snapshot(peer)
            self._check_peer(peer)
            for chunk in peer.chunks:
                chunk.decode_into(diff, -1.0)  # diff = mine - peer, chunk by chunk
            spread = Spread()
            spread.add(diff)  # symmetric: the peer finds the same peak and clips -diff alike
            distance = math.sqrt(clip_sq(diff, spread.peak()) / m)
            if not distance <= self.max_distance:
                raise CodecError(f"peer parameters are too far: RMS distance {distance:.4g}")
        except CodecError:
            self.abort()
            raise
        if held is not None:
            pull = held.take(pull, *self._span())
        diff *= np.float32(-pull)  # now (peer - mine) * pull; exact for 1/2
        if held is not None:
            if pull > 0:
                held.add(self._runs, self._lo, diff)
        else:
            self.plan.scatter_add(params, self._runs, diff, self._lo)
        report = AveragingReport(peer.sender, self._seed, m, distance)
        self.abort()
        return report

    def _span(self) -> tuple[int, int]:
        """[lo, hi) of the parameter vector the open part reaches."""
        if self._runs is None:
            return self._lo, self._lo + self._m
        b = self.plan.block
        return int(self._runs[0]) * b, min(self.plan.n, (int(self._runs[-1]) + 1) * b)

    def respond(self, params: np.ndarray, request: PeerSnapshot | Iterable[Any],
                sender_id: bytes, swarm_samples: int, part: int = 0
                ) -> tuple[AveragingReport, list[bytearray]]:
        """The responder's whole side of one part: snapshot with the request's seed, make the
        reply, apply. CodecError (params untouched, nothing to send) if the request is bad."""
        peer = request if isinstance(request, PeerSnapshot) else read_snapshot(request)
        self.begin(params, peer.seed, part)
        try:
            reply = list(self.messages(sender_id, swarm_samples))
        except BaseException:
            self.abort()
            raise
        return self.finish(params, peer), reply

    def abort(self) -> None:
        """Close the open exchange (if any) without applying anything."""
        self._seed, self._runs, self._m = None, None, 0
        self._generation += 1

    def _check_peer(self, peer: PeerSnapshot) -> int:
        """The open part's length; CodecError if `peer` is not a snapshot of the same part."""
        if self._seed is None:
            raise RuntimeError("no averaging exchange is open")
        m = self._m
        if peer.seed != self._seed or peer.length != m or peer.codec != self.codec:
            raise CodecError(
                f"peer snapshot (seed {peer.seed}, {peer.length} values, {peer.codec.name})"
                f" does not match ours (seed {self._seed}, {m}, {self.codec.name})")
        return m

    def _round_as_sent(self, snap: np.ndarray) -> None:
        """`snap` becomes what the peer decodes: chunk by chunk, as int8 scales from each."""
        for offset, length in chunk_bounds(snap.shape[0], self.chunk_elems):
            for start, stop in blocks(length):
                part = snap[offset + start : offset + stop]
                raw = self._round[: self.codec.encoded_size(stop - start)]
                self.codec.encode_into(part, raw)
                part.fill(0.0)
                self.codec.decode_into(raw, part)

    # -- gather and scatter ------------------------------------------------------------------

    def _check_params(self, params: np.ndarray) -> None:
        if (not isinstance(params, np.ndarray) or params.dtype != np.float32
                or params.shape != (self.plan.n,) or not params.flags.c_contiguous):
            raise TypeError(f"params must be a contiguous float32 array of ({self.plan.n},)")

    def _gather(self, src: np.ndarray, runs: np.ndarray | None, length: int,
                dst: np.ndarray) -> int:
        """dst[:m] = the part's coordinates of `src` (a vector of n); returns m."""
        if runs is None:
            lo = self._lo
            np.copyto(dst[:length], src[lo : lo + length])
            return length
        b = self.plan.block
        whole, tail = self.plan.split(runs)
        k = whole.shape[0]
        grid = src[: (self.plan.n // b) * b].reshape(-1, b)
        np.take(grid, whole, axis=0, out=dst[: k * b].reshape(k, b), mode="clip")
        if tail:
            dst[k * b : k * b + tail] = src[self.plan.n - tail :]
        return k * b + tail


def pull_share(mine: float | None, theirs: float | None, most: float,
               power: float = 1.0) -> float:
    """How far a replica moves toward a peer's in one exchange: the peer's share of the pair's
    sample rates (`mine`, `theirs`: samples/s as observed; None: not yet), each raised to
    `power`, clamped to [1 - most, most]; 1/2 (plain averaging) when `most` is 1/2 or a rate
    is unknown. Both sides computing it from their own observations, a slow replica (a Pi's)
    is pulled most of the way to a fast one (a server's) while the fast one keeps its
    progress; at power 1 the pair's rate-weighted mean stays put, above 1 the faster side
    keeps more of its own (its replica holds more recent steps than the slower one's)."""
    if most <= 0.5 or mine is None or theirs is None or not mine + theirs > 0:
        return 0.5
    if power != 1.0:
        top = max(mine, theirs)  # scaled first: no overflow whatever a peer reports
        mine, theirs = (mine / top) ** power, (theirs / top) ** power
    return min(most, max(1.0 - most, theirs / (mine + theirs)))


def consensus_distance(replicas: Sequence[np.ndarray]) -> float:
    """RMS distance of the replicas to their mean: sqrt(mean_i mean_j (x_ij - mean_j)^2)."""
    stack = np.stack([r.astype(np.float64) for r in replicas])
    return float(np.sqrt(np.mean((stack - stack.mean(axis=0)) ** 2)))
