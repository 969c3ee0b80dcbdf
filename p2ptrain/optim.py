"""AdamW on flat buffers, its learning-rate schedule, and global-norm clipping.

The schedule is a function of a *sample count* (the swarm-wide count once nodes gossip), not
of a step number: a Pi and a server take steps of very different sizes, and a node that joins
late must not restart warm-up. Everything here is pure: no clock, no I/O, no global random.
All work is done in place on preallocated buffers (fresh large allocations are slow), block
by block, so the optimiser holds nothing of the model's size beyond its two moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2ptrain.codecs.kernels import bf16_bits_to_f32, bit_stream, f32_to_bf16_stochastic
from p2ptrain.owed8 import Owed8
from p2ptrain.params import ParamSpace


@dataclass(frozen=True, slots=True)
class Schedule:
    """Linear warm-up to `peak_lr`, then cosine decay to `peak_lr * min_ratio`."""

    peak_lr: float  # learning rate at the end of warm-up
    warmup_samples: int  # samples of linear warm-up from 0
    total_samples: int  # samples at which the cosine reaches its floor (the run's length)
    min_ratio: float = 0.1  # floor of the decay as a fraction of peak_lr

    def lr(self, samples: float) -> float:
        if self.warmup_samples > 0 and samples < self.warmup_samples:
            return self.peak_lr * (samples + 1) / (self.warmup_samples + 1)
        span = max(self.total_samples - self.warmup_samples, 1)
        progress = min(max((samples - self.warmup_samples) / span, 0.0), 1.0)
        floor = self.peak_lr * self.min_ratio
        return floor + 0.5 * (self.peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def decay_segments(space: ParamSpace) -> list[tuple[int, int, bool]]:
    """The flat buffer as consecutive [start, end) segments, each all matrices (weight decay
    applies: True) or all vectors (norms, biases, decays: False); padding joins the segment
    before it (it stays zero either way)."""
    segments: list[tuple[int, int, bool]] = []
    for slot in space:
        decay = len(slot.shape) >= 2
        if segments and segments[-1][2] == decay:
            segments[-1] = (segments[-1][0], slot.offset + slot.size, decay)
        else:
            if segments:  # close the previous segment at this slot (taking its padding)
                segments[-1] = (segments[-1][0], slot.offset, segments[-1][2])
            segments.append((slot.offset if segments else 0, slot.offset + slot.size, decay))
    if segments:
        segments[-1] = (segments[-1][0], space.size, segments[-1][2])
    return segments


NORM_PIECE = 1 << 20  # coordinates a squared norm is summed over in float32 before float64


def sq_norm(a: np.ndarray) -> float:
    """The squared L2 norm of a float32 vector, summed a piece at a time in float64: BLAS
    sums in float32, 2.2% short over 1.3e9 coordinates (0.5% over 3e8) -- the clip too weak
    and the reported norm too low at 1B. inf if it overflows float32 in a piece."""
    with np.errstate(over="ignore", invalid="ignore"):
        return sum(float(np.dot(p, p)) for p in (a[i : i + NORM_PIECE]
                                                  for i in range(0, a.shape[0], NORM_PIECE)))


def clip_global_norm(grad: np.ndarray, max_norm: float) -> float:
    """Scale `grad` in place so its L2 norm is at most `max_norm`; returns the norm before."""
    norm = math.sqrt(sq_norm(grad))
    if max_norm > 0 and norm > max_norm:
        grad *= max_norm / (norm + 1e-12)
    return norm


class Progress:
    """How far a replica moved since its progress was last shared, per coordinate: the
    decrements of every optimiser step summed, in bfloat16 rounded stochastically (2 bytes a
    parameter; unbiased, so small steps on a large sum neither vanish nor drift). The outer
    optimiser (proto/gossip/outer.py) shares and removes parts of it."""

    def __init__(self, n: int, seed: int):
        self.bits = np.zeros(int(n), np.uint16)  # bfloat16 bit patterns, +0.0 to start
        self.stream = bit_stream(seed)  # the rounding's random bits
        self._wide = np.zeros(min(int(n), AdamW.BLOCK), np.float32)

    def add(self, lo: int, delta: np.ndarray) -> None:
        """progress[lo : lo + len(delta)] += delta."""
        hi = lo + delta.shape[0]
        wide = self._wide[: hi - lo]
        bf16_bits_to_f32(self.bits[lo:hi], wide)
        wide += delta
        f32_to_bf16_stochastic(wide, self.bits[lo:hi], self.stream)

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """out[:] = progress[lo:hi] (float32)."""
        bf16_bits_to_f32(self.bits[lo:hi], out)

    def write(self, lo: int, hi: int, src: np.ndarray) -> None:
        """progress[lo:hi] = src, rounded stochastically (src is not changed)."""
        f32_to_bf16_stochastic(src, self.bits[lo:hi], self.stream)

    def values(self) -> np.ndarray:
        """All of it as a new float32 array."""
        out = np.empty(self.bits.shape[0], np.float32)
        bf16_bits_to_f32(self.bits, out)
        return out

    def any(self) -> bool:
        return bool(self.bits.any())

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def reset(self) -> None:
        self.bits.fill(0)


class AdamW:
    """Decoupled-weight-decay Adam over one flat parameter buffer.

    Memory: the two moments and two block-sized scratch arrays, nothing else of the model's
    size -- the update runs block by block (BLOCK elements: the working set stays in cache),
    and weight decay goes by segment instead of through a mask buffer."""

    BLOCK = 1 << 16  # elements per block of the update (2^14..2^18 measured alike)

    def __init__(
        self,
        space: ParamSpace,
        beta1: float = 0.9,  # first-moment decay
        beta2: float = 0.99,  # second-moment decay
        eps: float = 1e-8,  # added to the root of the second moment
        weight_decay: float = 0.01,  # decoupled decay on matrices only
    ):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = space.zeros()  # first moment
        self.v = space.zeros()  # second moment
        self.t = 0  # updates applied (for bias correction)
        self._segments = decay_segments(space)
        block = min(self.BLOCK, max(space.size, 1))
        self._tmp = np.zeros(block, np.float32)  # the update direction of one block
        self._tmp2 = np.zeros(block, np.float32)  # its weight decay

    def step(self, params: np.ndarray, grad: np.ndarray, lr: float,
             progress: Progress | Owed8 | None = None) -> None:
        """params -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * [matrix] * params), in place;
        with `progress`, what params lost is also added to its accumulator."""
        self.t += 1
        bc1 = 1 - self.beta1**self.t
        bc2 = 1 - self.beta2**self.t
        for start, end, decay in self._segments:
            for lo in range(start, end, self.BLOCK):
                hi = min(end, lo + self.BLOCK)
                self._update(params[lo:hi], grad[lo:hi], self.m[lo:hi], self.v[lo:hi],
                             lr, bc1, bc2, decay)
                if progress is not None:
                    n = hi - lo
                    if self.weight_decay and decay:
                        self._tmp[:n] += self._tmp2[:n]
                    progress.add(lo, self._tmp[:n])

    def _update(self, p, g, m, v, lr, bc1, bc2, decay) -> None:
        b1, b2 = self.beta1, self.beta2
        tmp, tmp2 = self._tmp[: p.shape[0]], self._tmp2[: p.shape[0]]
        m *= b1
        np.multiply(g, 1 - b1, out=tmp)
        m += tmp
        np.multiply(g, g, out=tmp)
        v *= b2
        tmp *= 1 - b2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp *= 1.0 / math.sqrt(bc2)
        tmp += self.eps
        np.divide(m, tmp, out=tmp)  # direction m / (sqrt(v_hat) + eps)
        tmp *= lr / bc1
        if self.weight_decay and decay:
            np.multiply(p, lr * self.weight_decay, out=tmp2)
            p -= tmp2
        p -= tmp

    def reset(self) -> None:
        self.m.fill(0.0)
        self.v.fill(0.0)
        self.t = 0
