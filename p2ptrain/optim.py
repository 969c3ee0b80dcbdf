"""AdamW on flat buffers, its learning-rate schedule, and global-norm clipping.

The schedule is a function of a *sample count* (the swarm-wide count once nodes gossip), not
of a step number: a Pi and a server take steps of very different sizes, and a node that joins
late must not restart warm-up. Everything here is pure: no clock, no I/O, no global random.
All work is done in place on preallocated buffers (fresh large allocations are slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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


def decay_mask(space: ParamSpace, dtype=np.float32) -> np.ndarray:
    """1 for matrices (weight decay applies), 0 for vectors (norms, biases, decays) and padding."""
    mask = space.zeros(dtype)
    for slot in space:
        if len(slot.shape) >= 2:
            mask[slot.offset : slot.offset + slot.size] = 1.0
    return mask


def clip_global_norm(grad: np.ndarray, max_norm: float) -> float:
    """Scale `grad` in place so its L2 norm is at most `max_norm`; returns the norm before."""
    norm = float(np.sqrt(np.dot(grad, grad)))
    if max_norm > 0 and norm > max_norm:
        grad *= max_norm / (norm + 1e-12)
    return norm


class AdamW:
    """Decoupled-weight-decay Adam over one flat parameter buffer."""

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
        self._mask = decay_mask(space)
        self._tmp = space.zeros()  # scratch for the update direction
        self._tmp2 = space.zeros()

    def step(self, params: np.ndarray, grad: np.ndarray, lr: float) -> None:
        """params -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * mask * params), in place."""
        b1, b2 = self.beta1, self.beta2
        self.t += 1
        self.m *= b1
        self.m += (1 - b1) * grad
        np.multiply(grad, grad, out=self._tmp)
        self.v *= b2
        self._tmp *= 1 - b2
        self.v += self._tmp
        bc1 = 1 - b1**self.t
        bc2 = 1 - b2**self.t
        np.sqrt(self.v, out=self._tmp)
        self._tmp *= 1.0 / math.sqrt(bc2)
        self._tmp += self.eps
        np.divide(self.m, self._tmp, out=self._tmp)  # direction m / (sqrt(v_hat) + eps)
        self._tmp *= lr / bc1
        if self.weight_decay:
            np.multiply(params, self._mask, out=self._tmp2)
            self._tmp2 *= lr * self.weight_decay
            params -= self._tmp2
        params -= self._tmp

    def reset(self) -> None:
        self.m.fill(0.0)
        self.v.fill(0.0)
        self.t = 0
