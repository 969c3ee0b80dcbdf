"""Pieces shared by the built-in models: cross-entropy with its gradient."""

from __future__ import annotations

import numpy as np


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of (N, V) logits against (N,) targets, and d(loss)/d(logits).

    The gradient is written over a softmax computed in place of a copy of `logits`."""
    n = logits.shape[0]
    probs = logits - logits.max(axis=1, keepdims=True)  # (N, V)
    np.exp(probs, out=probs)
    sums = probs.sum(axis=1, keepdims=True)  # (N, 1)
    probs /= sums
    rows = np.arange(n)
    picked = probs[rows, targets]
    loss = float(-np.log(np.maximum(picked, np.finfo(probs.dtype).tiny)).mean())
    probs[rows, targets] -= 1.0
    probs *= 1.0 / n
    return loss, probs


def cross_entropy_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean cross-entropy only (no gradient), computed stably with log-sum-exp."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    return float((log_z - shifted[np.arange(logits.shape[0]), targets]).mean())
