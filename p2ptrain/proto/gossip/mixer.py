"""The sender's gradient encoder and the receiver's mixing of peer gradients into its own
(`GradientMixer`): step 3 of DESIGN.md's training algorithm. The knobs are in config.py.

What waits between two steps: the *encoded chunk messages* of each peer gradient, not decoded
vectors and not a running sum. A topk-1% gradient is ~4% of a float32 vector on the wire, so
keeping messages costs far less than one dense buffer per peer, and -- unlike a sum built on
arrival -- it lets staleness be judged when the gradient is used: a message that waited too
long is simply not decoded. The queue is bounded both in vectors and in bytes. At `mix` every
pending complete vector is used or dropped, and the own gradient is mixed *in place*, so the
mixer never holds a buffer of the model's size (only one chunk-sized scratch for norms).

Staleness is counted in swarm samples: receiver's swarm count at use minus the sender's count
when it computed the gradient (carried by every message). A sender whose count is ahead of the
receiver's (its view has not reached us yet) is aged from the gradient's arrival instead, so
every message expires after at most the bound's worth of the receiver's progress. The bound is
set in seconds (`max_staleness_seconds`) and converted to samples with the swarm's sample rate
as this node sees it (`SwarmRate`: its swarm count's growth over its recent steps), so one
setting means the same on a 1M and a 1B model; never less than two of the node's own steps (a
node whose step is longer than the bound can still use what arrived during it). Until two
steps are measured nothing is dropped as stale. The deprecated `max_staleness_samples` > 0
replaces it with a fixed count, as before.

Clipping: each peer gradient is scaled down to `clip_multiple` times a reference norm: the
median of a small window of recent own and peer norms, bounded by the own ones (norms.py). A
norm that is not finite, above `max_norm`, or above `absurd_norm_multiple` times the
reference is refused (on arrival once an own norm is known, and again at the mix). Weights:
a peer's vector counts for its claimed samples, but at most WEIGHT_SPREAD times the own
weight, times how much faster the membership sees it train (`weight_cap`): one member's
claim cannot outweigh a whole mix.

This file never sends anything, never reads the clock, never draws random numbers and never
does I/O. Not thread-safe: call `receive` and `mix` from one thread (the protocol loop).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ptrain.codecs import (
    DEFAULT_CHUNK,
    Codec,
    CodecError,
    ErrorFeedback,
    Message,
    encode_vector,
    parse_message,
)
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.norms import NormWindow
from p2ptrain.proto.gossip.swarmrate import SwarmRate

STEP_FLOOR = 2  # the staleness bound never drops below this many of the node's own steps
WEIGHT_SPREAD = 4.0  # a peer's weight counts up to this times the own (see `weight_cap`)
# What a held chunk costs besides its payload: its message, codec and table entry (~930 bytes
# measured). Counted against queue_bytes, so a peer's 1-element chunks cannot hold 89 million
# messages (~80 GB) under a bound meant for payloads.
CHUNK_OVERHEAD = 1024
# The longest chunk a peer's gradient may come in, elements (node.chunk_elems' maximum): its
# norm is computed over a decoded copy of that size, kept (64 MiB at most).
MAX_PEER_CHUNK = 1 << 24


class PlainEncoder:
    """The codec without a residual, with `ErrorFeedback.encode_vector`'s signature."""

    def __init__(self, codec: Codec):
        self.codec = codec

    def encode_vector(self, x: np.ndarray, *, sender_id: bytes, swarm_samples: int,
                      weight: float, seed: int,
                      chunk_elems: int = DEFAULT_CHUNK) -> Iterator[bytearray]:
        return encode_vector(self.codec, x, sender_id=sender_id, swarm_samples=swarm_samples,
                             weight=weight, seed=seed, chunk_elems=chunk_elems)


def gradient_encoder(config: GossipConfig, n: int,
                     residual: np.ndarray | None = None) -> ErrorFeedback | PlainEncoder:
    """The sender's encoder for n-element gradients: error feedback when the config asks for
    it and the codec is biased (`residual` restores a saved one), else the plain codec."""
    codec = config.make_codec()
    if config.uses_error_feedback:
        return ErrorFeedback(codec, n, residual)
    return PlainEncoder(codec)


class Arrival(enum.Enum):
    """What `GradientMixer.receive` did with an acceptable message."""

    PENDING = "pending"  # kept; its vector still misses chunks
    COMPLETE = "complete"  # kept; its vector is whole and will be mixed at the next step
    STALE = "stale"  # dropped: too old already
    FULL = "full"  # dropped: no room (this one, or its vector, lost to the queue bound)


@dataclass(frozen=True, slots=True)
class PeerGradient:
    """One peer gradient a mix used."""

    sender: bytes  # raw 16-byte node id from the message header
    swarm_samples: int  # sender's swarm count when it computed the gradient
    weight: float  # samples the gradient averages over
    norm: float  # its L2 norm as received
    scale: float  # clip factor applied (1.0 = not clipped)
    staleness: int  # swarm samples between its computation and its use


@dataclass(frozen=True, slots=True)
class MixReport:
    """What one `GradientMixer.mix` did."""

    own_norm: float  # L2 norm of the own gradient before mixing
    clip_norm: float  # peer gradients were clipped to this norm
    total_weight: float  # own weight + peer weights: the samples the mixed gradient covers
    peers: tuple[PeerGradient, ...]  # the peer gradients mixed in, in arrival order
    dropped_stale: int  # complete vectors dropped as too old at this mix
    dropped_incomplete: int  # vectors dropped because their missing chunks never came in time
    pending: int  # incomplete vectors kept for the next mix
    max_staleness: float = math.inf  # the staleness bound of this mix, swarm samples

    @property
    def senders(self) -> frozenset[bytes]:
        return frozenset(p.sender for p in self.peers)


def _nominal(m: Message) -> int:
    """The nominal chunk length of the tiling a chunk belongs to (the wire checks that each
    chunk belongs to *some* tiling; chunks of one vector must belong to the same one, or
    some coordinates would be covered twice)."""
    if m.chunk_count > 1 and m.chunk_index == m.chunk_count - 1:
        return m.chunk_offset // (m.chunk_count - 1)
    return m.chunk_length


class _Pending:
    """One peer gradient waiting: its chunk messages so far and what they add up to."""

    __slots__ = ("sender", "sender_samples", "origin", "weight", "codec", "chunk_count",
                 "nominal", "chunks", "sq_norm", "nbytes", "seq")

    def __init__(self, msg: Message, receiver_samples: int, seq: int):
        self.sender = msg.sender_id
        self.sender_samples = msg.swarm_samples
        # Receiver-side time of computation: a sender ahead of us is aged from arrival.
        self.origin = min(msg.swarm_samples, receiver_samples)
        self.weight = msg.weight
        self.codec = msg.codec
        self.chunk_count = msg.chunk_count
        self.nominal = _nominal(msg)  # the chunk size its tiling was made with
        self.chunks: dict[int, Message] = {}
        self.sq_norm = 0.0
        self.nbytes = 0
        self.seq = seq  # arrival order: deterministic tie-breaks

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.chunk_count

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm)


class GradientMixer:
    """The inbound queue of peer gradients and the weighted mix into the own gradient, for
    gradients of n elements."""

    def __init__(self, config: GossipConfig, n: int, me: str = ""):
        self.config = config
        self.n = int(n)
        self.me = me  # own node id (hex), for `rate_of`
        self.codec = config.make_codec()  # the swarm's: what the trainer admits
        # samples/s each node is seen to train at (the membership's): bounds a peer's weight
        self.rate_of: Callable[[str], float | None] | None = None
        self._pending: dict[tuple[bytes, int], _Pending] = {}
        self._bytes = 0  # wire bytes held by _pending
        self._seq = 0
        self.window = NormWindow(config.norm_window, config.absurd_norm_multiple,
                                 config.max_norm)
        self._scratch = np.zeros(0, np.float32)  # chunk-sized, for norms of dense payloads
        self.drops: Counter[str] = Counter()  # stale, full, incomplete, malformed, norm
        self.used: Counter[bytes] = Counter()  # peer gradients mixed in, per sender
        self.mixes = 0  # calls to mix
        self.rate = SwarmRate()  # the swarm's samples/s: converts the staleness bound

    def observe(self, now: float, swarm_samples: int) -> None:
        """A step boundary at `now` with the swarm count `swarm_samples` (before `mix`)."""
        self.rate.observe(now, swarm_samples)

    @property
    def max_staleness(self) -> float:
        """The staleness bound now, in swarm samples (inf: none yet)."""
        cfg = self.config
        if cfg.max_staleness_samples > 0:
            return float(cfg.max_staleness_samples)
        rate, step = self.rate.samples_per_second, self.rate.step_seconds
        if rate is None or step is None:
            return math.inf
        return rate * max(cfg.max_staleness_seconds, STEP_FLOOR * step)

    # -- arrival ----------------------------------------------------------------------------

    def admit(self, msg: Any, sender: bytes | None = None) -> tuple[Message, float]:
        """Every check `receive` makes, changing nothing but the drop counters (and dropping
        a vector whose last chunk makes its total norm absurd, whole): the parsed
        chunk and its squared norm, or CodecError (malformed or norm) if the peer misbehaved:
        framing, (from a peer, `sender` its id:) another codec than the swarm's, checked
        before decoding, or another sender, payload, non-finite values, wrong vector length,
        bad weight, a duplicate or inconsistent chunk, an absurd chunk norm, or a last chunk
        that makes its vector's total norm absurd. Call it before anything else of the message
        is acted on."""
        try:
            message = msg if isinstance(msg, Message) else parse_message(msg)
            if sender is not None:  # a peer's: the swarm's codec, before any decoding
                if message.codec != self.codec:
                    raise CodecError(f"gradient in {message.codec.name}: the swarm's "
                                     f"gradients are in {self.codec.name}")
                if message.sender_id != sender:
                    raise CodecError("gradient chunk names another sender than the message")
            entry = self._pending.get((message.sender_id, message.swarm_samples))
            self._check_header(message, entry)
            sq = self._chunk_sq_norm(message)
        except CodecError:
            self.drops["malformed"] += 1
            raise
        self._check_norm(math.sqrt(sq) if math.isfinite(sq) else math.inf)
        if entry is not None and len(entry.chunks) + 1 == entry.chunk_count:
            try:
                self._check_norm(math.sqrt(entry.sq_norm + sq))
            except CodecError:  # the whole vector is absurd: its earlier chunks go too
                self._remove((message.sender_id, message.swarm_samples))
                raise
        return message, sq

    def receive(self, msg: Any, swarm_samples: int,
                admitted: tuple[Message, float] | None = None) -> Arrival:
        """Take one chunk message of a peer gradient; `swarm_samples` is the receiver's swarm
        count now; `admitted` is `admit(msg)`'s result when the caller checked it already
        (nothing may have changed the mixer since). CodecError as for `admit`; a refused
        chunk leaves the queue as it was. The mixer keeps a reference to the message until
        its vector is used or dropped."""
        message, sq = admitted if admitted is not None else self.admit(msg)
        key = (message.sender_id, message.swarm_samples)
        entry = self._pending.get(key)
        size = int(message.payload.nbytes) + CHUNK_OVERHEAD
        if entry is None and message.chunk_count * CHUNK_OVERHEAD > self.config.queue_bytes:
            self.drops["full"] += 1  # can never fit: refused before it evicts anything
            return Arrival.FULL
        if entry is None:
            entry = _Pending(message, swarm_samples, self._seq)
            self._seq += 1
            if swarm_samples - entry.origin > self.max_staleness:
                self.drops["stale"] += 1
                return Arrival.STALE
        if not self._make_room(entry, size):
            return Arrival.FULL
        self._pending[key] = entry
        entry.chunks[message.chunk_index] = message
        entry.sq_norm += sq
        entry.nbytes += size
        self._bytes += size
        if not entry.complete:
            return Arrival.PENDING
        try:
            self._check_norm(entry.norm)
        except CodecError:
            self._remove(key)
            raise
        self.window.add_peer(entry.sender, entry.norm)
        return Arrival.COMPLETE

    def _check_header(self, m: Message, entry: _Pending | None) -> None:
        if m.vector_length != self.n:
            raise CodecError(f"gradient has {m.vector_length} elements, the model {self.n}")
        if m.chunk_length > MAX_PEER_CHUNK:
            raise CodecError(f"gradient chunk of {m.chunk_length} elements: at most "
                             f"{MAX_PEER_CHUNK} are accepted")
        if not 0.0 < m.weight <= self.config.max_sample_weight:
            raise CodecError(f"sample weight {m.weight} outside (0, "
                             f"{self.config.max_sample_weight:g}]")
        if entry is None:
            return
        if (m.codec != entry.codec or m.weight != entry.weight
                or m.chunk_count != entry.chunk_count or _nominal(m) != entry.nominal):
            raise CodecError("chunk disagrees with earlier chunks of the same gradient")
        if m.chunk_index in entry.chunks:
            raise CodecError(f"duplicate chunk {m.chunk_index} of one gradient")

    def _chunk_sq_norm(self, m: Message) -> float:
        """Squared norm of the chunk, validating its payload, without allocating per call."""
        if type(m.codec).sq_norm is not Codec.sq_norm:  # the codec computes it cheaply
            return m.sq_norm()
        if self._scratch.shape[0] < m.chunk_length:
            self._scratch = np.zeros(m.chunk_length, np.float32)
        s = self._scratch[: m.chunk_length]
        s.fill(0.0)
        m.codec.decode_into(m.payload, s, 1.0, m.seed)
        with np.errstate(over="ignore", invalid="ignore"):
            return float(np.dot(s, s))

    def _check_norm(self, norm: float) -> None:
        limit = self.window.limit()
        if not norm <= limit:  # also catches NaN
            self.drops["norm"] += 1
            raise CodecError(f"gradient norm {norm:.4g} is absurd (limit {limit:.4g})")

    # -- the queue bound ---------------------------------------------------------------------

    def _make_room(self, entry: _Pending, extra: int) -> bool:
        """Evict until `entry` (new or held) fits with `extra` more bytes; False if `entry`
        itself loses. The victim is the oldest gradient of the sender holding the most
        entries (the oldest of all when each sender holds one): a fast sender cannot starve a
        slow one, and fresher gradients win."""
        cfg = self.config
        while True:
            held = [e for e in self._pending.values() if e is not entry]
            if len(held) + 1 <= cfg.queue_vectors and self._bytes + extra <= cfg.queue_bytes:
                return True
            by_sender: dict[bytes, list[_Pending]] = {}
            for e in [*held, entry]:
                by_sender.setdefault(e.sender, []).append(e)
            sender = max(by_sender, key=lambda s: (
                len(by_sender[s]), -min(e.origin for e in by_sender[s]), s))
            victim = min(by_sender[sender], key=lambda e: (e.origin, e.seq))
            self.drops["full"] += 1
            if victim is entry:
                self._remove((entry.sender, entry.sender_samples))
                return False
            self._remove((victim.sender, victim.sender_samples))

    def _remove(self, key: tuple[bytes, int]) -> None:
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    # -- use ---------------------------------------------------------------------------------

    def mix(self, grad: np.ndarray, weight: float, swarm_samples: int) -> MixReport:
        """grad <- (weight * grad + sum_i w_i * c_i * g_i) / (weight + sum_i w_i), in place,
        over the pending complete peer gradients g_i (w_i their sample weights, c_i <= 1 their
        clip factors) that are not staler than `max_staleness` at the receiver's swarm
        count `swarm_samples`. Every complete or stale vector leaves the queue."""
        if (not isinstance(grad, np.ndarray) or grad.dtype != np.float32
                or grad.shape != (self.n,) or not grad.flags.c_contiguous):
            raise TypeError(f"grad must be a contiguous float32 array of shape ({self.n},)")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"own weight must be finite and > 0, got {weight}")
        own_norm = math.sqrt(float(np.dot(grad, grad)))
        if not math.isfinite(own_norm):
            raise ValueError("own gradient is not finite")
        self.window.add_own(own_norm)
        clip_norm = self.config.clip_multiple * self.window.reference()
        limit = self.window.limit()  # an own norm known now: arrivals before it went unjudged
        used: list[tuple[_Pending, int]] = []
        stale = incomplete = 0
        bound = self.max_staleness
        for key, entry in list(self._pending.items()):
            age = max(0, swarm_samples - entry.origin)
            if age > bound:
                stale += entry.complete
                incomplete += not entry.complete
                self._remove(key)
            elif entry.complete:
                self._remove(key)
                if entry.norm <= limit:
                    used.append((entry, age))
                else:
                    self.drops["norm"] += 1
        self.drops["stale"] += stale
        self.drops["incomplete"] += incomplete
        weights = [min(entry.weight, self.weight_cap(weight, entry.sender)) for entry, _ in used]
        total = weight + sum(weights)
        peers = []
        if used:
            grad *= np.float32(weight / total)
        for (entry, age), w in zip(used, weights, strict=True):
            norm = entry.norm
            scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
            for index in sorted(entry.chunks):
                entry.chunks[index].decode_into(grad, w * scale / total)
            self.used[entry.sender] += 1
            peers.append(PeerGradient(entry.sender, entry.sender_samples, w,
                                      norm, scale, age))
        self.mixes += 1
        return MixReport(own_norm, clip_norm, total, tuple(peers), stale, incomplete,
                         len(self._pending), bound)

    def weight_cap(self, own: float, sender: bytes) -> float:
        """The most sample weight a peer's vector counts for: WEIGHT_SPREAD times the own
        weight, times how much faster than this node the peer is seen to train (an honest big
        batch is a fast node's; a slow node given a big `--batch` is counted low). A claimed
        weight alone -- up to max_sample_weight -- let one member outweigh a whole mix."""
        ratio = 1.0
        rate_of = self.rate_of
        if rate_of is not None:
            mine, theirs = rate_of(self.me), rate_of(sender.hex())
            if mine and theirs:
                ratio = max(1.0, theirs / mine)
        return WEIGHT_SPREAD * own * ratio

    # -- inspection --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Peer gradients waiting (complete or not)."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def norms(self) -> tuple[float, ...]:
        """The norms the reference is the median of (norms.py)."""
        return self.window.norms

    def clear(self) -> None:
        """Forget every waiting gradient (e.g. after the replica was replaced); not counted
        as drops. The sample rate starts afresh (the swarm count may have jumped)."""
        self._pending.clear()
        self._bytes = 0
        self.rate.clear()
