"""Tracking (`gossip.track_peers = k > 0`): the swarm's fastest members keep their replicas
together after every step with compressed differences -- CHOCO-gossip (Koloskova, Stich and
Jaggi, 2019) with the scaled sign as the compressor.

Why (BENCHMARKS §16): at 100M the three servers' samples are worth 2x one server only when
their replicas are mixed whole every step, and a whole vector every 0.28 s step does not fit
their gigabit link even in int8 (100 MB). A copy that follows each replica by the *sign* of
what it lacks, 1 bit a coordinate and a float32 scale per 1,024 (12.9 MB at 100M), mixes as
well as the whole vectors would (the ideal harness: 45-50 s either way against one server's
100-130 s).

Each tracking node i keeps a public copy h_i of its replica, of which every member it pushes
to holds an identical copy, and a copy h_j of each member j that pushes to it. After a local
step:

1. push: q = sign(x_i - h_i) scaled per bucket (the `sign` codec; an epoch's first push
   is x_i in int8, h_i starting at zero), h_i += q (decoded from the
   very bytes sent, so sender and receivers add the same floats); q goes to its targets
   (`TrackPush`, numbered within an epoch), but only once every target acknowledged the last
   (`TrackAck`): the pace follows the slowest target's link instead of queueing behind it.
2. mix: x_i += gamma / (m + 1) * sum_j (h_j - h_i) over the m copies that are warm (at least
   `track_warmup` pushes into their epoch, as h_i must be), fresh (pushed to within
   `STALE_SECONDS`, or `STALE_STEPS` of this node's steps: a sender that dropped this node
   leaves a copy that no longer follows it) and pass the distance guard (the RMS of
   h_j - h_i, judged as averaging snapshots are; each coordinate's term clipped as
   averaging's) -- and only while h_i itself is as fresh
   (this node has targets and pushed within the same bound: a frozen h_i would make every
   mix add x_i's own steps since again, and the replica run away).

Copies start with their sender's epoch: its first push is the replica itself in int8 (a
scale per 256 values; 1 byte a coordinate, once an epoch), and the sign pushes after it close
the rounding left and follow the steps (a sign from zero converges slowly where a bucket's
values differ widely). A copy is mixed after `track_warmup` pushes. A push
that does not follow the copy held (a missed one; the runtime posts them one after another,
so only a failure misses one) drops that copy and is answered `reset`; a receiver without
room for another copy (at most k) answers `refused`, and one that cannot parse it refuses
it. Either way, and when an ack does not come by its give-up time (averaging's, but at most
`GIVE_UP_MIN` seconds or `GIVE_UP_STEPS` steps: while a push waits, none goes out), the
sender stops pushing to that member for `COOLDOWN` seconds.
Taking a new target on starts a new epoch (h_i = 0; every receiver starts its copy again), at
most every `RESTART_SECONDS`, and only while no push awaits an ack. Targets are fast partners
(peers.fast_partners) for `STEADY` seconds on end, and stop being targets when they have
not been fast for as long (dropping one restarts nothing; observed rates are noisy).

Extra memory: h_i and k copies, float32 (4 (k + 1) bytes a parameter), only on a node that
tracks; meant for the wired servers of a fleet, whose memory is not the Pis' budget. A copy
is allocated when its sender's first push is taken, h_i when the first target is.

Pure: no I/O, no clock (times are passed in); randomness from the generator given.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ptrain.codecs import CodecError, make_codec
from p2ptrain.codecs.wire import (
    HEADER_SIZE,
    Origin,
    chunk_bounds,
    encode_chunk,
    message_size,
    parse_message,
)
from p2ptrain.proto.gossip.guard import DistanceGuard
from p2ptrain.proto.gossip.messages import (
    MAX_CHUNKS,
    TRACK_OK,
    TRACK_REFUSED,
    TRACK_RESET,
    TrackAck,
    TrackPush,
)
from p2ptrain.proto.gossip.peers import fast_partners
from p2ptrain.proto.messages import Out

BUCKET = 1024  # coordinates per scale of the sign codec
COOLDOWN = 30.0  # s a member that refused, reset or did not answer is not pushed to
RESTART_SECONDS = 3.0  # s between new epochs at least
GIVE_UP_MIN = 10.0  # s a push part waits for its ack at least (then as averaging's give-up,
GIVE_UP_STEPS = 40  # at most this many of the node's steps if that is longer)
STALE_SECONDS = 1.0  # a copy not pushed to for this long (or STALE_STEPS steps) is not mixed
STALE_STEPS = 4
STEADY = 5.0  # s a member must be (or not be) among the fastest to be taken on (dropped)
# a copy moves a coordinate at most this many times the copy's RMS distance (averaging
# clips at a multiple of the median |difference| since session 30: spread.py)
PEAK_RATIO = 128.0
PART_BYTES = 48 << 20  # a push's message carries chunks up to this many bytes
MAX_EPOCH = 2**53


@dataclass(slots=True)
class Copy:
    """What this node holds of a member that pushes to it."""

    epoch: int
    seq: int  # the last push applied (whole or in part)
    next_part: int  # the part of push `seq` expected next (0: `seq` is complete)
    vec: np.ndarray  # the copy, float32
    heard: float  # when its last push came


class Tracker:
    """A node's public copy, its targets and the copies it holds; see the module docstring."""

    def __init__(self, n: int, k: int, gamma: float, warmup: int, guard: DistanceGuard,
                 rng: np.random.Generator, chunk_elems: int, stats: Counter[str]):
        self.n, self.k, self.gamma, self.warmup = int(n), int(k), float(gamma), int(warmup)
        self.guard, self.rng, self.chunk_elems = guard, rng, int(chunk_elems)
        self.codec = make_codec("sign", bucket=BUCKET)
        self.first_codec = make_codec("int8")  # an epoch's first push: the replica itself
        self.bounds = chunk_bounds(self.n, self.chunk_elems)
        # (chunks a part, parts) of an epoch's first push (int8) and of a sign push: each as
        # few parts as fit the wire's bulk tail -- every part waits for the last one's ack,
        # and at 100M the int8 push takes 3 parts where a sign push fits one
        self.layouts = (self._layout(self.first_codec), self._layout(self.codec))
        self.own: np.ndarray | None = None  # h_i
        self.epoch, self.seq = 0, 0  # 0: no epoch yet
        self.restarted = -math.inf
        self.pushed_at = -math.inf  # when h_i last moved (a push went out)
        self.step_seconds = 0.0
        self.targets: dict[str, str] = {}  # member -> addr
        self.cursor: dict[str, tuple[int, float]] = {}  # target -> (part awaited, give-up)
        self.outgoing: list[TrackPush] = []  # the parts of push `seq`
        self.cool: dict[str, float] = {}  # member -> until when it is not pushed to
        self.since: dict[str, float] = {}  # fast member -> since when, on end
        self.left: dict[str, float] = {}  # member no longer fast -> since when
        self.copies: dict[str, Copy] = {}
        self.stats = stats  # the trainer's counters
        self.distance: float | None = None  # RMS of h_j - h_i, the last mixed copies' mean

    def _layout(self, codec) -> tuple[int, int]:
        per = max(1, min(MAX_CHUNKS, PART_BYTES // max(1, message_size(codec,
                                                                       self.bounds[0][1]))))
        return per, math.ceil(len(self.bounds) / per)

    def layout(self, seq: int) -> tuple[int, int]:
        """(chunks a part, parts) of push `seq` of an epoch."""
        return self.layouts[seq > 1]

    # -- the sender ----------------------------------------------------------------------------

    def _pick(self, now: float, fast: Sequence[tuple[str, str]], can_add: bool) -> bool:
        """Targets: members fast for `STEADY` seconds on end, dropped once they have not
        been for as long (observed rates are noisy). One is taken on only when `can_add`
        (no push awaits an ack: a new target needs a new epoch, which starts at once).
        True when one was taken on."""
        addrs = dict(fast)
        for peer in addrs:
            self.since.setdefault(peer, now)
        for peer in [p for p in self.since if p not in addrs]:
            del self.since[peer]
            self.left.setdefault(peer, now)
        for peer in [p for p in self.left if p in addrs]:
            del self.left[peer]
        for peer in [p for p in self.targets if now - self.left.get(p, now) >= STEADY]:
            self._drop(now, peer, "track_target_left", cool=False)
        self.left = {p: t for p, t in self.left.items() if now - t < STEADY}
        if (not can_add or len(self.targets) >= self.k
                or now - self.restarted < RESTART_SECONDS):
            return False
        added = False
        for peer, since in sorted(self.since.items(), key=lambda item: item[1]):
            if len(self.targets) >= self.k:
                break
            if (peer not in self.targets and now - since >= STEADY
                    and self.cool.get(peer, -math.inf) <= now):
                self.targets[peer] = addrs[peer]
                added = True
        return added

    def _drop(self, now: float, peer: str, why: str, cool: bool = True) -> None:
        self.targets.pop(peer, None)
        self.cursor.pop(peer, None)
        if cool:
            self.cool[peer] = now + COOLDOWN
            if len(self.cool) > 4096:
                self.cool = {p: t for p, t in self.cool.items() if t > now}
        self.stats[why] += 1

    def after_step(self, now: float, params: np.ndarray, fast: Sequence[tuple[str, str]],
                   sender: bytes, swarm: int, give_up: Callable[[str, int], float],
                   out: list[Out], step_seconds: float = 0.0) -> None:
        """After a local step (`step_seconds`: how long this node's steps take, 0: unknown):
        push if every target acknowledged the last push, then mix."""
        self.step_seconds = step_seconds
        if self._pick(now, fast, not self.cursor):
            self._new_epoch(now)
        if self.targets and not self.cursor and self.own is not None:
            self._push(now, params, sender, swarm, give_up, out)
        elif self.cursor:
            self.stats["track_push_waited"] += 1
        self.mix(now, params)

    def _new_epoch(self, now: float) -> None:
        if self.own is None:
            self.own = np.zeros(self.n, np.float32)
        else:
            self.own.fill(0.0)
        self.epoch = int(self.rng.integers(1, MAX_EPOCH))
        self.seq = 0
        self.restarted = now
        self.stats["track_epochs"] += 1

    def _push(self, now: float, params: np.ndarray, sender: bytes, swarm: int,
              give_up: Callable[[str, int], float], out: list[Out]) -> None:
        self.seq += 1
        self.pushed_at = now
        own, codec = self.own, self.codec if self.seq > 1 else self.first_codec
        header = Origin(sender, swarm, 1.0)
        chunks: list[bytes] = []
        for index, (offset, length) in enumerate(self.bounds):
            end = offset + length
            diff = params[offset:end] - own[offset:end]
            msg = encode_chunk(codec, diff, header, self.n, offset, index, len(self.bounds),
                               0)
            payload = memoryview(msg)[HEADER_SIZE: HEADER_SIZE + codec.encoded_size(length)]
            codec.decode_into(payload, own[offset:end], 1.0, 0)  # h_i += q, as receivers do
            chunks.append(bytes(msg))
        per, parts = self.layout(self.seq)
        self.outgoing = [TrackPush(self.epoch, self.seq, tuple(chunks[i * per:(i + 1) * per]),
                                   i, parts) for i in range(parts)]
        for peer, addr in self.targets.items():
            self._send(now, peer, addr, 0, give_up, out)
        self.stats["track_pushes"] += 1

    def _send(self, now: float, peer: str, addr: str, part: int,
              give_up: Callable[[str, int], float], out: list[Out]) -> None:
        body = self.outgoing[part]
        size = sum(len(c) for c in body.chunks)
        wait = max(GIVE_UP_MIN, GIVE_UP_STEPS * self.step_seconds)  # a silent target stalls
        self.cursor[peer] = (part, now + min(give_up(peer, size), wait))  # every push this long
        self.stats["track_bytes_sent"] += size
        out.append(Out(peer, addr, body))

    def on_ack(self, now: float, peer: str, ack: TrackAck,
               give_up: Callable[[str, int], float], out: list[Out]) -> None:
        """A target's answer: its next part, or done; a `reset`/`refused` drops it."""
        awaited = self.cursor.get(peer)
        if (awaited is None or ack.epoch != self.epoch or ack.seq != self.seq
                or ack.part != awaited[0]):
            self.stats["track_ack_late"] += 1
            return
        if ack.status != TRACK_OK:
            self._drop(now, peer, f"track_{ack.status}")
            return
        if ack.part + 1 < len(self.outgoing):
            self._send(now, peer, self.targets[peer], ack.part + 1, give_up, out)
        else:
            del self.cursor[peer]

    def next_deadline(self) -> float | None:
        return min((t for _, t in self.cursor.values()), default=None)

    def tick(self, now: float) -> None:
        for peer in [p for p, (_, t) in self.cursor.items() if t <= now]:
            self._drop(now, peer, "track_timeout")

    # -- the receiver --------------------------------------------------------------------------

    def parse(self, sender: str, body: TrackPush) -> list:
        """The push's chunks parsed and checked against this model and `sender` (raw id in
        every chunk, the sign codec, the chunk geometry of this part); CodecError names the
        first defect and nothing changes. Payloads are validated as they are decoded."""
        raw = bytes.fromhex(sender)
        per, parts = self.layout(body.seq)
        if body.parts != parts:
            raise CodecError(f"tracking push {body.seq} in {body.parts} parts, this model's "
                             f"in {parts}")
        first = body.part * per
        want = self.bounds[first:first + per]
        if len(body.chunks) != len(want):
            raise CodecError(f"tracking part has {len(body.chunks)} chunks, expected "
                             f"{len(want)}")
        parsed = [parse_message(c) for c in body.chunks]
        codec = self.codec if body.seq > 1 else self.first_codec
        for i, (msg, (offset, length)) in enumerate(zip(parsed, want, strict=True)):
            if (msg.vector_length != self.n or msg.sender_id != raw
                    or msg.codec != codec or msg.chunk_index != first + i
                    or msg.chunk_offset != offset or msg.chunk_length != length):
                raise CodecError("tracking chunk does not match this model, its sender or "
                                 "its place")
        return parsed

    def on_push(self, now: float, sender: str, body: TrackPush, parsed: list,
                training: bool) -> str:
        """Apply a push `parse` accepted to `sender`'s copy; the ack's status."""
        copy = self.copies.get(sender)
        if not training:
            return TRACK_REFUSED
        new_epoch = body.seq == 1 and body.part == 0
        if copy is not None and copy.epoch == body.epoch and (  # the push's next part (not
                (body.seq == copy.seq and body.part == copy.next_part != 0)  # a done one again)
                or (body.seq == copy.seq + 1 and body.part == 0 and copy.next_part == 0)):
            pass
        elif new_epoch and (copy is not None or self._room(now)):
            vec = copy.vec if copy is not None else np.zeros(self.n, np.float32)
            vec.fill(0.0)
            copy = self.copies[sender] = Copy(body.epoch, 0, 0, vec, now)
            self.stats["track_copies_started"] += 1
        elif copy is None and not new_epoch:
            return TRACK_RESET
        elif copy is None:
            return TRACK_REFUSED
        else:
            del self.copies[sender]
            self.stats["track_copies_reset"] += 1
            return TRACK_RESET
        try:
            for msg in parsed:  # each payload validated before it writes its chunk
                msg.decode_into(copy.vec, 1.0)
        except CodecError:
            del self.copies[sender]  # partly applied: no longer the sender's copy
            raise
        copy.seq, copy.heard = body.seq, now
        copy.next_part = (body.part + 1) % body.parts
        self.stats["track_parts_applied"] += 1
        return TRACK_OK

    def _room(self, now: float) -> bool:
        """Room for another copy, after forgetting those not heard from for `COOLDOWN`."""
        for peer in [p for p, c in self.copies.items() if now - c.heard > COOLDOWN]:
            del self.copies[peer]
            self.stats["track_copies_forgotten"] += 1
        return len(self.copies) < self.k

    # -- the mix ---------------------------------------------------------------------------------

    def mix(self, now: float, params: np.ndarray) -> None:
        """x_i += gamma / (m + 1) * sum_j (h_j - h_i) over the warm copies the guard passes."""
        own = self.own
        if own is None or self.seq < self.warmup:
            return
        fresh = max(STALE_SECONDS, STALE_STEPS * self.step_seconds)
        if not self.targets or now - self.pushed_at > fresh:
            # h_i no longer follows x_i (no targets, or a push awaiting its ack past the
            # staleness bound): each mix's h_j - h_i would carry x_i's own steps since, and
            # the sum of them runs the replica away
            self.stats["track_own_stale"] += 1
            return
        warm = [(p, c) for p, c in self.copies.items()  # a sender that stopped pushing
                if c.seq >= self.warmup and c.next_part == 0 and now - c.heard <= fresh]
        chosen, distances = [], []
        for peer, copy in warm:
            d = self._rms(copy.vec, own)
            if self.guard.judge(peer, d) is None:
                chosen.append((copy, np.float32(PEAK_RATIO * d)))
                distances.append(d)
                self.guard.applied(peer, d)
            else:
                self.stats["track_too_far"] += 1  # (the distance guard)
        if not chosen:
            return
        w = np.float32(self.gamma / (len(chosen) + 1))
        for offset, length in self.bounds:  # a chunk at a time: no vector-sized temporaries
            end = offset + length
            h = own[offset:end]
            for copy, peak in chosen:
                diff = copy.vec[offset:end] - h
                np.clip(diff, -peak, peak, out=diff)  # as averaging: no spike on a few
                diff *= w
                params[offset:end] += diff
        self.distance = float(np.mean(distances))
        self.stats["track_mixes"] += 1

    def _rms(self, a: np.ndarray, b: np.ndarray) -> float:
        total = 0.0
        for offset, length in self.bounds:
            diff = a[offset:offset + length] - b[offset:offset + length]
            total += float(np.dot(diff, diff))
        return math.sqrt(total / max(1, self.n))

    def close(self) -> None:
        self.targets.clear()
        self.cursor.clear()
        self.outgoing = []
        self.copies.clear()
        self.own = None


def track_step(trainer: Any, now: float, partners: Sequence[tuple[str, str]],
               out: list[Out]) -> None:
    """A GossipTrainer's (`trainer`) tracking after its local step: targets among its fast
    `partners`; its step time is its batch over its observed sample rate."""
    rate_of, learner = trainer.rate_of, trainer.learner
    own = rate_of(trainer.node_id) if rate_of is not None else None
    fast = fast_partners(trainer.node_id, partners, rate_of) if own else []
    trainer.tracker.after_step(now, learner.params, fast, trainer.sender, learner.count.total,
                               trainer.give_up_seconds, out, learner.batch / own if own else 0.0)
