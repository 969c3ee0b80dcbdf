"""Which training windows a node reads, in which order, and where it stands.

A node walks the training split in epochs. Each epoch it shifts a grid of window starts by a
random offset and permutes it, both drawn from a generator seeded by (shard seed, epoch); the
shard seed comes from the node id through xxhash, so two nodes read the same data in
unrelated orders and do not repeat each other's samples. The position -- (epoch, index) -- is
all a checkpoint needs to resume exactly. Pure: no clock, no I/O.
"""

from __future__ import annotations

import numpy as np
import xxhash


def shard_seed(node_id: str, seed: int) -> int:
    """A 64-bit seed for this node's data order, stable across runs and machines."""
    return xxhash.xxh64_intdigest(f"{node_id}/{seed}".encode())


class Sampler:
    """Batches of (window) consecutive tokens from `tokens`, epoch by epoch."""

    def __init__(self, tokens: np.ndarray, window: int, seed: int, epoch: int = 0, index: int = 0):
        if tokens.size < window + 1:
            raise ValueError(f"{tokens.size} tokens cannot fill one window of {window}")
        self.tokens = tokens
        self.window = window  # tokens per sample: ctx_len + 1 (inputs and shifted targets)
        self.seed = seed
        self.epoch = epoch
        self.index = index
        self._starts = self._epoch_starts(epoch)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed & (2**63 - 1), epoch]))
        stride = self.window - 1  # consecutive windows share one token: target of the last
        span = self.tokens.size - self.window
        offset = int(rng.integers(0, min(stride, span) + 1))
        starts = np.arange(offset, span + 1, stride, dtype=np.int64)
        rng.shuffle(starts)
        return starts

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def next_batch(self, batch: int) -> np.ndarray:
        """(batch, window) tokens; advances the position."""
        out = np.empty((batch, self.window), dtype=np.int64)
        for row in range(batch):
            if self.index >= self._starts.size:
                self.epoch += 1
                self.index = 0
                self._starts = self._epoch_starts(self.epoch)
            start = self._starts[self.index]
            out[row] = self.tokens[start : start + self.window]
            self.index += 1
        return out


def eval_windows(tokens: np.ndarray, window: int, count: int) -> np.ndarray:
    """`count` windows spread evenly over the held-out split (the same every time, so that
    successive evaluations are comparable); fewer if the split is short."""
    span = tokens.size - window
    count = max(1, min(count, span // max(window - 1, 1) + 1))
    starts = np.linspace(0, span, count).astype(np.int64)
    return np.stack([tokens[s : s + window] for s in starts]).astype(np.int64)
